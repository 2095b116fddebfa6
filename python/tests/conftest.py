"""Shared fixtures of the shmckpt Python tests.

GPU tests carry the ``gpu`` marker: they are skipped without a CUDA GPU, and with
``SHMCKPT_REQUIRE_GPU=1`` a missing GPU fails them instead.
"""

import os
import pathlib
import shutil

import pytest

import shmckpt

REPO = pathlib.Path(__file__).resolve().parents[2]
SMALL = 32 << 20  # staging capacity of most tests (the default 2 GiB is pre-faulted)


def pytest_collection_modifyitems(config, items):
    import torch

    require = os.environ.get("SHMCKPT_REQUIRE_GPU") == "1"
    have = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not have:
            if require:
                # A setup error: the run fails.
                item.add_marker(pytest.mark.usefixtures("_fail_no_gpu"))
            else:
                item.add_marker(pytest.mark.skip(reason="no CUDA GPU (set SHMCKPT_REQUIRE_GPU=1 to fail)"))


@pytest.fixture
def _fail_no_gpu():
    pytest.fail("SHMCKPT_REQUIRE_GPU=1 but torch.cuda.is_available() is False")


@pytest.fixture
def root(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


@pytest.fixture
def ck(root):
    c = shmckpt.Checkpointer(root, staging_capacity=SMALL, chunk_size=1 << 20)
    yield c
    c.close()


def shmckpt_bin():
    """The `shmckpt` command line (SHMCKPT_BIN, else target/{debug,release}/shmckpt)."""
    env = os.environ.get("SHMCKPT_BIN")
    if env:
        return env
    for p in (REPO / "target" / "debug" / "shmckpt", REPO / "target" / "release" / "shmckpt"):
        if p.is_file():
            return str(p)
    return shutil.which("shmckpt")


def listing(root):
    """Every path under root (relative), to compare before/after."""
    root = pathlib.Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))
