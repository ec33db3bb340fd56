"""Shared pytest configuration for dist_ckpt tests."""

import logging

logging.getLogger("dist_ckpt").setLevel(logging.INFO)


# -- a real S3 API server (moto) for the storage tests; see tests.s3_server ---------

import os  # noqa: E402
import uuid  # noqa: E402
from typing import Any, Iterator, List  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """One moto S3 server on 127.0.0.1 for the whole session, stopped at the end.

    Skipped when moto or obstore is missing, except under CI (``CI`` set), where the ``test``
    extra installs both and a skip would hide a broken install.
    """
    for module in ("moto", "obstore", "boto3"):
        try:
            __import__(module)
        except ImportError:
            if os.environ.get("CI"):
                raise
            pytest.skip(f"{module} is not installed (pip install 'dist_ckpt[test]')")
    from tests.s3_server import S3TestServer

    with S3TestServer() as server:
        yield server


@pytest.fixture
def s3_env(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Point the AWS environment variables at the test server; no faults, no recorded requests."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    s3_server.clear_faults()
    s3_server.clear_requests()
    yield s3_server
    s3_server.clear_faults()


@pytest.fixture
def s3_url(s3_env: Any, request: pytest.FixtureRequest) -> str:
    """A fresh ``s3://bucket/prefix`` for this test on the test server."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"s3://{s3_env.bucket}/tests/{name}-{uuid.uuid4().hex[:8]}"


# -- counting the full sharding checks of saves (unit and multi-rank validation tests) -------

from dist_ckpt.engine.checks import sharding  # noqa: E402


@pytest.fixture
def gathers(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Counts the full sharding checks (gathers of every rank's table) on this rank."""
    count = [0]
    original = sharding.gather_bytes

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(sharding, "gather_bytes", counting)
    return count


# -- zarr checkpoints without the root group's index of every zarr.json ------------------------


@pytest.fixture
def unindexed_zarr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Zarr saves in this test write the root group without its index (as a checkpoint saved
    before the index, or one too large for it): loads read every tensor's own ``zarr.json``."""
    from dist_ckpt.backends.zarr import metadata_index

    monkeypatch.setattr(metadata_index, "MAX_INDEX_BYTES", 0)
