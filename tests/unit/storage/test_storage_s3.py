"""S3Storage against a real S3 API server (moto on 127.0.0.1): what the conformance suite cannot see.

Retries under injected 5xx, the retry bound, multipart uploads and exact ranged downloads as
counted *at the server*, concurrency, wrong credentials, missing buckets, configuration from
the environment and from a profile, and the fork guard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, List

import numpy as np
import pytest

import dist_ckpt
from dist_ckpt.errors import MissingDependencyError
from dist_ckpt.storage import (
    BucketNotFoundError,
    LocalStorage,
    ObjectNotFoundError,
    RangeRead,
    RetriesExhaustedError,
    StorageAuthError,
    StorageConfigError,
    StorageError,
    open_storage,
)
from dist_ckpt.storage.s3 import S3Storage, S3StorageOptions, parse_s3_url
from dist_ckpt.tools.launch import free_port
from tests.deadlines import scaled
from tests.s3_server import FaultRule, RecordedRequest

MiB = 2**20
FAST = dict(initial_backoff_s=0.01, max_backoff_s=0.05)
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dist_ckpt.__file__)))


def _child_env() -> dict:
    """The current environment (with the test's AWS variables) for a child importing this dist_ckpt."""
    return {**os.environ, "PYTHONPATH": _SOURCE_ROOT}


def _storage(url: str, **overrides: Any) -> S3Storage:
    options = dict(part_size=5 * MiB, max_concurrency=4, read_chunk_size=MiB, max_retries=3, **FAST)
    options.update(overrides)
    storage = open_storage(url, S3StorageOptions(**options))
    assert isinstance(storage, S3Storage)
    return storage


def _gets(requests: List[RecordedRequest]) -> List[RecordedRequest]:
    return [r for r in requests if r.method == "GET" and "list-type" not in r.query]


def _chain_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


# -- retries ---------------------------------------------------------------------------------


def test_transient_errors_are_retried(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url)
    data = os.urandom(300_000)
    s3_env.inject_faults([FaultRule(status=500, count=1, method="PUT"), FaultRule(status=503, count=2, method="GET")])
    storage.write("obj.bin", data)
    out = bytearray(1000)
    storage.read_into("obj.bin", 4000, out)
    assert bytes(out) == data[4000:5000]
    requests = s3_env.requests()
    puts = [r.status for r in requests if r.method == "PUT"]
    gets = [r.status for r in _gets(requests)]
    assert puts == [500, 200]
    assert gets == [503, 503, 206]


def test_multipart_upload_retries_a_failed_part_only(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url)
    data = os.urandom(11 * MiB)
    s3_env.inject_faults([FaultRule(status=503, count=1, method="PUT", query_contains="partNumber=2")])
    storage.write("big.bin", data)
    requests = s3_env.requests()
    parts = [r for r in requests if r.method == "PUT" and "partNumber" in r.query]
    assert sorted(r.query.split("&")[0] for r in parts if r.status == 200) == [
        "partNumber=1",
        "partNumber=2",
        "partNumber=3",
    ]
    assert [r.status for r in parts if "partNumber=2" in r.query] == [503, 200]
    assert sum(r.bytes_received for r in parts if r.status == 200) == len(data)
    assert any(r.method == "POST" and "uploads" in r.query for r in requests)  # initiate
    assert any(r.method == "POST" and "uploadId" in r.query for r in requests)  # complete
    assert storage.read("big.bin") == data


def test_retries_are_bounded_with_a_clear_error(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url, max_retries=2)
    storage.write("obj.bin", b"0123456789")
    s3_env.clear_requests()
    s3_env.inject_faults([FaultRule(status=503, count=1000, method="GET")])
    with pytest.raises(RetriesExhaustedError) as info:
        storage.read_into("obj.bin", 0, bytearray(4))
    error = info.value
    assert error.attempts == 3
    assert error.last_status == 503
    assert error.operation == "GET"
    assert "obj.bin" in str(error) and "3 attempt" in str(error) and "503" in str(error) and "SlowDown" in str(error)
    assert len(_gets(s3_env.requests())) == 3  # exactly max_retries + 1 requests reached the server


def test_conditional_put_is_retried_after_a_5xx(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url)
    s3_env.inject_faults([FaultRule(status=503, count=1, method="PUT")])
    storage.put_if_absent("metadata.json", b"{}")
    assert [r.status for r in s3_env.requests() if r.method == "PUT"] == [503, 200]
    assert storage.read("metadata.json") == b"{}"


def test_no_server_is_retries_exhausted_without_status(s3_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    storage = _storage(f"s3://{s3_env.bucket}/x", max_retries=1, connect_timeout_s=2.0)
    with pytest.raises(RetriesExhaustedError) as info:
        storage.read("anything")
    assert info.value.last_status is None
    assert info.value.attempts == 2
    assert "no response" in str(info.value)


# -- bytes and requests counted at the server -------------------------------------------------


def test_ranged_reads_download_exactly_the_requested_bytes(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url)
    data = np.random.default_rng(0).integers(0, 256, 4 * MiB, dtype=np.uint8).tobytes()
    storage.write("shard.bin", data)
    s3_env.clear_requests()
    storage.reset_stats()
    ranges = [(100, 1000), (2 * MiB, 5000), (3 * MiB + 1, MiB // 2)]  # not adjacent: one GET each
    bufs = [bytearray(n) for _, n in ranges]
    storage.read_ranges([RangeRead.into("shard.bin", off, b) for (off, _), b in zip(ranges, bufs)])
    for (off, n), buf in zip(ranges, bufs):
        assert bytes(buf) == data[off : off + n]
    gets = _gets(s3_env.requests())
    assert sorted(r.range for r in gets) == sorted(f"bytes={off}-{off + n - 1}" for off, n in ranges)
    assert sum(r.bytes_sent for r in gets) == sum(n for _, n in ranges)  # at the server
    assert storage.stats.bytes_read == sum(n for _, n in ranges)  # at the client
    assert storage.stats.read_requests == len(ranges)


def test_adjacent_ranges_are_one_request_and_large_ranges_several(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url, read_chunk_size=MiB)
    data = os.urandom(4 * MiB)
    storage.write("shard.bin", data)
    s3_env.clear_requests()
    a, b = bytearray(1000), bytearray(2000)
    storage.read_ranges([RangeRead.into("shard.bin", 1000, b), RangeRead.into("shard.bin", 0, a)])
    assert bytes(a + b) == data[:3000]
    assert [r.range for r in _gets(s3_env.requests())] == ["bytes=0-2999"]
    s3_env.clear_requests()
    big = bytearray(3 * MiB + 10)
    storage.read_into("shard.bin", 5, big)
    assert bytes(big) == data[5 : 5 + len(big)]
    gets = _gets(s3_env.requests())
    assert len(gets) == 4 and sum(r.bytes_sent for r in gets) == len(big)


def test_coalesce_gap_trades_a_few_bytes_for_a_request(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url, coalesce_gap=5)
    data = os.urandom(100)
    storage.write("g.bin", data)
    s3_env.clear_requests()
    storage.reset_stats()
    a, b = bytearray(10), bytearray(10)
    storage.read_ranges([RangeRead.into("g.bin", 0, a), RangeRead.into("g.bin", 15, b)])
    assert bytes(a) == data[:10] and bytes(b) == data[15:25]
    assert [(r.range, r.bytes_sent) for r in _gets(s3_env.requests())] == [("bytes=0-24", 25)]
    assert storage.stats.bytes_read == 25  # counts what was downloaded, gap included


def test_ranged_gets_run_concurrently_within_the_bound(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url, max_concurrency=3)
    data = os.urandom(64 * 1024)
    storage.write("c.bin", data)
    s3_env.clear_requests()
    s3_env.inject_faults([FaultRule(status=None, delay_s=0.3, count=8, method="GET")])
    bufs = [bytearray(100) for _ in range(8)]
    storage.read_ranges([RangeRead.into("c.bin", i * 4096, b) for i, b in enumerate(bufs)])
    assert all(bytes(b) == data[i * 4096 : i * 4096 + 100] for i, b in enumerate(bufs))
    assert s3_env.max_in_flight() == 3  # concurrent, and never more than max_concurrency


def test_user_agent_identifies_the_client_at_the_server(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url, user_agent="dist_ckpt-rank3")
    storage.write("u", b"1")
    assert {r.user_agent for r in s3_env.requests()} == {"dist_ckpt-rank3"}


# -- credentials and missing things ----------------------------------------------------------


def test_wrong_credentials_are_clear_and_never_leak(s3_url: str, s3_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _storage(s3_url).write("obj", b"x")
    s3_env.set_authentication(True)
    try:
        _storage(s3_url).write("still-ok", b"y")  # the server's user is accepted: auth works
        wrong_secret = "wrongSECRET0123456789abcdefghijklmnopqrstuv"
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)
        storage = _storage(s3_url)
        with pytest.raises(StorageAuthError) as info:
            storage.read("obj")
        assert isinstance(info.value, PermissionError)
        text = str(info.value)
        assert "SignatureDoesNotMatch" in text and "AWS_SECRET_ACCESS_KEY" in text and storage.url_of("obj") in text
        assert wrong_secret not in _chain_text(info.value)
        with pytest.raises(StorageAuthError, match="SignatureDoesNotMatch") as info:
            storage.write("new", b"z")
        assert wrong_secret not in _chain_text(info.value)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        with pytest.raises(StorageAuthError, match="InvalidAccessKeyId") as info:
            _storage(s3_url).read("obj")
        assert wrong_secret not in _chain_text(info.value)
    finally:
        s3_env.set_authentication(False)


def test_no_credentials_fail_before_any_request(s3_url: str, s3_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")  # no profile either
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("HOME", "/nonexistent")
    monkeypatch.setattr("dist_ckpt.storage.s3_client._has_aws_profile", lambda: False)
    with pytest.raises(StorageAuthError, match="no AWS credentials"):
        _storage(s3_url)
    assert s3_env.requests() == []  # neither the server nor a metadata service was asked


def test_missing_bucket_is_named(s3_env: Any) -> None:
    storage = _storage("s3://no-such-bucket-dist-ckpt/prefix")
    for call in (
        lambda: storage.write("a", b"1"),
        lambda: storage.read("a"),
        lambda: storage.list(),
        lambda: storage.exists("a"),
        lambda: storage.read_into("a", 0, bytearray(1)),
    ):
        with pytest.raises(BucketNotFoundError, match="no-such-bucket-dist-ckpt") as info:
            call()
        assert isinstance(info.value, FileNotFoundError)


def test_missing_object_names_bucket_and_key(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url)
    storage.write("present", b"1")  # the bucket exists
    with pytest.raises(ObjectNotFoundError) as info:
        storage.read("ckpt/absent.bin")
    assert f"{s3_url}/ckpt/absent.bin" in str(info.value)
    assert not storage.exists("ckpt/absent.bin")


def test_endpoint_for_s3_takes_precedence(s3_url: str, s3_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_env.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # would fail
    storage = _storage(s3_url, max_retries=0)
    storage.write("k", b"v")
    assert storage.read("k") == b"v"


def test_credentials_from_a_profile_file(
    s3_url: str, s3_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[ckpt]\naws_access_key_id = {s3_env.access_key_id}\naws_secret_access_key = {s3_env.secret_access_key}\n"
    )
    config = tmp_path / "config"
    config.write_text("[profile ckpt]\nregion = us-east-1\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    s3_env.set_authentication(True)  # only the profile's keys are accepted
    try:
        storage = _storage(s3_url)
        storage.write("from-profile", b"ok")
        assert storage.read("from-profile") == b"ok"
    finally:
        s3_env.set_authentication(False)


# -- configuration, import, processes ---------------------------------------------------------


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://my-bucket/runs/exp1/") == ("my-bucket", "runs/exp1")
    assert parse_s3_url("s3://my.bucket") == ("my.bucket", "")
    for bad in ("s3://", "s3://Upper/x", "s3://ab/x", "s3://bucket/../x", "gs://bucket/x", "s3://bucket/a//b"):
        with pytest.raises((StorageConfigError, ValueError)):
            parse_s3_url(bad)


def test_open_storage_resolves_locations(tmp_path: Any) -> None:
    assert isinstance(open_storage(tmp_path), LocalStorage)
    local = open_storage(f"file://{tmp_path}/x")
    assert isinstance(local, LocalStorage) and local.url == str(tmp_path / "x")
    with pytest.raises(StorageConfigError, match="unsupported URL scheme 'gs'"):
        open_storage("gs://bucket/x")
    with pytest.raises(StorageConfigError, match="S3StorageOptions"):
        open_storage("s3://bucket/x", options=object())  # type: ignore[arg-type]


def test_options_are_validated() -> None:
    with pytest.raises(StorageConfigError, match="part_size"):
        S3StorageOptions(part_size=MiB)
    with pytest.raises(StorageConfigError, match="max_concurrency"):
        S3StorageOptions(max_concurrency=0)


def test_missing_client_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore -> ImportError
    with pytest.raises(MissingDependencyError, match=r"dist_ckpt\[s3\]"):
        open_storage("s3://bucket/x")


def test_importing_dist_ckpt_does_not_import_the_s3_client(tmp_path: Any) -> None:
    code = (
        "import sys, dist_ckpt, dist_ckpt.storage\n"
        f"dist_ckpt.storage.open_storage({str(tmp_path)!r}).write('a', b'1')\n"
        "assert 'obstore' not in sys.modules and 'dist_ckpt.storage.s3' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_child_env())


def test_a_forked_child_fails_fast_instead_of_hanging(s3_url: str, s3_env: Any) -> None:
    storage = _storage(s3_url)
    storage.write("f", b"1")  # the S3 client's runtime is now running in this process
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what the next call does, then leave at once
        signal.alarm(20)  # a hang would end the child with SIGALRM
        try:
            storage.read("f")
            outcome = b"no error"
        except StorageError as e:
            outcome = b"StorageError: " + str(e).encode()
        except BaseException as e:  # noqa: BLE001
            outcome = type(e).__name__.encode()
        os.write(write_end, outcome)
        os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    outcome = os.read(read_end, 4096)
    os.close(read_end)
    assert status == 0, f"child ended with status {status} (a hang ends with SIGALRM)"
    assert outcome.startswith(b"StorageError: ") and b"spawn" in outcome, outcome
    assert storage.read("f") == b"1"  # the parent is unaffected


_UPLOADER = """
import sys
from dist_ckpt.storage import open_storage
from dist_ckpt.storage.s3 import S3StorageOptions
storage = open_storage(sys.argv[1], S3StorageOptions(part_size=5 * 2**20, max_concurrency=1))
with storage.open_writer("rank0.bin") as w:
    for _ in range(8):
        w.write(b"x" * (5 * 2**20))
"""


def test_an_upload_killed_midway_leaves_nothing_visible(s3_url: str, s3_env: Any) -> None:
    # part 2 is held at the server long enough to kill the uploader while its upload is open
    s3_env.inject_faults([FaultRule(status=None, delay_s=5.0, count=1, method="PUT", query_contains="partNumber=2")])
    proc = subprocess.Popen([sys.executable, "-c", _UPLOADER, s3_url], env=_child_env())
    try:
        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline and proc.poll() is None:
            parts = [
                r
                for r in s3_env.requests()
                if r.method == "PUT" and "partNumber=1&" in r.query + "&" and r.status == 200
            ]
            if parts:
                break
            time.sleep(0.05)
        assert proc.poll() is None and parts, "the uploader should be mid-upload (part 1 stored, part 2 held)"
        proc.kill()
        proc.wait(timeout=scaled(10))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    storage = _storage(s3_url)
    assert storage.list() == [] and not storage.exists("rank0.bin")  # an open multipart upload is invisible
