"""A real S3 API server on 127.0.0.1 for tests and benchmarks: moto, behind a recorder.

:class:`S3TestServer` starts moto's standalone server (the same WSGI application that
``python -m moto.server`` runs) in a *separate process* on a free port of 127.0.0.1, wrapped in
a small WSGI middleware that

* records every request: method, path, ``Range`` header, status, bytes received and bytes sent
  (so a test can check that a rank downloaded only its slice, counted at the server), and
* injects faults: the next N requests that match a :class:`FaultRule` get an HTTP error status
  (500, 503 ``SlowDown``, ...) without reaching moto, so retries can be tested, or are delayed
  before moto answers them, so concurrency can be seen, and
* tracks the largest number of requests in flight at once.

Both are driven over HTTP under the reserved path ``/_dist_ckpt/`` (no S3 bucket name can start
with ``_``), so any process -- every rank of a multi-rank test -- can use the server, not only
the one that started it. A separate process also keeps moto's Python work off the GIL of the
client under test.

At start-up an IAM user with an ``s3:*`` policy is created; its access key is what
:meth:`S3TestServer.env` hands out. With :meth:`S3TestServer.set_authentication` on, the server
refuses wrong credentials as AWS does (``InvalidAccessKeyId`` / ``SignatureDoesNotMatch``).

Needs the ``test`` extra (``pip install "dist_ckpt[test]"``: ``moto[server]``, ``boto3``).

Example::

    with S3TestServer() as server:
        os.environ.update(server.env())              # AWS_ENDPOINT_URL, keys, region
        server.inject_faults([FaultRule(status=503, count=2, method="GET")])
        ...                                          # the next two GETs fail with 503
        served = sum(r.bytes_sent for r in server.requests() if r.method == "GET")
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Type

from tests.deadlines import scaled

logger = logging.getLogger(__name__)

__all__ = ["FaultRule", "RecordedRequest", "S3TestServer", "main"]

CONTROL_PREFIX = "/_dist_ckpt/"
DEFAULT_BUCKET = "dist-ckpt-test"
REGION = "us-east-1"

_StartResponse = Callable[..., Any]
_WsgiApp = Callable[[Dict[str, Any], _StartResponse], Iterable[bytes]]

_ERROR_CODES = {500: "InternalError", 502: "BadGateway", 503: "SlowDown", 429: "TooManyRequests"}


@dataclass(frozen=True)
class FaultRule:
    """Fail (or delay) the next ``count`` requests that match, before they reach moto.

    Attributes:
        status: HTTP status of the injected error response (e.g. 500, 503); None lets the
            request through to moto after ``delay_s``.
        delay_s: seconds to wait before answering (error or not).
        count: how many matching requests fail; the rule is spent after that.
        method: only requests with this HTTP method match (None: any method).
        path_contains: only requests whose path (``/bucket/key``) contains this string match.
        query_contains: only requests whose query string contains this string match (e.g.
            ``"partNumber"`` for the parts of multipart uploads).
        skip: let this many matching requests through before failing any.
    """

    status: Optional[int] = 503
    delay_s: float = 0.0
    count: int = 1
    method: Optional[str] = None
    path_contains: str = ""
    query_contains: str = ""
    skip: int = 0

    def __post_init__(self) -> None:
        if self.status is not None and not 400 <= self.status <= 599:
            raise ValueError(f"FaultRule.status must be an HTTP error status (400-599), got {self.status}")
        if self.count < 0 or self.skip < 0 or self.delay_s < 0:
            raise ValueError(
                f"FaultRule.count, .skip and .delay_s must be >= 0, got {self.count}, {self.skip}, {self.delay_s}"
            )


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server answered (or failed on purpose).

    Attributes:
        method: HTTP method.
        path: URL path, ``/bucket/key`` (percent-encoded as sent).
        query: raw query string.
        range: the ``Range`` request header, or "" when absent.
        status: HTTP status of the response.
        bytes_received: request body bytes (``Content-Length``).
        bytes_sent: response body bytes actually sent.
        injected: True when the response was an injected fault.
        user_agent: the client's ``User-Agent`` header (lets a test tell clients apart).
    """

    method: str
    path: str
    query: str
    range: str
    status: int
    bytes_received: int
    bytes_sent: int
    injected: bool
    user_agent: str


class _Rule:
    """A FaultRule with its remaining skip / fail counts (server side, guarded by a lock)."""

    def __init__(self, rule: FaultRule) -> None:
        self.rule = rule
        self.to_skip = rule.skip
        self.to_fail = rule.count

    def matches(self, method: str, path: str, query: str) -> bool:
        r = self.rule
        return (
            (r.method is None or r.method.upper() == method) and r.path_contains in path and r.query_contains in query
        )


class RecordingMiddleware:
    """WSGI middleware in front of moto: records requests, injects faults, serves control calls.

    Control API (JSON over HTTP, under ``/_dist_ckpt/``):

    * ``GET /_dist_ckpt/requests`` -- the recorded requests, oldest first;
      ``DELETE`` clears them and the in-flight maximum.
    * ``GET /_dist_ckpt/stats`` -- ``{"max_in_flight": N}``: most S3 requests served at once.
    * ``PUT /_dist_ckpt/faults`` -- replace the fault rules with the JSON list of
      :class:`FaultRule` fields in the body; ``DELETE`` removes every rule.
    """

    def __init__(self, app: _WsgiApp) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._records: List[RecordedRequest] = []
        self._rules: List[_Rule] = []
        self._in_flight = 0
        self._max_in_flight = 0

    def __call__(self, environ: Dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        path = str(environ.get("PATH_INFO", ""))
        if path.startswith(CONTROL_PREFIX):
            return self._control(path[len(CONTROL_PREFIX) :], environ, start_response)
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        query = str(environ.get("QUERY_STRING", ""))
        received = _content_length(environ)
        base = dict(
            method=method,
            path=path,
            query=query,
            range=str(environ.get("HTTP_RANGE", "")),
            bytes_received=received,
            user_agent=str(environ.get("HTTP_USER_AGENT", "")),
        )
        rule = self._take_rule(method, path, query)
        status = rule.status if rule is not None else None
        self._enter()
        try:
            if rule is not None and rule.delay_s:
                time.sleep(rule.delay_s)
        except BaseException:
            self._leave()
            raise
        if status is not None:
            self._leave()
            _drain(environ, received)  # keep the connection usable for the client's next request
            body = _error_body(status, path)
            start_response(
                f"{status} Injected", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
            )
            self._record(RecordedRequest(status=status, bytes_sent=len(body), injected=True, **base))  # type: ignore[arg-type]
            return [body]
        seen: Dict[str, int] = {"status": 0}

        def recording_start_response(status_line: str, headers: Any, exc_info: Any = None) -> Any:
            seen["status"] = int(status_line.split()[0])
            return start_response(status_line, headers, exc_info) if exc_info else start_response(status_line, headers)

        try:
            result = self._app(environ, recording_start_response)
        except BaseException:
            self._leave()
            raise
        return self._counted(result, seen, base)

    def _counted(self, result: Iterable[bytes], seen: Dict[str, int], base: Dict[str, Any]) -> List[bytes]:
        """moto's whole response, recorded before the first byte goes out.

        moto builds responses in memory anyway; recording before sending means that a client
        that got its response and then asks for the records always finds its request there.
        """
        try:
            chunks = [bytes(c) for c in result]
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
            self._leave()
        self._record(
            RecordedRequest(status=seen["status"], bytes_sent=sum(len(c) for c in chunks), injected=False, **base)
        )
        return chunks

    def _take_rule(self, method: str, path: str, query: str) -> Optional[FaultRule]:
        """The first live rule matching the request (spending one of its uses), or None."""
        with self._lock:
            for rule in self._rules:
                if rule.to_fail <= 0 or not rule.matches(method, path, query):
                    continue
                if rule.to_skip > 0:
                    rule.to_skip -= 1
                    return None
                rule.to_fail -= 1
                return rule.rule
        return None

    def _enter(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _record(self, record: RecordedRequest) -> None:
        with self._lock:
            self._records.append(record)

    def _control(self, what: str, environ: Dict[str, Any], start_response: _StartResponse) -> List[bytes]:
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        payload: Any = {"status": "ok"}
        code = "200 OK"
        with self._lock:
            if what == "requests" and method == "GET":
                payload = [asdict(r) for r in self._records]
            elif what == "requests" and method == "DELETE":
                self._records.clear()
                self._max_in_flight = self._in_flight
            elif what == "stats" and method == "GET":
                payload = {"max_in_flight": self._max_in_flight}
            elif what == "faults" and method == "PUT":
                body = environ["wsgi.input"].read(_content_length(environ))
                self._rules = [_Rule(FaultRule(**fields)) for fields in json.loads(body or b"[]")]
            elif what == "faults" and method == "DELETE":
                self._rules = []
            else:
                code, payload = "404 Not Found", {"error": f"unknown control call {method} {CONTROL_PREFIX}{what}"}
        data = json.dumps(payload).encode()
        start_response(code, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]


def _content_length(environ: Dict[str, Any]) -> int:
    try:
        return int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0


def _drain(environ: Dict[str, Any], length: int) -> None:
    stream = environ.get("wsgi.input")
    remaining = length
    while stream is not None and remaining > 0:
        chunk = stream.read(min(remaining, 1 << 20))
        if not chunk:
            break
        remaining -= len(chunk)


def _error_body(status: int, path: str) -> bytes:
    code = _ERROR_CODES.get(status, "InjectedError")
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by the dist_ckpt test server</Message>"
        f"<Resource>{path}</Resource><RequestId>injected</RequestId></Error>"
    ).encode()


def build_app() -> RecordingMiddleware:
    """moto's multi-service WSGI application wrapped in a :class:`RecordingMiddleware`."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    return RecordingMiddleware(DomainDispatcherApplication(create_backend_app))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Serve moto + recorder on ``--host``/``--port`` (0: a free port) until killed.

    Writes one JSON line ``{"port": N}`` to stdout once the socket listens, which is how
    :class:`S3TestServer` learns the port.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = make_server(args.host, args.port, build_app(), threaded=True)
    sys.stdout.write(json.dumps({"port": server.port}) + "\n")
    sys.stdout.flush()
    server.serve_forever()


class S3TestServer:
    """Start / stop the recording moto server in a child process; create a bucket and a user.

    Args:
        bucket: bucket created at start-up (more with :meth:`create_bucket`).
        startup_timeout_s: how long to wait for the child to listen (default: 60 s, `scaled`).

    Attributes:
        endpoint: ``http://127.0.0.1:PORT`` once started.
        access_key_id, secret_access_key: credentials of the IAM user the server accepts.
    """

    def __init__(self, bucket: str = DEFAULT_BUCKET, *, startup_timeout_s: Optional[float] = None) -> None:
        self.bucket = bucket
        self.startup_timeout_s = scaled(60.0) if startup_timeout_s is None else startup_timeout_s
        self.endpoint = ""
        self.access_key_id = ""
        self.secret_access_key = ""
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._log: Optional[Any] = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> "S3TestServer":
        """Start the server, create the IAM user and the bucket."""
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ)
        for name in list(env):  # the server must not pick up the client's endpoint or keys
            if name.startswith("AWS_"):
                del env[name]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.s3_server", "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=str(Path(__file__).resolve().parent.parent),  # the repository root: `tests` importable
        )
        try:
            port = self._read_port()
            self.endpoint = f"http://127.0.0.1:{port}"
            self._provision()
        except BaseException:
            self.stop()
            raise
        logger.info("S3 test server (moto) listening on %s, bucket %r", self.endpoint, self.bucket)
        return self

    def _read_port(self) -> int:
        assert self._proc is not None and self._proc.stdout is not None
        result: Dict[str, Any] = {}

        def reader() -> None:
            assert self._proc is not None and self._proc.stdout is not None
            result["line"] = self._proc.stdout.readline()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        thread.join(self.startup_timeout_s)
        line = result.get("line", b"")
        if not line:
            raise RuntimeError(
                f"the moto S3 test server did not start within {self.startup_timeout_s} s: {self._stderr_tail()}"
            )
        return int(json.loads(line)["port"])

    def _stderr_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return str(self._log.read()[-4000:].decode(errors="replace"))

    def _provision(self) -> None:
        """Create an IAM user allowed ``s3:*`` and the bucket."""
        iam = self.client("iam", access_key_id="bootstrap", secret_access_key="bootstrap")
        iam.create_user(UserName="dist-ckpt-test")
        iam.put_user_policy(
            UserName="dist-ckpt-test",
            PolicyName="s3-all",
            PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
            ),
        )
        key = iam.create_access_key(UserName="dist-ckpt-test")["AccessKey"]
        self.access_key_id = str(key["AccessKeyId"])
        self.secret_access_key = str(key["SecretAccessKey"])
        self.create_bucket(self.bucket, access_key_id="bootstrap", secret_access_key="bootstrap")

    def set_authentication(self, enabled: bool) -> None:
        """Make the server check every request's signature and access key (or stop checking).

        Off by default: moto's signature check rejects some valid requests (object_store's
        signed ``ListObjectsV2`` calls fail with ``SignatureDoesNotMatch``), so only the tests
        of wrong credentials turn it on, around single-object requests.
        """
        self._http("POST", "/moto-api/reset-auth", b"0" if enabled else b"inf")

    def stop(self) -> None:
        """Stop the server process (idempotent)."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "S3TestServer":
        return self.start()

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.stop()

    # -- what clients need ------------------------------------------------------------------

    def env(self) -> Dict[str, str]:
        """The AWS environment variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(
        self, service: str = "s3", *, access_key_id: Optional[str] = None, secret_access_key: Optional[str] = None
    ) -> Any:
        """A boto3 client of this server (for test set-up and inspection)."""
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=access_key_id or self.access_key_id,
            aws_secret_access_key=secret_access_key or self.secret_access_key,
        )

    def create_bucket(self, name: str, **credentials: str) -> None:
        """Create bucket ``name`` (credentials default to the server's user)."""
        self.client("s3", **credentials).create_bucket(Bucket=name)

    # -- recorder and faults ----------------------------------------------------------------

    def requests(self) -> List[RecordedRequest]:
        """Every request recorded since the last :meth:`clear_requests`, oldest first."""
        return [RecordedRequest(**r) for r in json.loads(self._http("GET", CONTROL_PREFIX + "requests"))]

    def max_in_flight(self) -> int:
        """The most S3 requests the server was answering at once since :meth:`clear_requests`."""
        return int(json.loads(self._http("GET", CONTROL_PREFIX + "stats"))["max_in_flight"])

    def clear_requests(self) -> None:
        """Forget the recorded requests (and the in-flight maximum)."""
        self._http("DELETE", CONTROL_PREFIX + "requests")

    def inject_faults(self, rules: Sequence[FaultRule]) -> None:
        """Replace the fault rules (each fails or delays its next ``count`` matching requests)."""
        self._http("PUT", CONTROL_PREFIX + "faults", json.dumps([asdict(r) for r in rules]).encode())

    def clear_faults(self) -> None:
        """Remove every fault rule."""
        self._http("DELETE", CONTROL_PREFIX + "faults")

    def _http(self, method: str, path: str, body: Optional[bytes] = None) -> bytes:
        # an explicit content type: urllib's default (a form) would hide the body from moto's API
        headers = {"Content-Type": "application/octet-stream"}
        request = urllib.request.Request(self.endpoint + path, data=body, method=method, headers=headers)
        deadline = time.monotonic() + scaled(10.0)
        while True:
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return bytes(response.read())
            except urllib.error.URLError as e:  # the server may still be binding
                if isinstance(e, urllib.error.HTTPError) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


if __name__ == "__main__":
    main()
