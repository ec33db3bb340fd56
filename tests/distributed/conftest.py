"""Multi-rank test setup: under ``mpiexec -n N pytest --with-mpi``, one gloo process group.

MPI only launches the ranks and hands out rank numbers; every collective in the tests goes
through torch.distributed (gloo), the engine dist_ckpt supports.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from dist_ckpt.testing import free_port, init_process_group
from tests.deadlines import scaled


def _mpi_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture(scope="session", autouse=True)
def process_group(request: pytest.FixtureRequest) -> Iterator[None]:
    """Initialize gloo from the MPI rank/size once per session (only with --with-mpi)."""
    if not request.config.getoption("--with-mpi", default=False):
        yield
        return
    comm = _mpi_world()
    port = comm.bcast(free_port() if comm.rank == 0 else None, root=0)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init_process_group(
        comm.rank, comm.size, port, timeout_s=float(os.environ.get("DIST_CKPT_TEST_TIMEOUT", scaled(90)))
    )
    yield
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture
def shared_tmp_path(process_group: None) -> Iterator[Path]:
    """A fresh directory shared by every rank (created by rank 0, removed after the test)."""
    holder = [tempfile.mkdtemp(prefix="dist_ckpt_test_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    path = Path(holder[0])
    yield path
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
