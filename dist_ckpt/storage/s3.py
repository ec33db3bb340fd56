"""S3-compatible object storage behind the [`Storage`][dist_ckpt.storage.base.Storage] interface.

Client library: `obstore <https://developmentseed.org/obstore>`_ (Python bindings of the Rust
``object_store`` crate of Apache Arrow), installed with the ``s3`` extra
(``pip install "dist_ckpt[s3]"``). Chosen over s3fs/fsspec because

* it is one self-contained, typed wheel (s3fs brings aiobotocore, aiohttp and five more
  packages, and aiobotocore pins botocore to a narrow range that must move in lockstep with the
  boto3 a training environment already has; fsspec also runs its own event-loop thread);
* its calls release the GIL and run on a Rust runtime, so ranged GETs from a few Python threads
  really run concurrently;
* it has what a checkpoint needs built in and tested against AWS: create-if-absent puts
  (``If-None-Match: *``), multipart uploads with concurrent parts, per-request retries with
  exponential backoff and jitter (each multipart part is retried on its own, so a 503 on one
  part does not restart a multi-GB upload), ranged GETs, bulk deletes;
* zarr-python 3 ships a store on top of it (``zarr.storage.ObjectStore``), so the Zarr backend
  uses the same client on S3 ([`S3Storage.obstore_store()`][dist_ckpt.storage.s3.S3Storage.obstore_store]).

Configuration comes from the usual AWS environment variables, read when a storage is opened:
endpoint ``AWS_ENDPOINT_URL_S3`` > ``AWS_ENDPOINT_URL`` > ``AWS_ENDPOINT`` (or
`S3StorageOptions.endpoint_url`); region ``AWS_REGION`` > ``AWS_DEFAULT_REGION``;
credentials ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, web
identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``), ECS container credentials or the
EC2 instance metadata service, all resolved by obstore. Without key variables but with a
profile (``AWS_PROFILE`` or ``~/.aws/credentials`` / ``~/.aws/config``) and boto3 installed,
boto3's credential chain supplies (and refreshes) the keys. With none of these and
``AWS_EC2_METADATA_DISABLED=true``, opening fails with `StorageAuthError` before any
request (otherwise the instance metadata service is asked, as every AWS SDK does). Plain ``http://`` endpoints (a local
MinIO or moto) are allowed only when the endpoint itself says ``http://``. Credentials are
never written into a checkpoint, a log or an error message (messages are redacted).

Errors: [`ObjectNotFoundError`][dist_ckpt.storage.errors.ObjectNotFoundError], `BucketNotFoundError`,
`StorageAuthError`, `ObjectExistsError`, `RetriesExhaustedError` (operation, attempts, last HTTP
status), [`TruncatedObjectError`][dist_ckpt.storage.errors.TruncatedObjectError] -- see
[`dist_ckpt.storage.errors`][dist_ckpt.storage.errors].

Processes: obstore's runtime does not survive ``fork`` (a forked child hangs on its first
request). A storage used in a forked child of a process that already made S3 requests raises a
[`StorageError`][dist_ckpt.storage.errors.StorageError] instead of hanging; start workers with ``spawn`` (as
`dist_ckpt.tools.launch` does).

Array libraries with their own S3 clients get the location from here:
[`S3Storage.obstore_store()`][dist_ckpt.storage.s3.S3Storage.obstore_store] for zarr-python 3
(``zarr.storage.ObjectStore``) and
[`S3Storage.tensorstore_kvstore()`][dist_ckpt.storage.s3.S3Storage.tensorstore_kvstore] for TensorStore's ``s3`` kvstore
driver. How the save and load paths use all this (phase B of issue 7) is in ``docs/storage.md``.

Example:

```python
storage = S3Storage.from_url("s3://my-bucket/runs/exp1/iter_0001000")
storage.write("common.pt", data)
storage.put_if_absent("metadata.json", meta)      # the commit marker, created once
```
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from dist_ckpt.storage.base import ObjectInfo, ObjectWriter, Storage
from dist_ckpt.storage.errors import ObjectNotFoundError, StorageError, TruncatedObjectError
from dist_ckpt.storage.meter import count_bytes
from dist_ckpt.storage.paths import validate_object_key, validate_prefix
from dist_ckpt.storage.ranges import BufferLike, RangeRead, as_byte_view, check_reads, coalesce_ranges
from dist_ckpt.storage.s3_client import (
    S3Client,
    S3StorageOptions,
    check_process,
    import_obstore,
    parse_s3_url,
    translate_error,
)
from dist_ckpt.storage.stats import IOCounters

if TYPE_CHECKING:  # pragma: no cover
    from obstore.store import S3Store

logger = logging.getLogger(__name__)

__all__ = ["S3Storage", "S3StorageOptions", "parse_s3_url"]

_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys

T = TypeVar("T")


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix`` on AWS S3 or any S3-compatible server.

    Open one with [`open_storage()`][dist_ckpt.storage.base.open_storage] or [`from_url()`][.from_url]. Each rank
    opens its own; a storage is thread-safe. See the module docstring for configuration.

    Example:

    ```python
    storage = S3Storage.from_url("s3://bucket/ckpt/iter_1000", S3StorageOptions(part_size=32 * 2**20))
    storage.write_buffers("rank0.bin", [header, memoryview(t.numpy())])
    out = torch.empty(1024, dtype=torch.uint8)
    storage.read_ranges([RangeRead.into("rank0.bin", 4096, memoryview(out.numpy()))])
    storage.stats.bytes_read                       # 1024
    ```
    """

    atomic_rename = False
    conditional_put = True
    ranged_read = True
    multipart_upload = True
    local_paths = False
    s3_compatible = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        options: Optional[S3StorageOptions] = None,
        *,
        counters: Optional[IOCounters] = None,
        _client: Optional[S3Client] = None,
    ) -> None:
        super().__init__(counters)
        bucket, parsed = parse_s3_url(f"s3://{bucket}/{prefix}")
        self.bucket = bucket
        self.prefix = parsed
        self.options = (
            options if options is not None else (_client.options if _client is not None else S3StorageOptions())
        )
        self._client = _client if _client is not None else S3Client.create(bucket, self.options)

    @classmethod
    def from_url(cls, url: str, options: Optional[S3StorageOptions] = None) -> "S3Storage":
        """The storage rooted at ``s3://bucket/prefix``.

        Example:

        ```python
        storage = S3Storage.from_url("s3://bucket/runs/exp1")
        ```
        """
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, options)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickle as location and options only -- never the client or credentials: the process
        that unpickles it opens its own client from its own environment (how the spawned worker
        of an asynchronous save gets one; obstore's client cannot cross processes). The copy
        counts its own I/O."""
        return (S3Storage, (self.bucket, self.prefix, self.options))

    def _path(self, key: str) -> str:
        validate_object_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- handing the location to array libraries with their own S3 clients ---------------------

    def obstore_store(self) -> "S3Store":
        """An obstore ``S3Store`` rooted at this storage's prefix, configured like this storage.

        For zarr-python 3 on S3: ``zarr.storage.ObjectStore(storage.obstore_store())`` reads and
        writes arrays under this prefix with the same endpoint, credentials and retries.

        Example:

        ```python
        import zarr
        group = zarr.open_group(zarr.storage.ObjectStore(storage.obstore_store()), path="zarr")
        ```
        """
        from obstore.store import S3Store

        return S3Store(self.bucket, prefix=self.prefix or None, **self._client.store_kwargs)

    def tensorstore_kvstore(self, key: str = "") -> Dict[str, Any]:
        """A TensorStore ``s3`` kvstore spec for the directory ``key`` under this storage.

        Bucket, path, region and the endpoint (when one is configured: always pass it, or
        TensorStore goes to AWS) plus retry and concurrency limits from the options.
        Credentials are not in the spec: TensorStore reads the same AWS environment variables
        and profiles itself.

        Example:

        ```python
        spec = {"driver": "zarr3", "kvstore": storage.tensorstore_kvstore("zarr/layer.weight")}
        ```
        """
        path = self._path(key) if key else self.prefix
        opts = self.options
        spec: Dict[str, Any] = {
            "driver": "s3",
            "bucket": self.bucket,
            "path": f"{path}/" if path else "",
            "aws_region": self._client.region,
            "context": {
                "s3_request_retries": {
                    "max_retries": opts.max_retries,  # also retries after the first attempt (measured)
                    "initial_delay": f"{opts.initial_backoff_s}s",
                    "max_delay": f"{opts.max_backoff_s}s",
                },
                "s3_request_concurrency": {"limit": opts.max_concurrency},
            },
        }
        if self._client.custom_endpoint:
            spec["endpoint"] = self._client.custom_endpoint
        return spec

    # -- calling obstore ----------------------------------------------------------------------

    def _call(self, operation: str, key: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one obstore call; translate its errors into the storage error family."""
        check_process()
        obstore = import_obstore()
        try:
            return fn(*args, **kwargs)
        except (obstore.exceptions.BaseError, OSError) as e:
            if isinstance(e, StorageError):
                raise
            raise self.storage_error(e, operation, key) from e

    def storage_error(
        self, error: BaseException, operation: str, key: str = ""
    ) -> "StorageError | TruncatedObjectError":
        """The storage error (redacted, naming the URL) for ``error`` raised by a request that
        another library (zarr-python's ObjectStore over [`obstore_store()`][..obstore_store]) made for ``key``.

        Example:

        ```text
        except obstore.exceptions.BaseError as e:
            raise storage.storage_error(e, "PUT", "zarr/w/zarr.json") from e
        ```
        """
        url = self.url_of(key) if key else self.url
        return translate_error(error, operation=operation, url=url, bucket=self.bucket, client=self._client)

    # -- writing -----------------------------------------------------------------------------

    def write(self, key: str, data: BufferLike) -> None:
        self.write_buffers(key, [data])

    def write_buffers(self, key: str, buffers: Sequence[BufferLike]) -> None:
        obstore = import_obstore()
        path = self._path(key)
        views = [as_byte_view(b) for b in buffers]
        total = sum(len(v) for v in views)
        opts = self.options
        if total <= opts.part_size:
            body: BufferLike = views[0] if len(views) == 1 else b"".join(views)
            self._call("PUT", key, obstore.put, self._client.store, path, body, use_multipart=False)
        else:
            self._call(
                "PUT (multipart)",
                key,
                obstore.put,
                self._client.store,
                path,
                iter(views),
                use_multipart=True,
                chunk_size=opts.part_size,
                max_concurrency=opts.max_concurrency,
            )
        count_bytes(total)
        self._counters.add(bytes_written=total, objects_written=1)

    def open_writer(self, key: str) -> ObjectWriter:
        return _S3Writer(self, key)

    def put_if_absent(self, key: str, data: BufferLike) -> None:
        obstore = import_obstore()
        view = as_byte_view(data)
        self._call(
            "put_if_absent",
            key,
            obstore.put,
            self._client.store,
            self._path(key),
            view,
            mode="create",
            use_multipart=False,
        )
        count_bytes(len(view))
        self._counters.add(bytes_written=len(view), objects_written=1)

    # -- reading -----------------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        obstore = import_obstore()
        path = self._path(key)

        def get() -> bytes:
            return bytes(obstore.get(self._client.store, path).bytes())

        data = self._call("GET", key, get)
        count_bytes(len(data))
        self._counters.add(bytes_read=len(data), read_requests=1)
        return data

    def read_ranges(self, reads: Sequence[RangeRead]) -> None:
        opts = self.options
        requests = coalesce_ranges(check_reads(reads), opts.read_chunk_size, opts.coalesce_gap)
        if not requests:
            return
        workers = min(opts.max_concurrency, len(requests))
        if workers == 1:
            for request in requests:
                self._get_range(request)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="dist_ckpt-s3-get") as pool:
            futures = [pool.submit(self._get_range, r) for r in requests]
            try:
                for future in futures:
                    future.result()
            finally:
                for future in futures:
                    future.cancel()

    def _get_range(self, request: RangeRead) -> None:
        """One ranged GET, copied into the request's buffers (the one copy out of the client)."""
        obstore = import_obstore()
        length = request.length
        data = self._call(
            "GET",
            request.key,
            obstore.get_range,
            self._client.store,
            self._path(request.key),
            start=request.offset,
            length=length,
        )
        view = memoryview(data)
        if len(view) != length:
            url = self.url_of(request.key)
            raise TruncatedObjectError(
                f"GET {url}: bytes {request.offset}..{request.offset + length} were requested but the object ends at "
                "byte "
                f"{request.offset + len(view)} (it was truncated, or the index describing it is wrong)"
            )
        position = 0
        for buf in request.buffers:
            buf[:] = view[position : position + len(buf)]
            position += len(buf)
        count_bytes(length)
        self._counters.add(bytes_read=length, read_requests=1)

    # -- metadata ----------------------------------------------------------------------------

    def _head(self, key: str) -> Dict[str, Any]:
        obstore = import_obstore()
        self._counters.add(metadata_requests=1)
        try:
            return dict(self._call("HEAD", key, obstore.head, self._client.store, self._path(key)))
        except ObjectNotFoundError:
            self._check_bucket(key)  # a HEAD 404 has no body: tell a missing bucket from a missing key
            raise

    def _check_bucket(self, key: str) -> None:
        """Raise `BucketNotFoundError` if the bucket is missing (one LIST, once per client)."""
        if self._client.bucket_seen:
            return
        obstore = import_obstore()
        self._counters.add(metadata_requests=1)
        self._call("LIST", key, obstore.list_with_delimiter, self._client.store, prefix=self._path(key))
        self._client.bucket_seen = True

    def size(self, key: str) -> int:
        return int(self._head(key)["size"])

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except ObjectNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> List[ObjectInfo]:
        obstore = import_obstore()
        validate_prefix(prefix)
        self._counters.add(metadata_requests=1)
        full = self._path(prefix) if prefix else self.prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def collect() -> List[ObjectInfo]:
            found = []
            for batch in obstore.list(self._client.store, prefix=full or None):
                for meta in batch:
                    found.append(ObjectInfo(str(meta["path"])[strip:], int(meta["size"])))
            return found

        return sorted(self._call("LIST", prefix, collect), key=lambda o: o.key)

    def list_dirs(self, prefix: str = "") -> List[str]:
        obstore = import_obstore()
        validate_prefix(prefix)
        self._counters.add(metadata_requests=1)
        full = self._path(prefix) if prefix else self.prefix
        listing = self._call("LIST", prefix, obstore.list_with_delimiter, self._client.store, prefix=full or None)
        strip = len(full) + 1 if full else 0
        return sorted(str(p)[strip:] for p in listing["common_prefixes"])

    def dir_exists(self, prefix: str = "") -> bool:
        """Whether an object lives under ``prefix``: one LIST of one level (objects and common
        prefixes come back together)."""
        obstore = import_obstore()
        validate_prefix(prefix)
        self._counters.add(metadata_requests=1)
        full = self._path(prefix) if prefix else self.prefix
        listing = self._call("LIST", prefix, obstore.list_with_delimiter, self._client.store, prefix=full or None)
        return bool(listing["objects"]) or bool(listing["common_prefixes"])

    def delete(self, key: str) -> None:
        obstore = import_obstore()
        self._counters.add(metadata_requests=1)
        try:
            self._call("DELETE", key, obstore.delete, self._client.store, self._path(key))
        except ObjectNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> int:
        obstore = import_obstore()
        keys = [o.key for o in self.list(prefix)]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [self._path(k) for k in keys[start : start + _DELETE_BATCH]]
            self._counters.add(metadata_requests=1)
            self._call("DELETE", prefix, obstore.delete, self._client.store, batch)
        return len(keys)

    def child(self, prefix: str) -> "S3Storage":
        validate_object_key(prefix)
        joined = f"{self.prefix}/{prefix}" if self.prefix else prefix
        return S3Storage(self.bucket, joined, self.options, counters=self._counters, _client=self._client)


class _S3Writer(ObjectWriter):
    """Streaming upload through obstore's buffered writer: parts of ``part_size``, uploaded concurrently.

    ``write`` copies the data once (obstore keeps references to what it is given until the part
    is sent, and the caller may reuse its buffer); `S3Storage.write_buffers()` is the
    zero-copy path for data that stays put until the call returns. The object
    appears when the upload completes in `commit()`; `abort()` cancels the multipart
    upload, leaving nothing.
    """

    def __init__(self, storage: S3Storage, key: str) -> None:
        obstore = import_obstore()
        self._storage = storage
        self._key = key
        opts = storage.options
        self._file: Any = storage._call(
            "PUT (stream)",
            key,
            obstore.open_writer,
            storage._client.store,
            storage._path(key),
            buffer_size=opts.part_size,
            max_concurrency=opts.max_concurrency,
        )
        self._written = 0
        self._done = False

    def write(self, data: BufferLike) -> int:
        if self._file is None:
            url = self._storage.url_of(self._key)
            raise StorageError(f"write to {url} after commit/abort", url=url, operation="write")
        view = as_byte_view(data)
        if len(view):
            # obstore's writer keeps a reference to what it is given until the part is sent, so
            # hand it an immutable copy: the caller may reuse its buffer as soon as we return
            self._storage._call("PUT (stream)", self._key, self._file.write, bytes(view))
        self._written += len(view)
        count_bytes(len(view))
        return len(view)

    def commit(self) -> None:
        if self._done:
            return
        if self._file is None:
            url = self._storage.url_of(self._key)
            raise StorageError(f"commit of {url} after abort", url=url, operation="commit")
        file, self._file = self._file, None
        try:
            self._storage._call("PUT (stream)", self._key, file.close)
        except BaseException:
            _abort_file(file)
            raise
        self._done = True
        self._storage._counters.add(bytes_written=self._written, objects_written=1)

    def abort(self) -> None:
        if self._done or self._file is None:
            return
        file, self._file = self._file, None
        _abort_file(file)


def _abort_file(file: Any) -> None:
    """Leave a buffered obstore writer without completing its upload.

    Exiting its context with an exception is obstore's documented way to abort: the multipart
    upload (if one was started) is aborted and nothing becomes visible.
    """
    try:
        file.__exit__(RuntimeError, RuntimeError("dist_ckpt: upload aborted"), None)
    except Exception as e:  # noqa: BLE001 -- the caller is already handling the original failure
        logger.debug("aborting an S3 upload failed as well: %s", type(e).__name__)
