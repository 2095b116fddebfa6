"""One rank of the Megatron-Core tests (spawned by test_megatron.py).

Usage: python megatron_worker.py SCENARIO RANK WORLD WORKDIR. Each rank writes
WORKDIR/result-SCENARIO-RANK.json with what it checked; the parent checks every exit
status and every result file.

On CPU (gloo), Megatron's ``AsyncCallsQueue`` runs unchanged except for two calls it
hard-codes to CUDA, which have no CPU form: ``TemporalAsyncCaller`` calls
``torch.cuda.synchronize()`` before forking its worker, and its done/finalize flags are
tensors on ``torch.cuda.current_device()``. ``_cpu_stand_ins`` points those two at the
CPU (a no-op and the CPU device) in this process only; everything of shmckpt's and of
Megatron's planning, AsyncRequest, fork, finalize and load runs as on a GPU machine.
"""

import faulthandler
import hashlib
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402

import shmckpt.megatron as smg  # noqa: E402


def _cpu_stand_ins():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def global_tensor(name, shape, dtype):
    g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def digest(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


#: name -> (global shape, dtype, sharded axis or None for replicated)
LAYOUT = {
    "decoder.layers.qkv.weight": ((8, 6), torch.float32, 0),
    "decoder.layers.proj.weight": ((4, 12), torch.bfloat16, 1),
    "decoder.final_norm.bias": ((6,), torch.float32, None),
}


def sharded_state(rank, world, zero=False, objects=True):
    """A Megatron sharded state dict: tensor-parallel shards (dim 0 and dim 1), a
    replicated tensor (main replica on rank 0), one ShardedObject per rank, and common
    (non-sharded) values. ``zero``: the same layout with zeroed tensors (a load target)."""
    sd = {"model": {}, "common": {"iteration": 7, "args": {"lr": 0.5, "name": "tiny"}}}
    for name, (shape, dtype, axis) in LAYOUT.items():
        g = global_tensor(name, shape, dtype)
        if axis is None:
            local = g.clone()
            st = ShardedTensor.from_rank_offsets(name, local, replica_id=rank)
        else:
            local = g.chunk(world, dim=axis)[rank].clone()
            st = ShardedTensor.from_rank_offsets(name, local, (axis, rank, world))
        if zero:
            local.zero_()
        sd["model"][name] = st
    if objects:
        sd["rng"] = ShardedObject(
            "rng_state", {"rank": rank, "seed": 1234 + rank} if not zero else None, (world,), (rank,), replica_id=0
        )
    return sd


def expected_local(name, rank, world):
    shape, dtype, axis = LAYOUT[name]
    g = global_tensor(name, shape, dtype)
    return g if axis is None else g.chunk(world, dim=axis)[rank]


def init(rank, world, workdir, tag):
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'store-' + tag)}", rank=rank, world_size=world
    )


def check_loaded(loaded, rank, world):
    """Byte-exact comparison of a loaded state with what was saved. Returns the checks."""
    out = {}
    for name in LAYOUT:
        t = loaded["model"][name]
        e = expected_local(name, rank, world)
        out[name] = [str(t.dtype), list(t.shape), digest(t) == digest(e) and t.dtype == e.dtype]
    out["common"] = loaded["common"]
    if "rng" in loaded:
        out["rng"] = loaded["rng"]
    return out


def scenario_async_queue(rank, world, workdir):
    """Save twice through Megatron's AsyncCallsQueue (TemporalAsyncCaller: fork), the
    second while the first is still pending, mutating the tensors right after each
    async_save returned; finalize; load back through dist_checkpointing.load."""
    _cpu_stand_ins()
    init(rank, world, workdir, "async")
    res = {}
    q = AsyncCallsQueue()
    strategy = smg.ShmckptSaveShardedStrategy(chunk_size=1 << 20)
    dirs = [os.path.join(workdir, "ckpt", f"iter_{i:07d}") for i in (1, 2)]
    for i, d in enumerate(dirs):
        if rank == 0:
            os.makedirs(d)
        dist.barrier()
        sd = sharded_state(rank, world)
        req = dist_checkpointing.save(sd, d, strategy, async_sharded_save=True)
        # Staged: the trainer may change its tensors now.
        for st in sd["model"].values():
            st.data.add_(1000 + i)
        res[f"files_before_finalize_{i}"] = sorted(os.listdir(d))
        q.schedule_async_request(req)
    done = []
    deadline = time.time() + 120
    while q.get_num_unfinalized_calls() and time.time() < deadline:
        done += q.maybe_finalize_async_calls(blocking=False)
        time.sleep(0.05)
    res["finalized"] = done
    q.close()
    dist.barrier()
    res["files"] = sorted(os.listdir(dirs[1]))
    with open(os.path.join(dirs[1], "metadata.json")) as f:
        res["metadata_json"] = json.load(f)
    for i, d in enumerate(dirs):
        target = sharded_state(rank, world, zero=True)
        loaded = dist_checkpointing.load(target, d)
        res[f"loaded_{i}"] = check_loaded(loaded, rank, world)
    # The load strategy Megatron picked from metadata.json:
    res["load_strategy"] = type(dist_checkpointing.serialization.get_default_load_sharded_strategy(dirs[0])).__name__
    dist.barrier()
    return res


def scenario_sync(rank, world, workdir):
    """Megatron's synchronous path (async_sharded_save=False: the strategy's save runs
    the AsyncRequest in place) and a load."""
    init(rank, world, workdir, "sync")
    d = os.path.join(workdir, "ckpt", "iter_0000003")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    strategy = smg.ShmckptSaveShardedStrategy(chunk_size=1 << 20)
    ret = dist_checkpointing.save(sharded_state(rank, world), d, strategy)
    res = {"returned": repr(ret), "files": sorted(os.listdir(d))}
    loaded = dist_checkpointing.load(sharded_state(rank, world, zero=True), d)
    res["loaded"] = check_loaded(loaded, rank, world)
    dist.barrier()
    return res


def scenario_reshard_load(rank, world, workdir):
    """Load the checkpoint the 2-rank async scenario saved with this world size."""
    init(rank, world, workdir, f"reshard{world}")
    d = os.path.join(workdir, "ckpt", "iter_0000002")
    # A ShardedObject's key names the world it was saved with: tensors only here.
    loaded = dist_checkpointing.load(sharded_state(rank, world, zero=True, objects=False), d)
    res = {"loaded": check_loaded(loaded, rank, world)}
    dist.barrier()
    return res


def scenario_fail(rank, world, workdir):
    """Rank 1's write fails (its write results raise what the engine would): finalize
    raises CheckpointException on every rank, naming rank 1, and nothing is committed."""
    _cpu_stand_ins()
    init(rank, world, workdir, "fail")
    d = os.path.join(workdir, "ckpt", "iter_0000009")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    if rank == 1:

        def failed(self):
            self._watcher.join()
            raise smg.SaveFailed("injected: rank 1's file could not be written")

        smg._MegatronWriter.retrieve_write_results = failed
    q = AsyncCallsQueue()
    strategy = smg.ShmckptSaveShardedStrategy(chunk_size=1 << 20)
    req = dist_checkpointing.save(sharded_state(rank, world), d, strategy, async_sharded_save=True)
    q.schedule_async_request(req)
    res = {}
    try:
        q.maybe_finalize_async_calls(blocking=True)
        res["error"] = None
    except BaseException as e:  # CheckpointException is a BaseException
        res["error"] = type(e).__name__
        res["failed_ranks"] = sorted(getattr(e, "failures", {}))
        res["message"] = str(e)[:500]
    dist.barrier()
    res["files"] = sorted(os.listdir(d))
    return res


def main():
    faulthandler.dump_traceback_later(200, exit=True)  # a hung rank fails, with its stacks
    scenario, rank, world, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    res = globals()[f"scenario_{scenario}"](rank, world, workdir)
    with open(os.path.join(workdir, f"result-{scenario}-{world}-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
