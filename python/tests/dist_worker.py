"""Child process of the multi-process tests (not a test module).

    python dist_worker.py gloo ROOT RANK WORLD PORT OUT   # save and load over gloo (CPU)
    python dist_worker.py nccl ROOT RANK WORLD PORT OUT   # the same over NCCL, cuda:RANK
    python dist_worker.py kill ROOT STEP                  # SIGKILL itself once staged
    python dist_worker.py resources ROOT OUT              # 100 saves; RSS, fds, /dev/shm
    python dist_worker.py session ROOT RANK WORLD PORT OUT dead|new   # a run's session
"""

import hashlib
import json
import os
import signal
import sys

import torch


def rank_state(rank, world, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "b": torch.arange(rank + 1, dtype=torch.int64)},
        "shared": torch.full((5,), float(step)),
        "step": step,
        "who": f"rank {rank} of {world}",
    }


def big_state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randint(-(2**31), 2**31 - 1, (32 << 20,), dtype=torch.int32, generator=g), "step": step}


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def to(state, device):
    if isinstance(state, dict):
        return {k: to(v, device) for k, v in state.items()}
    return state.to(device) if isinstance(state, torch.Tensor) else state


def gloo(root, rank, world, port, out, backend="gloo"):
    import torch.distributed as dist

    import shmckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=world)
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20))
    assert (ck.rank, ck.world_size) == (rank, world)
    ck.save(5, to(rank_state(rank, world, 5), device)).wait()
    h = ck.save(6, to(rank_state(rank, world, 6), device), blocking=False)
    h.wait()
    dist.barrier()  # every rank's file durable: the steps are committed
    res = {"latest": ck.latest(), "list": ck.list(), "ok": []}
    for step in (5, 6):
        want = rank_state(rank, world, step)
        got = ck.load(step)
        same = (
            got["step"] == step
            and got["who"] == want["who"]
            and digest(got["model"]["w"]) == digest(want["model"]["w"])
            and digest(got["model"]["b"]) == digest(want["model"]["b"])
            and digest(got["shared"]) == digest(want["shared"])
        )
        res["ok"].append(same)
        dest = {k: torch.zeros_like(v) for k, v in want["model"].items()}
        ck.load_into({"model": dest, "shared": torch.zeros(5)}, step=step)
        res["ok"].append(all(digest(dest[k]) == digest(want["model"][k]) for k in dest))
    res["world_in_manifest"] = ck.manifest(6)["world_size"]
    if backend == "gloo":
        res["dtensor_ok"] = dtensor_round_trip(ck, rank, world)
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(res, f)


def dtensor_round_trip(ck, rank, world):
    """A DTensor sharded on dim 0: each rank saves its local shard with its global offset
    and shape in the skeleton, and loads the same shard back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shmckpt import _shmckpt, _state

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    ck.save(7, {"dt": dt, "step": 7}).wait()
    dist.barrier()
    piece = -(-10 // world)
    lo, hi = min(rank * piece, 10), min((rank + 1) * piece, 10)
    got = ck.load(7)["dt"]
    meta = _shmckpt.rank_file_metadata(os.path.join(ck.root, "step-7"), rank)
    node = [n for n in _state.tensor_nodes(_state.decode(meta[_state.STATE_KEY])) if n["n"] == "dt"][0]
    return (
        torch.equal(got, full[lo:hi])
        and node["dtensor"]["global_shape"] == [10, 3]
        and node["dtensor"]["global_offset"] == [lo, 0]
    )


def kill(root, step):
    import shmckpt

    ck = shmckpt.Checkpointer(
        root, tuning=shmckpt.Tuning(staging_capacity=160 << 20, chunk_size=64 << 10, writer_threads=1, queue_depth=1)
    )
    if not ck.list():
        ck.save(1, {"w": torch.arange(10), "step": 1}).wait()
    h = ck.save(step, big_state(step), blocking=False)
    h.wait_staged()
    print(ck.shm_name, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def rss():
    """Resident bytes, after returning free heap to the OS (less allocator noise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shm_entries():
    """This process's staging segments (other processes on the machine make their own)."""
    mine = f"shmckpt.{os.getpid()}."
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(mine))


def open_fds():
    """This process's open descriptors, each as `fd -> target`."""
    out = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass  # the descriptor listdir itself used, closed since
    return out


def resources(root, out):
    """100 saves (blocking and not) with loads between, in a process of their own so that
    no other test's objects open or close descriptors meanwhile; writes what it measured."""
    import shmckpt

    g = torch.Generator().manual_seed(0)
    state = {
        "model": {f"l{i}": torch.randn(256, 256, generator=g) for i in range(16)},  # 4 MiB
        "optim": {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "n": 0,
    }
    with shmckpt.Checkpointer(
        root, tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=1 << 20), keep_last=2
    ) as c:
        for s in range(30):  # warm up: allocator pools, threads
            c.save(s, state, blocking=bool(s % 2)).wait()
        c.load()
        base = {"rss": rss(), "fds": open_fds(), "shm": shm_entries()}
        for s in range(30, 130):
            state["n"] = s
            c.save(s, state, blocking=bool(s % 2)).wait()
            if s % 10 == 0:
                c.load()
        after = {"rss": rss(), "fds": open_fds(), "shm": shm_entries()}
        res = {"base": base, "after": after, "list": c.list(), "name": c.shm_name}
    res["closed_shm"] = shm_entries()
    with open(out, "w") as f:
        json.dump(res, f)


def session(root, rank, world, port, out, phase):
    """Two runs of two gloo ranks on one root, no load in between (nothing is committed).
    ``dead``: only rank 1 saves step 3 (its part is durable; rank 0 "died" first).
    ``new``: rank 0 saves step 3 first, then (after a barrier) rank 1; records whether
    rank 0's save alone committed the step, what each rank loads, and the sessions the
    manifest names."""
    import torch.distributed as dist

    import shmckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20))
    seed = 3 if phase == "dead" else 30
    res = {"latest_at_open": ck.latest()}
    if phase == "dead":
        if rank == 1:
            ck.save(3, rank_state(rank, world, seed)).wait()
        dist.barrier()
    else:
        if rank == 0:
            ck.save(3, rank_state(rank, world, seed)).wait()
            res["committed_by_rank_0_alone"] = ck.list()
        dist.barrier()
        if rank == 1:
            ck.save(3, rank_state(rank, world, seed)).wait()
        dist.barrier()
        want = rank_state(rank, world, seed)
        got = ck.load(3)
        res["loaded_exact"] = digest(got["model"]["w"]) == digest(want["model"]["w"]) and got["who"] == want["who"]
        res["sessions"] = [f.get("session") for f in ck.manifest(3)["files"]]
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode in ("gloo", "nccl"):
        gloo(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], mode)
    elif mode == "kill":
        kill(sys.argv[2], int(sys.argv[3]))
    elif mode == "resources":
        resources(sys.argv[2], sys.argv[3])
    elif mode == "session":
        session(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7])
    else:
        sys.exit(f"unknown mode {mode}")
