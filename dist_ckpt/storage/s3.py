"""S3-compatible object storage behind the :class:`~dist_ckpt.storage.base.Storage` interface.

Client library: `obstore <https://developmentseed.org/obstore>`_ (Python bindings of the Rust
``object_store`` crate of Apache Arrow), installed with the ``s3`` extra
(``pip install "dist_ckpt[s3]"``). Chosen over s3fs/fsspec because

* it is one self-contained, typed wheel (no aiobotocore, whose tight botocore pins fight the
  boto3 a training environment already has; no fsspec event-loop thread);
* its calls release the GIL and run on a Rust runtime, so ranged GETs from a few Python threads
  really run concurrently;
* it has what a checkpoint needs built in and tested against AWS: create-if-absent puts
  (``If-None-Match: *``), multipart uploads with concurrent parts, per-request retries with
  exponential backoff and jitter (each multipart part is retried on its own, so a 503 on one
  part does not restart a multi-GB upload), ranged GETs, bulk deletes;
* zarr-python 3 ships a store on top of it (``zarr.storage.ObjectStore``), so the Zarr backend
  can use the same client on S3 (see "Phase B" below).

Configuration comes from the usual AWS environment variables, read when a storage is opened:
endpoint ``AWS_ENDPOINT_URL_S3`` > ``AWS_ENDPOINT_URL`` > ``AWS_ENDPOINT`` (or
:attr:`S3StorageOptions.endpoint_url`); region ``AWS_REGION`` > ``AWS_DEFAULT_REGION``;
credentials ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, web
identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``), ECS container credentials or the
EC2 instance metadata service, all resolved by obstore. Without key variables but with a
profile (``AWS_PROFILE`` or ``~/.aws/credentials`` / ``~/.aws/config``) and boto3 installed,
boto3's credential chain supplies (and refreshes) the keys. Plain ``http://`` endpoints (a local
MinIO or moto) are allowed only when the endpoint itself says ``http://``. Credentials are
never written into a checkpoint, a log or an error message (messages are redacted).

Errors: :class:`ObjectNotFoundError`, :class:`BucketNotFoundError`, :class:`StorageAuthError`,
:class:`ObjectExistsError`, :class:`RetriesExhaustedError` (operation, attempts, last HTTP
status), :class:`TruncatedObjectError` -- see :mod:`dist_ckpt.storage.errors`.

Processes: obstore's runtime does not survive ``fork`` (a forked child hangs on its first
request). A storage used in a forked child of a process that already made S3 requests raises a
:class:`StorageError` instead of hanging; start workers with ``spawn`` (as
:mod:`dist_ckpt.testing.launch` does).

Phase B (wiring into save / load), as researched for issue 7:

* safetensors: each rank writes its ``rankNNNNN_T.safetensors`` with :meth:`S3Storage.open_writer`
  (header, then tensor memoryviews; multipart above ``part_size``) or ``write_buffers``; the
  index and ``metadata.json`` last, the latter with ``put_if_absent`` by rank 0 after a barrier.
  Loads turn ``safetensors_io`` ``DirectRead``s into :class:`RangeRead` s (same scatter
  semantics as ``preadv``) and call ``read_ranges``; ``BounceRead``s read the covering span into
  the bounce buffer the same way.
* zarr: zarr-python 3's ``zarr.storage.ObjectStore(obstore.store.S3Store(...))`` (and
  ``FsspecStore`` with s3fs) read and write the same layout on S3; verified against the moto
  server in ``tests/unit/test_storage_s3_backends.py``.
* TensorStore: its ``"s3"`` kvstore driver (``{"driver": "s3", "bucket": ..., "path": ...,
  "endpoint": ..., "aws_region": ...}``; credentials from the same AWS variables) reads and
  writes zarr arrays on S3; verified against the moto server in the same test module.

Example::

    storage = S3Storage.from_url("s3://my-bucket/runs/exp1/iter_0001000")
    storage.write("common.pt", data)
    storage.put_if_absent("metadata.json", meta)      # the commit marker, created once
"""

from __future__ import annotations

import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar

from ..errors import MissingDependencyError
from .base import (
    BufferLike,
    IOCounters,
    ObjectInfo,
    ObjectWriter,
    RangeRead,
    Storage,
    _check_reads,
    as_byte_view,
    coalesce_ranges,
    validate_object_key,
    validate_prefix,
)
from .errors import (
    BucketNotFoundError,
    ObjectExistsError,
    ObjectNotFoundError,
    RetriesExhaustedError,
    StorageAuthError,
    StorageConfigError,
    StorageError,
    TruncatedObjectError,
)

if TYPE_CHECKING:  # pragma: no cover
    from obstore.store import S3Store

logger = logging.getLogger(__name__)

__all__ = ["S3Storage", "S3StorageOptions", "parse_s3_url"]

_MIN_PART = 5 * 2**20  # S3's minimum part size (all parts but the last)
_MAX_PART = 5 * 2**30  # S3's maximum part size
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys

T = TypeVar("T")


@dataclass(frozen=True)
class S3StorageOptions:
    """How :class:`S3Storage` talks to the object store.

    Attributes:
        part_size: multipart part size in bytes (S3 allows 5 MiB .. 5 GiB); objects larger than
            this are uploaded in parts, up to ``max_concurrency`` at a time.
        max_concurrency: requests in flight for one ``read_ranges`` call or one upload.
        read_chunk_size: a range larger than this is fetched as several concurrent GETs;
            neighbouring ranges are merged up to this size.
        coalesce_gap: merge ranges of one object separated by at most this many bytes (the
            gap is downloaded and dropped; 0 merges only exactly adjacent ranges).
        max_retries: retries of one request after a transient error (5xx, 429, connection
            errors, read timeouts); a request is sent at most ``max_retries + 1`` times.
        initial_backoff_s, max_backoff_s, backoff_base: exponential backoff with jitter
            between retries (obstore / object_store's ``BackoffConfig``).
        retry_timeout_s: no retry starts later than this after the first attempt.
        connect_timeout_s: TCP/TLS connect timeout.
        request_timeout_s: whole-request timeout (generous: a part of ``part_size`` must fit).
        endpoint_url: overrides the endpoint from the environment (e.g. ``http://127.0.0.1:9000``).
        region: overrides the region from the environment.
        allow_http: allow a plain ``http://`` endpoint; None allows it exactly when the
            endpoint URL starts with ``http://``.
        user_agent: ``User-Agent`` of the requests (lets a test server tell ranks apart).
    """

    part_size: int = 64 * 2**20
    max_concurrency: int = 16
    read_chunk_size: int = 16 * 2**20
    coalesce_gap: int = 0
    max_retries: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    backoff_base: float = 2.0
    retry_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    endpoint_url: Optional[str] = None
    region: Optional[str] = None
    allow_http: Optional[bool] = None
    user_agent: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.part_size, int) or not _MIN_PART <= self.part_size <= _MAX_PART:
            raise StorageConfigError(f"S3StorageOptions.part_size must be an int between 5 MiB and 5 GiB (S3's part limits), got {self.part_size!r}")
        for name in ("max_concurrency", "read_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StorageConfigError(f"S3StorageOptions.{name} must be a positive int, got {value!r}")
        for name in ("coalesce_gap", "max_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise StorageConfigError(f"S3StorageOptions.{name} must be an int >= 0, got {value!r}")
        for name in ("initial_backoff_s", "max_backoff_s", "retry_timeout_s", "connect_timeout_s", "request_timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise StorageConfigError(f"S3StorageOptions.{name} must be > 0, got {getattr(self, name)!r}")
        if not float(self.backoff_base) >= 1:
            raise StorageConfigError(f"S3StorageOptions.backoff_base must be >= 1, got {self.backoff_base!r}")


def parse_s3_url(url: str) -> Tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)``; the prefix has no outer slashes.

    Example::

        parse_s3_url("s3://my-bucket/runs/exp1/")   # ("my-bucket", "runs/exp1")
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("s3", "s3a"):
        raise StorageConfigError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise StorageConfigError(
            f"S3 URL {url!r}: {bucket!r} is not a valid bucket name (3-63 characters: lowercase letters, digits, '.', '-')"
        )
    prefix = prefix.strip("/")
    if prefix:
        validate_object_key(prefix)
    return bucket, prefix


# -- obstore, loaded lazily ------------------------------------------------------------------

_runtime_pid: Optional[int] = None  # the process whose obstore runtime made requests
_pid_lock = threading.Lock()


def _obstore() -> Any:
    """The ``obstore`` module, or a :class:`MissingDependencyError` naming the extra."""
    try:
        import obstore
    except ImportError as e:
        raise MissingDependencyError(
            "S3 storage (s3:// URLs) needs the obstore client library: pip install \"dist_ckpt[s3]\""
        ) from e
    return obstore


def _check_process() -> None:
    """Fail fast instead of hanging when obstore is used after ``fork``."""
    global _runtime_pid
    pid = os.getpid()
    with _pid_lock:
        if _runtime_pid is None:
            _runtime_pid = pid
        elif _runtime_pid != pid:
            raise StorageError(
                "S3 storage used in a forked child process: the S3 client (obstore) started its runtime in the parent "
                f"(pid {_runtime_pid}) and that runtime does not survive fork(); start worker processes with the "
                "'spawn' method (multiprocessing.get_context('spawn')) or torchrun/mpirun",
                operation="fork",
            )


class _Boto3Credentials:
    """obstore credential provider backed by boto3's chain (profiles, SSO, ``~/.aws`` files).

    Remembers the secrets it hands out so that error messages can redact them.
    """

    def __init__(self, session: Any, secrets: Set[str]) -> None:
        credentials = session.get_credentials()
        if credentials is None:
            raise StorageAuthError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or configure a profile (AWS_PROFILE)",
                operation="credentials",
            )
        self._credentials = credentials
        self._secrets = secrets

    def __call__(self) -> Dict[str, Any]:
        frozen = self._credentials.get_frozen_credentials()
        for value in (frozen.access_key, frozen.secret_key, frozen.token):
            if value:
                self._secrets.add(str(value))
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(timezone.utc) + timedelta(minutes=15),
        }


def _first_env(*names: str) -> Optional[str]:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def _has_aws_profile() -> bool:
    if os.environ.get("AWS_PROFILE") or os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.environ.get("AWS_CONFIG_FILE"):
        return True
    home = os.path.expanduser("~/.aws")
    return os.path.isfile(os.path.join(home, "credentials")) or os.path.isfile(os.path.join(home, "config"))


@dataclass
class _Client:
    """One obstore ``S3Store`` for a bucket (no prefix), shared by a storage and its children."""

    bucket: str
    options: S3StorageOptions
    endpoint: str
    store: "S3Store"
    secrets: Set[str] = field(default_factory=set)
    store_kwargs: Dict[str, Any] = field(default_factory=dict)  # to build more stores alike (no secrets)
    region: str = "us-east-1"
    custom_endpoint: Optional[str] = None
    bucket_seen: bool = False  # a request succeeded on the bucket, so it exists

    @classmethod
    def create(cls, bucket: str, options: S3StorageOptions) -> "_Client":
        obstore = _obstore()
        from obstore.store import S3Store

        if _runtime_pid is not None and _runtime_pid != os.getpid():
            _check_process()  # raises: creating a store in a forked child would hang later
        secrets = {v for v in (os.environ.get(n) for n in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_TOKEN")) if v}
        endpoint = options.endpoint_url or _first_env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
        region = options.region or _first_env("AWS_REGION", "AWS_DEFAULT_REGION")
        provider: Optional[_Boto3Credentials] = None
        if not os.environ.get("AWS_ACCESS_KEY_ID") and _has_aws_profile():
            try:
                import boto3
            except ImportError:
                boto3 = None
            if boto3 is not None:
                session = boto3.Session()
                provider = _Boto3Credentials(session, secrets)
                region = region or session.region_name
        config: Dict[str, Any] = {"region": region or "us-east-1"}
        if endpoint:
            config["endpoint"] = endpoint
        allow_http = options.allow_http if options.allow_http is not None else bool(endpoint and endpoint.lower().startswith("http://"))
        client_options: Dict[str, Any] = {
            "allow_http": allow_http,
            "connect_timeout": timedelta(seconds=options.connect_timeout_s),
            "timeout": timedelta(seconds=options.request_timeout_s),
        }
        if options.user_agent:
            client_options["user_agent"] = options.user_agent
        retry_config: Dict[str, Any] = {
            "max_retries": options.max_retries,
            "retry_timeout": timedelta(seconds=options.retry_timeout_s),
            "backoff": {
                "init_backoff": timedelta(seconds=options.initial_backoff_s),
                "max_backoff": timedelta(seconds=options.max_backoff_s),
                "base": options.backoff_base,
            },
        }
        store_kwargs: Dict[str, Any] = dict(
            config=config, client_options=client_options, retry_config=retry_config, credential_provider=provider
        )
        try:
            store = S3Store(bucket, **store_kwargs)
        except obstore.exceptions.BaseError as e:
            raise StorageConfigError(_redact(f"cannot configure the S3 client for bucket {bucket!r}: {e}", secrets)) from e
        return cls(bucket, options, endpoint or f"AWS S3 ({config['region']})", store, secrets, store_kwargs, config["region"], endpoint)


def _redact(text: str, secrets: Set[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


_STATUS_RE = re.compile(r"status code: (\d{3})")
_CODE_RE = re.compile(r"<Code>([^<]{1,100})</Code>")
_MESSAGE_RE = re.compile(r"<Message>([^<]{0,300})</Message>")
_RETRIES_RE = re.compile(r"after (\d+) retries")
_CONNECTION_HINTS = ("error sending request", "connection", "timed out", "timeout", "dns error", "broken pipe")


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix`` on AWS S3 or any S3-compatible server.

    Open one with :func:`~dist_ckpt.storage.base.open_storage` or :meth:`from_url`. Each rank
    opens its own; a storage is thread-safe. See the module docstring for configuration.

    Example::

        storage = S3Storage.from_url("s3://bucket/ckpt/iter_1000", S3StorageOptions(part_size=32 * 2**20))
        storage.write_buffers("rank0.bin", [header, memoryview(t.numpy())])
        out = torch.empty(1024, dtype=torch.uint8)
        storage.read_ranges([RangeRead.into("rank0.bin", 4096, memoryview(out.numpy()))])
        storage.stats.bytes_read                       # 1024
    """

    atomic_rename = False
    conditional_put = True
    ranged_read = True
    multipart_upload = True
    local_paths = False

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        options: Optional[S3StorageOptions] = None,
        *,
        counters: Optional[IOCounters] = None,
        _client: Optional[_Client] = None,
    ) -> None:
        super().__init__(counters)
        bucket, parsed = parse_s3_url(f"s3://{bucket}/{prefix}")
        self.bucket = bucket
        self.prefix = parsed
        self.options = options if options is not None else (_client.options if _client is not None else S3StorageOptions())
        self._client = _client if _client is not None else _Client.create(bucket, self.options)

    @classmethod
    def from_url(cls, url: str, options: Optional[S3StorageOptions] = None) -> "S3Storage":
        """The storage rooted at ``s3://bucket/prefix``.

        Example::

            storage = S3Storage.from_url("s3://bucket/runs/exp1")
        """
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, options)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _path(self, key: str) -> str:
        validate_object_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- handing the location to array libraries with their own S3 clients ---------------------

    def obstore_store(self) -> "S3Store":
        """An obstore ``S3Store`` rooted at this storage's prefix, configured like this storage.

        For zarr-python 3 on S3: ``zarr.storage.ObjectStore(storage.obstore_store())`` reads and
        writes arrays under this prefix with the same endpoint, credentials and retries.

        Example::

            import zarr
            group = zarr.open_group(zarr.storage.ObjectStore(storage.obstore_store()), path="zarr")
        """
        from obstore.store import S3Store

        return S3Store(self.bucket, prefix=self.prefix or None, **self._client.store_kwargs)

    def tensorstore_kvstore(self, key: str = "") -> Dict[str, Any]:
        """A TensorStore ``s3`` kvstore spec for the directory ``key`` under this storage.

        Bucket, path, region and the endpoint (when one is configured: always pass it, or
        TensorStore goes to AWS) plus retry and concurrency limits from the options.
        Credentials are not in the spec: TensorStore reads the same AWS environment variables
        and profiles itself.

        Example::

            spec = {"driver": "zarr3", "kvstore": storage.tensorstore_kvstore("zarr/layer.weight")}
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
        _check_process()
        obstore = _obstore()
        try:
            return fn(*args, **kwargs)
        except (obstore.exceptions.BaseError, OSError) as e:
            if isinstance(e, StorageError):
                raise
            raise self._translate(e, operation, key) from e

    def _translate(self, error: BaseException, operation: str, key: str) -> "StorageError | TruncatedObjectError":
        """A clear, redacted error for a failed request: what, where, which status, how to fix."""
        obstore = _obstore()
        text = _redact(str(error), self._client.secrets)
        url = self.url_of(key) if key else self.url
        status_match = _STATUS_RE.search(text)
        status = int(status_match.group(1)) if status_match else None
        code_match = _CODE_RE.search(text)
        code = code_match.group(1) if code_match else ""
        message_match = _MESSAGE_RE.search(text)
        s3_message = message_match.group(1) if message_match else ""
        detail = " ".join(p for p in (f"HTTP {status}" if status else "", code, f"({s3_message})" if s3_message else "") if p)
        where = f"{operation} {url} (endpoint {self._client.endpoint})"
        exc = obstore.exceptions
        if isinstance(error, exc.AlreadyExistsError) or (status == 412 and operation == "put_if_absent"):
            return ObjectExistsError(
                f"{where}: an object already exists at this key and was left untouched "
                "(another save committed here; use a new checkpoint location)",
                url=url,
                operation=operation,
            )
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                f"{where}: bucket {self.bucket!r} does not exist [{detail}]; create it, or fix the URL / AWS_ENDPOINT_URL",
                url=url,
                operation=operation,
            )
        if isinstance(error, (exc.PermissionDeniedError, exc.UnauthenticatedError)) or status in (401, 403):
            return StorageAuthError(
                f"{where}: the server refused the credentials [{detail}]; check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (or AWS_PROFILE) and the bucket policy",
                url=url,
                operation=operation,
            )
        if isinstance(error, FileNotFoundError) or code == "NoSuchKey" or status == 404:
            return ObjectNotFoundError(f"{where}: no such object [{detail or 'HTTP 404'}]", url=url, operation=operation)
        if status == 416 or code == "InvalidRange":
            return TruncatedObjectError(
                f"{where}: the object is shorter than the requested range [{detail}] "
                "(it was truncated, or the index describing it is wrong)"
            )
        lowered = text.lower()
        transient = (status is not None and (status >= 500 or status == 429)) or (
            status is None and any(h in lowered for h in _CONNECTION_HINTS)
        )
        if transient:
            retries_match = _RETRIES_RE.search(text)
            attempts = int(retries_match.group(1)) + 1 if retries_match else self.options.max_retries + 1
            last = detail if status is not None else f"no response ({_first_line(text)})"
            return RetriesExhaustedError(
                f"{where} failed after {attempts} attempt(s) (max_retries={self.options.max_retries}); last: {last}. "
                "The server kept failing with transient errors: retry later, or raise S3StorageOptions.max_retries",
                url=url,
                operation=operation,
                attempts=attempts,
                last_status=status,
            )
        return StorageError(f"{where} failed: {detail or _first_line(text)}", url=url, operation=operation)

    # -- writing -----------------------------------------------------------------------------

    def write(self, key: str, data: BufferLike) -> None:
        self.write_buffers(key, [data])

    def write_buffers(self, key: str, buffers: Sequence[BufferLike]) -> None:
        obstore = _obstore()
        path = self._path(key)
        views = [as_byte_view(b) for b in buffers]
        total = sum(len(v) for v in views)
        opts = self.options
        if total <= opts.part_size:
            body: BufferLike = views[0] if len(views) == 1 else b"".join(views)
            self._call("PUT", key, obstore.put, self._client.store, path, body, use_multipart=False)
        else:
            self._call(
                "PUT (multipart)", key, obstore.put, self._client.store, path, iter(views),
                use_multipart=True, chunk_size=opts.part_size, max_concurrency=opts.max_concurrency,
            )
        self._counters.add(bytes_written=total, objects_written=1)

    def open_writer(self, key: str) -> ObjectWriter:
        return _S3Writer(self, key)

    def put_if_absent(self, key: str, data: BufferLike) -> None:
        obstore = _obstore()
        view = as_byte_view(data)
        self._call("put_if_absent", key, obstore.put, self._client.store, self._path(key), view, mode="create", use_multipart=False)
        self._counters.add(bytes_written=len(view), objects_written=1)

    # -- reading -----------------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        obstore = _obstore()
        path = self._path(key)

        def get() -> bytes:
            return bytes(obstore.get(self._client.store, path).bytes())

        data = self._call("GET", key, get)
        self._counters.add(bytes_read=len(data), read_requests=1)
        return data

    def read_ranges(self, reads: Sequence[RangeRead]) -> None:
        opts = self.options
        requests = coalesce_ranges(_check_reads(reads), opts.read_chunk_size, opts.coalesce_gap)
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
        obstore = _obstore()
        length = request.length
        data = self._call("GET", request.key, obstore.get_range, self._client.store, self._path(request.key), start=request.offset, length=length)
        view = memoryview(data)
        if len(view) != length:
            url = self.url_of(request.key)
            raise TruncatedObjectError(
                f"GET {url}: bytes {request.offset}..{request.offset + length} were requested but the object ends at byte "
                f"{request.offset + len(view)} (it was truncated, or the index describing it is wrong)"
            )
        position = 0
        for buf in request.buffers:
            buf[:] = view[position : position + len(buf)]
            position += len(buf)
        self._counters.add(bytes_read=length, read_requests=1)

    # -- metadata ----------------------------------------------------------------------------

    def _head(self, key: str) -> Dict[str, Any]:
        obstore = _obstore()
        self._counters.add(metadata_requests=1)
        try:
            return dict(self._call("HEAD", key, obstore.head, self._client.store, self._path(key)))
        except ObjectNotFoundError:
            self._check_bucket(key)  # a HEAD 404 has no body: tell a missing bucket from a missing key
            raise

    def _check_bucket(self, key: str) -> None:
        """Raise :class:`BucketNotFoundError` if the bucket is missing (one LIST, once per client)."""
        if self._client.bucket_seen:
            return
        obstore = _obstore()
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
        obstore = _obstore()
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

    def delete(self, key: str) -> None:
        obstore = _obstore()
        self._counters.add(metadata_requests=1)
        try:
            self._call("DELETE", key, obstore.delete, self._client.store, self._path(key))
        except ObjectNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> int:
        obstore = _obstore()
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
    is sent, and the caller may reuse its buffer); :meth:`S3Storage.write_buffers` is the
    zero-copy path for data that stays put until the call returns. The object
    appears when the upload completes in :meth:`commit`; :meth:`abort` cancels the multipart
    upload, leaving nothing.
    """

    def __init__(self, storage: S3Storage, key: str) -> None:
        obstore = _obstore()
        self._storage = storage
        self._key = key
        opts = storage.options
        self._file: Any = storage._call(
            "PUT (stream)", key, obstore.open_writer, storage._client.store, storage._path(key),
            buffer_size=opts.part_size, max_concurrency=opts.max_concurrency,
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


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]
