"""Configuration of the S3 client for [`dist_ckpt.storage.s3`][dist_ckpt.storage.s3]: options, URLs, credentials,
errors.

Everything here runs once per opened storage (or once per failed request): the options and
their limits, ``s3://`` URL parsing, the lazy ``obstore`` import (importing dist_ckpt never
imports it), the fork guard, how endpoint / region / credentials are resolved from the AWS
environment, and how a failed request becomes a clear, redacted error of the storage family.
See [`dist_ckpt.storage.s3`][dist_ckpt.storage.s3] for the storage itself and why obstore.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Dict, Optional, Set, Tuple

from dist_ckpt.errors import MissingDependencyError
from dist_ckpt.storage.base import S3_SCHEMES
from dist_ckpt.storage.errors import (
    BucketNotFoundError,
    ObjectExistsError,
    ObjectNotFoundError,
    RetriesExhaustedError,
    StorageAuthError,
    StorageConfigError,
    StorageError,
    TruncatedObjectError,
)
from dist_ckpt.storage.paths import validate_object_key

if TYPE_CHECKING:  # pragma: no cover
    from obstore.store import S3Store

__all__ = ["S3Client", "S3StorageOptions", "check_process", "import_obstore", "parse_s3_url", "translate_error"]

_MIN_PART = 5 * 2**20  # S3's minimum part size (all parts but the last)
_MAX_PART = 5 * 2**30  # S3's maximum part size
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3StorageOptions:
    """How `S3Storage` talks to the object store.

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
            raise StorageConfigError(
                "S3StorageOptions.part_size must be an int between 5 MiB and 5 GiB (S3's part limits), got "
                f"{self.part_size!r}"
            )
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

    Example:

    ```python
    parse_s3_url("s3://my-bucket/runs/exp1/")   # ("my-bucket", "runs/exp1")
    ```
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in S3_SCHEMES:
        raise StorageConfigError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise StorageConfigError(
            f"S3 URL {url!r}: {bucket!r} is not a valid bucket name (3-63 characters: lowercase letters, digits, '.', "
            "'-')"
        )
    prefix = prefix.strip("/")
    if prefix:
        validate_object_key(prefix)
    return bucket, prefix


# -- obstore, loaded lazily ------------------------------------------------------------------

_runtime_pid: Optional[int] = None  # the process whose obstore runtime made requests
_pid_lock = threading.Lock()


def import_obstore() -> Any:
    """The ``obstore`` module, or a [`MissingDependencyError`][dist_ckpt.errors.MissingDependencyError] naming the
    extra."""
    try:
        import obstore
    except ImportError as e:
        raise MissingDependencyError(
            'S3 storage (s3:// URLs) needs the obstore client library: pip install "dist_ckpt[s3]"'
        ) from e
    return obstore


def check_process() -> None:
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
                "no AWS credentials found: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or configure a profile "
                "(AWS_PROFILE)",
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


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _has_credential_source() -> bool:
    """Whether the environment names credentials other than the instance metadata service."""
    return bool(
        os.environ.get("AWS_ACCESS_KEY_ID")
        or os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        or os.environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or os.environ.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        or _env_true("AWS_SKIP_SIGNATURE")
    )


def _has_aws_profile() -> bool:
    if (
        os.environ.get("AWS_PROFILE")
        or os.environ.get("AWS_SHARED_CREDENTIALS_FILE")
        or os.environ.get("AWS_CONFIG_FILE")
    ):
        return True
    home = os.path.expanduser("~/.aws")
    return os.path.isfile(os.path.join(home, "credentials")) or os.path.isfile(os.path.join(home, "config"))


@dataclass
class S3Client:
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
    def create(cls, bucket: str, options: S3StorageOptions) -> "S3Client":
        """A client for ``bucket``: credentials, endpoint and region from ``options`` or the AWS environment."""
        obstore = import_obstore()
        from obstore.store import S3Store

        if _runtime_pid is not None and _runtime_pid != os.getpid():
            check_process()  # raises: creating a store in a forked child would hang later
        secrets = _environment_secrets()
        endpoint = options.endpoint_url or _first_env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
        provider, region = _credentials(
            bucket, options.region or _first_env("AWS_REGION", "AWS_DEFAULT_REGION"), secrets
        )
        config: Dict[str, Any] = {"region": region or "us-east-1"}
        if endpoint:
            config["endpoint"] = endpoint
        store_kwargs: Dict[str, Any] = dict(
            config=config,
            client_options=_client_options(options, endpoint),
            retry_config=_retry_config(options),
            credential_provider=provider,
        )
        try:
            store = S3Store(bucket, **store_kwargs)
        except obstore.exceptions.BaseError as e:
            raise StorageConfigError(
                _redact(f"cannot configure the S3 client for bucket {bucket!r}: {e}", secrets)
            ) from e
        return cls(
            bucket,
            options,
            endpoint or f"AWS S3 ({config['region']})",
            store,
            secrets,
            store_kwargs,
            config["region"],
            endpoint,
        )


def _environment_secrets() -> Set[str]:
    """The AWS secrets set in the environment, so that error messages can redact them."""
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_TOKEN")
    return {v for v in (os.environ.get(n) for n in names) if v}


def _credentials(
    bucket: str, region: Optional[str], secrets: Set[str]
) -> Tuple[Optional[_Boto3Credentials], Optional[str]]:
    """The credential provider (a boto3 profile when one is configured and no keys are set) and the region.

    Returns ``(None, region)`` when obstore finds the credentials itself (keys, web identity,
    container credentials, the instance metadata service). Raises StorageAuthError when no source
    is left because ``AWS_EC2_METADATA_DISABLED`` rules out the metadata service.
    """
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
    if provider is None and not _has_credential_source() and _env_true("AWS_EC2_METADATA_DISABLED"):
        # obstore would fall back to the instance metadata service; botocore's switch says no
        raise StorageAuthError(
            f"no AWS credentials for s3://{bucket}: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and "
            "AWS_SESSION_TOKEN), a profile (AWS_PROFILE), or web-identity / container credentials "
            "(AWS_EC2_METADATA_DISABLED rules out the instance metadata service)",
            url=f"s3://{bucket}",
            operation="credentials",
        )
    return provider, region


def _client_options(options: S3StorageOptions, endpoint: Optional[str]) -> Dict[str, Any]:
    """obstore's client options: plain HTTP only when asked for or the endpoint is ``http://``, timeouts."""
    allow_http = (
        options.allow_http
        if options.allow_http is not None
        else bool(endpoint and endpoint.lower().startswith("http://"))
    )
    client_options: Dict[str, Any] = {
        "allow_http": allow_http,
        "connect_timeout": timedelta(seconds=options.connect_timeout_s),
        "timeout": timedelta(seconds=options.request_timeout_s),
    }
    if options.user_agent:
        client_options["user_agent"] = options.user_agent
    return client_options


def _retry_config(options: S3StorageOptions) -> Dict[str, Any]:
    """obstore's retry policy from the options: attempts, total time, exponential backoff."""
    return {
        "max_retries": options.max_retries,
        "retry_timeout": timedelta(seconds=options.retry_timeout_s),
        "backoff": {
            "init_backoff": timedelta(seconds=options.initial_backoff_s),
            "max_backoff": timedelta(seconds=options.max_backoff_s),
            "base": options.backoff_base,
        },
    }


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


def translate_error(
    error: BaseException, *, operation: str, url: str, bucket: str, client: S3Client
) -> "StorageError | TruncatedObjectError":
    """A clear, redacted error for a failed request: what, where, which status, how to fix."""
    obstore = import_obstore()
    text = _redact(str(error), client.secrets)
    status_match = _STATUS_RE.search(text)
    status = int(status_match.group(1)) if status_match else None
    code_match = _CODE_RE.search(text)
    code = code_match.group(1) if code_match else ""
    message_match = _MESSAGE_RE.search(text)
    s3_message = message_match.group(1) if message_match else ""
    detail = " ".join(
        p for p in (f"HTTP {status}" if status else "", code, f"({s3_message})" if s3_message else "") if p
    )
    where = f"{operation} {url} (endpoint {client.endpoint})"
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
            f"{where}: bucket {bucket!r} does not exist [{detail}]; create it, or fix the URL / AWS_ENDPOINT_URL",
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
        attempts = int(retries_match.group(1)) + 1 if retries_match else client.options.max_retries + 1
        last = detail if status is not None else f"no response ({_first_line(text)})"
        return RetriesExhaustedError(
            f"{where} failed after {attempts} attempt(s) (max_retries={client.options.max_retries}); last: {last}. "
            "The server kept failing with transient errors: retry later, or raise S3StorageOptions.max_retries",
            url=url,
            operation=operation,
            attempts=attempts,
            last_status=status,
        )
    return StorageError(f"{where} failed: {detail or _first_line(text)}", url=url, operation=operation)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]
