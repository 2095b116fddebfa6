"""What the replica tests share (not a test module): the simulated world's size, the kept
arena's name, the ``droot`` fixture that removes a test's arenas and replicas, and the
replicas of a root."""

import os
import pathlib
import shutil
import subprocess

import pytest

import shmckpt
from shmckpt import _shmckpt
from shmckpt.replicas import list_replicas, remove_replica

WORLD = 4


def kept_name(root, rank):
    """The kept arena's name of ``root`` and ``rank`` (FNV-1a 64 of the canonical root)."""
    h = 0xCBF29CE484222325
    for b in os.fsencode(os.path.realpath(root)):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"shmckpt.keep-{h:016x}.r{rank}"


def save_rank_step(root, rank, step):
    """Commit ``step`` of ``rank``'s test state (``replica_worker.rank_state``) in ``root``,
    one process, with a small staging arena."""
    from replica_worker import rank_state

    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20))
    try:
        ck.save(step, rank_state(rank, step)).wait()
    finally:
        ck.close()


@pytest.fixture
def droot(root):
    """The test's root; at the end its kept arenas and replicas are removed (exact names)."""
    yield root
    remove_arenas_of(root)


def remove_arenas_of(root):
    """Remove the kept arenas and replicas of ``root`` from /dev/shm (exact names)."""
    for r in range(WORLD):
        p = pathlib.Path("/dev/shm") / kept_name(root, r)
        if p.is_file() and not p.is_symlink():
            p.unlink()
    tag = remove_replicas_of(root)
    # Replica arenas a killed rank was receiving into (`<replica name>.tmp<pid>`), and the
    # entries kept beside memory-only steps' replicas (removed with them, but for a kill).
    shm = pathlib.Path("/dev/shm")
    for p in [*shm.glob(f"shmckpt-replica.{tag}.*.tmp*"), *shm.glob(f"shmckpt-replica.{tag}.*.entry")]:
        if p.is_file() and not p.is_symlink():
            p.unlink()


def remove_replicas_of(root):
    """Remove the replicas of ``root`` listed in this /dev/shm (``shmckpt.replicas``);
    returns the root's replica tag."""
    tag = _shmckpt.replica_tag(str(root))
    for rep in list_replicas():
        if rep["root_tag"] == tag:
            remove_replica(rep["name"])
    return tag


def namespaces_missing():
    """``None`` when a mount namespace with its own /dev/shm can be made here (root,
    ``unshare --mount`` permitted, ``nsenter`` installed), else why not."""
    if os.geteuid() != 0:
        return "mount namespaces need root"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "`unshare` or `nsenter` is not installed"
    if subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], stderr=subprocess.DEVNULL).returncode != 0:
        return "`unshare --mount` is not permitted"
    return None


def our_replicas(root):
    tag = _shmckpt.replica_tag(str(root))
    return sorted((r["source_rank"], r["step"]) for r in list_replicas() if r["root_tag"] == tag)
