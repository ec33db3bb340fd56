"""Saves to S3 (the moto test server on 127.0.0.1) under injected faults.

* every request of a save, in turn, answered with 503 until the client's retries run out;
* timeouts (the server holds a response longer than the client's request timeout);
* slow responses (within the timeout: the save must succeed);
* the server killed in the middle of a save.

Each failed save must raise a typed error (a StorageError, or a SaveConflict/Corrupt error of
the family) whose message names the ``s3://`` URL, commit nothing (no ``metadata.json``), and
leave the prefix usable by the next save. No object and no log line may contain the access key
or the secret key.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, List

import pytest

import dist_ckpt as dc
from dist_ckpt.storage import StorageError, open_storage
from dist_ckpt.storage.s3 import S3StorageOptions
from tests.deadlines import scaled
from tests.s3_server import FaultRule, S3TestServer

from . import tally
from .scenario import SilentWrong, check_loads, state, strategy

FAST = dict(initial_backoff_s=0.01, max_backoff_s=0.05, max_retries=1, part_size=5 * 2**20)


def _storage(url: str, **options: Any) -> Any:
    return open_storage(url, S3StorageOptions(**{**FAST, **options}))


#: loggers of the test's own tools (boto3 inspects the bucket; its DEBUG lines show signatures)
_TOOLS = ("botocore", "boto3", "urllib3", "s3transfer", "moto")


def _no_secrets(server: Any, caplog: pytest.LogCaptureFixture, extra: str = "") -> None:
    secrets = [server.access_key_id, server.secret_access_key]
    text = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(_TOOLS)) + extra
    for secret in secrets:
        assert secret not in text, "a credential appears in a log line or an error"
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket):
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket=server.bucket, Key=obj["Key"])["Body"].read()
            for secret in secrets:
                assert secret.encode() not in body, f"a credential is stored in {obj['Key']}"


def _check_failed(error: BaseException, url: str, prefix: str) -> None:
    if not isinstance(error, dc.CheckpointingException):
        raise error
    if "s3://" not in str(error):
        raise AssertionError(f"the error does not name the URL: {error}")
    storage = _storage(url)
    if storage.exists(f"{prefix}/metadata.json"):
        raise SilentWrong(f"{prefix} was committed by a failed save")


@pytest.mark.parametrize("backend", ["safetensors", "zarr"])
def test_503_at_every_request_of_a_save(s3_env, s3_url, caplog, backend):
    caplog.set_level(logging.DEBUG)
    root = _storage(s3_url)
    s3_env.clear_requests()
    dc.save(state(2.0), root.child("count"), sharded_strategy=strategy(backend))
    requests = len(s3_env.requests())
    assert requests > 8
    row = f"S3: 503 until retries run out, at each request, {backend}"
    errors: List[str] = []
    for k in range(0, requests, 1 if backend == "safetensors" else 3):  # zarr: every third
        prefix = f"k{k}"

        def attempt(k: int = k, prefix: str = prefix) -> None:
            s3_env.clear_faults()
            s3_env.inject_faults([FaultRule(status=503, count=FAST["max_retries"] + 1, skip=k)])
            try:
                dc.save(state(2.0), root.child(prefix), sharded_strategy=strategy(backend))
            except Exception as e:  # noqa: BLE001 -- classified here
                s3_env.clear_faults()
                errors.append(str(e))
                _check_failed(e, s3_url, prefix)
            else:  # the fault hit no request, or one whose failure the save tolerates: must be right
                s3_env.clear_faults()
                check_loads(root.child(prefix), 2.0)
            if not root.exists(f"{prefix}/metadata.json"):  # the prefix is usable again
                dc.save(state(3.0), root.child(prefix), sharded_strategy=strategy(backend))
                check_loads(root.child(prefix), 3.0)

        tally.attempt(row, f"request {k}", attempt)
    s3_env.clear_faults()
    _no_secrets(s3_env, caplog, "\n".join(errors))
    tally.assert_clean(row)


def test_timeouts_and_slow_responses(s3_env, s3_url, caplog):
    caplog.set_level(logging.DEBUG)
    row = "S3: timeouts and slow responses"
    root = _storage(s3_url)
    impatient = _storage(s3_url, request_timeout_s=1.0)  # only for the save that must time out

    def timeout() -> None:
        s3_env.inject_faults([FaultRule(status=None, delay_s=3.0, count=2, method="PUT", skip=2)])
        try:
            dc.save(state(2.0), impatient.child("t"))
        except Exception as e:  # noqa: BLE001 -- classified here
            _check_failed(e, s3_url, "t")
        else:
            raise AssertionError("a request that timed out twice did not fail the save")
        s3_env.clear_faults()
        dc.save(state(3.0), root.child("t"))
        check_loads(root.child("t"), 3.0)

    def slow() -> None:
        s3_env.inject_faults([FaultRule(status=None, delay_s=0.3, count=6)])
        dc.save(state(2.0), root.child("s"))
        s3_env.clear_faults()
        check_loads(root.child("s"), 2.0)

    for name, run in (("timeout", timeout), ("slow", slow)):
        tally.attempt(row, name, run)
        s3_env.clear_faults()
    _no_secrets(s3_env, caplog)
    tally.assert_clean(row)


def test_the_server_killed_in_the_middle_of_a_save(monkeypatch, caplog):
    """A server of its own (killing the session's would end the other tests)."""
    caplog.set_level(logging.DEBUG)
    row = "S3: server killed mid-save"
    server = S3TestServer().start()
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        url = f"s3://{server.bucket}/killed-{uuid.uuid4().hex[:8]}"
        server.inject_faults([FaultRule(status=None, delay_s=0.5, count=1000)])  # slow enough to kill mid-way
        outcome: dict = {}

        def save() -> None:
            try:
                dc.save(state(2.0), _storage(url, connect_timeout_s=1.0, request_timeout_s=5.0))
                outcome["error"] = None
            except Exception as e:  # noqa: BLE001 -- classified below
                outcome["error"] = e

        def attempt() -> None:
            thread = threading.Thread(target=save)
            thread.start()
            deadline = time.monotonic() + scaled(60)
            while len(server.requests()) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server._proc is not None
            server._proc.kill()  # no goodbye: connections reset, then refused
            thread.join(scaled(120))
            if thread.is_alive():
                raise tally.Hang("the save did not end after the server died")
            error = outcome["error"]
            if error is None:
                raise SilentWrong("the save reported success although the server died")
            if not isinstance(error, StorageError) or "s3://" not in str(error):
                raise AssertionError(f"not a typed error naming the URL: {error!r}")
            logged = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(_TOOLS))
            for secret in (server.access_key_id, server.secret_access_key):
                assert secret not in str(error) and secret not in logged

        tally.attempt(row, "killed after a few requests", attempt, seconds=180)
    finally:
        server.stop()
    tally.assert_clean(row)
