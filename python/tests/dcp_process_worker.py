"""One rank of the tests of ``async_save``'s PROCESS checkpointer with ShmckptWriter
(spawned by test_dcp_process.py; helpers from dcp_worker.py).

Usage: python dcp_process_worker.py SCENARIO RANK WORLD WORKDIR. Each rank writes
WORKDIR/result-SCENARIO-RANK.json with what it checked.
"""

import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh

from shmckpt import Tuning
from shmckpt.dcp import ShmckptReader, ShmckptWriter

from dcp_worker import CHUNK, compare, init, make_state, result, same, zero_state

PROCESS = AsyncCheckpointerType.PROCESS
THREAD = AsyncCheckpointerType.THREAD


def segments(pids):
    """The shmckpt staging arenas in /dev/shm of these processes."""
    return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(f"shmckpt.{p}.") for p in pids))


def checkpoint_process():
    """DCP's checkpoint process of this rank (None before the first PROCESS save)."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    p = ape._CHECKPOINT_PROCESS
    return None if p is None else p._save_process


def sc_saves(rank, world, workdir):
    """PROCESS and THREAD saves alternated and repeated (one into a directory that holds a
    checkpoint), the state changed right after each call; a PROCESS save that fails in the
    checkpoint process raises from its future and the next one publishes its own values;
    every checkpoint loads byte-exact through ShmckptReader."""
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    ck = os.path.join(workdir, "ckpt")
    out = {}
    plan = [("a", PROCESS), ("b", THREAD), ("c", PROCESS), ("a", PROCESS), ("d", THREAD), ("e", PROCESS)]
    refs = {}
    for i, (name, kind) in enumerate(plan):
        src = make_state(mesh, seed_shift=float(i))
        src["step"] = i
        ref = make_state(mesh, seed_shift=float(i))  # (collectives: not while a save uploads)
        ref["step"] = i
        t = time.perf_counter()
        fut = dcp.async_save(
            src,
            storage_writer=ShmckptWriter(os.path.join(ck, name), tuning=Tuning(chunk_size=CHUNK)),
            async_checkpointer_type=kind,
        )
        call_s = time.perf_counter() - t
        # Staged: changing the state now must not change the checkpoint.
        for v in src["model"].values():
            v.to_local().zero_()
        src["plain"]["i32"].fill_(-1)
        src["counter"].hist.fill_(-1)
        fut.result()
        refs[name] = ref
        out[f"call_s_{i}"] = call_s
    dist.barrier()
    for name, ref in refs.items():
        dst = zero_state(mesh)
        dcp.load(dst, storage_reader=ShmckptReader(os.path.join(ck, name)))
        out[name] = compare(ref, dst)

    # A save that fails in the checkpoint process (its target is not empty and holds no
    # checkpoint: the coordinator refuses it there) raises from the future, on every rank.
    bad = os.path.join(workdir, "bad")
    if rank == 0:
        os.makedirs(bad)
        with open(os.path.join(bad, "x"), "wb") as f:
            f.write(b"1")
    dist.barrier()
    w = ShmckptWriter(os.path.join(ck, "unused"), tuning=Tuning(chunk_size=CHUNK))
    first = make_state(mesh, seed_shift=7.0)
    fut = dcp.async_save(first, checkpoint_id=bad, storage_writer=w, async_checkpointer_type=PROCESS)
    try:
        fut.result(timeout=120)
    except BaseException as e:  # CheckpointException is a BaseException
        out["failed"] = type(e).__name__
        out["failed_msg"] = "not empty" in str(e)
    else:
        out["failed"] = None
    assert sorted(os.listdir(bad)) == ["x"]
    ref = make_state(mesh, seed_shift=8.0)
    second = make_state(mesh, seed_shift=8.0)
    dcp.async_save(second, checkpoint_id=os.path.join(ck, "good"), storage_writer=w, async_checkpointer_type=PROCESS).result()
    dist.barrier()
    dst = zero_state(mesh)
    dcp.load(dst, storage_reader=ShmckptReader(os.path.join(ck, "good")))
    out["good"] = compare(ref, dst)

    proc = checkpoint_process()
    out["bg_pid"] = proc.pid
    # The checkpoint process opened no engine: the trainer's engine staged and wrote.
    out["bg_segments"] = segments([proc.pid])
    out["own_segments"] = len(segments([os.getpid()]))
    result(workdir, "saves", rank, out)
    dist.barrier()
    # No release(): the interpreter's exit frees this engine (atexit) and ends the
    # checkpoint process (SIGTERM from multiprocessing); the test checks /dev/shm after.
    dist.destroy_process_group()


def sc_unstaged(rank, world, workdir):
    """async_save with DCP's own stager and ShmckptWriter as the storage only: the
    checkpoint process stages and writes through an engine of its own (opened lazily, on
    its own root), which it frees when the trainer exits."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    ck = os.path.join(workdir, "ckpt")
    stager = DefaultStager(StagingOptions(False, False, False, False))
    out = {}
    for i in range(2):
        src = make_state(mesh, seed_shift=float(i))
        ref = make_state(mesh, seed_shift=float(i))
        w = ShmckptWriter(os.path.join(ck, f"u{i}"), tuning=Tuning(chunk_size=CHUNK))
        dcp.async_save(src, storage_writer=w, async_stager=stager, async_checkpointer_type=PROCESS).result()
        dist.barrier()
        dst = zero_state(mesh)
        dcp.load(dst, storage_reader=ShmckptReader(os.path.join(ck, f"u{i}")))
        out[f"u{i}"] = compare(ref, dst)
    stager.close()
    proc = checkpoint_process()
    out["bg_pid"] = proc.pid
    out["bg_segments"] = len(segments([proc.pid]))
    # The checkpoint process's engine has its own root next to the trainer's (none here).
    spool_rank = os.path.join(ck, ".shmckpt-dcp", f"rank-{rank:05d}")
    out["roots"] = sorted(r.split("-")[0] == str(proc.pid) for r in os.listdir(spool_rank))
    result(workdir, "unstaged", rank, out)
    dist.barrier()
    dist.destroy_process_group()


def sc_checked(rank, world, workdir, flip):
    """PROCESS saves with ``ShmckptWriter(check_replicas=group)`` (the state of
    dcp_divergence_worker.py; rank FLIP flips a bit of its replicated ``model.w`` for the
    divergent saves): the check runs in the trainer when the staged state is handed over,
    and the checkpoint process raises its outcome on every rank, as THREAD does."""
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from dcp_divergence_worker import failure, state

    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")
    ck = os.path.join(workdir, "ckpts")
    out = {}

    def attempt(name, flipped, on_divergence="raise", stager=None):
        path = os.path.join(ck, name)
        w = ShmckptWriter(path, check_replicas=group, on_divergence=on_divergence, tuning=Tuning(chunk_size=CHUNK))
        st = state(mesh, flipped and rank == int(flip))
        kw = {} if stager is None else {"async_stager": stager}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                dcp.async_save(st, storage_writer=w, async_checkpointer_type=PROCESS, **kw).result(timeout=150)
                got = {"ok": True}
            except CheckpointException as e:
                got = {"ok": False, "failures": failure(e)}
        dist.barrier()
        got["published"] = os.path.isfile(os.path.join(path, ".metadata"))
        got["warnings"] = [f"{type(x.message).__name__}: {x.message}" for x in caught if "diverge" in str(x.message)]
        out[name] = got
        print(name, got, flush=True)

    attempt("clean", False)
    attempt("raise", True)
    attempt("warn", True, on_divergence="warn")
    # A save the checkpoint process would stage itself cannot be checked: refused.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    attempt("unstaged", False, stager=stager)
    stager.close()
    attempt("clean_after", False)
    dist.barrier()
    left = []
    for d, _dirs, files in os.walk(os.path.join(ck, ".shmckpt-dcp")):
        left += [f for f in files if f.endswith(".safetensors")]
    out["spool_rank_files"] = sorted(left)
    out["listing"] = sorted(n for n in os.listdir(ck) if not n.startswith("."))
    result(workdir, "checked", rank, out)
    dist.barrier()
    dist.destroy_process_group()


SCENARIOS = {"saves": sc_saves, "unstaged": sc_unstaged, "checked": sc_checked}

if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("DCP_WORKER_TIMEOUT", "200")), exit=True)
    scenario, rank, world, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    SCENARIOS[scenario](rank, world, workdir, *sys.argv[5:])
