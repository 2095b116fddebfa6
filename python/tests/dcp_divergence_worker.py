"""One rank of the DCP replica divergence test (test_divergence.py, docs/guarantees.md).

Usage: python dcp_divergence_worker.py dcp RANK WORLD WORKDIR FLIP. Every rank holds the
same replicated plain tensors (``model.w``, ``model.b``) and a row shard of a DTensor
(``model.emb``, its own rows); rank FLIP flips one bit of its ``model.w`` for the
divergent saves. Saves, each with ``ShmckptWriter(check_replicas=group)``:

* ``clean``: ``dcp.save`` of identical replicas: published.
* ``save_raise``: ``dcp.save`` with the flip: ``CheckpointException`` whose failures are
  ``ReplicaDivergence`` naming ``model.w`` and the odd rank(s); nothing published.
* ``async_raise``: the same through ``dcp.async_save`` (the writer's ``stage()``).
* ``async_warn``: ``on_divergence="warn"``: published, with a warning.
* ``clean_after``: identical replicas again: published (the writer is usable after).

Writes WORKDIR/result-dcp-RANK.json.
"""

import faulthandler
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shmckpt import ReplicaDivergence
from shmckpt.dcp import ShmckptWriter, release


def state(mesh, flip):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 32, generator=g)
    if flip:
        w.view(torch.int32)[5, 3] ^= 1 << 4
    emb = distribute_tensor(torch.randn(mesh.size() * 4, 8, generator=g), mesh, [Shard(0)])
    return {"model": {"w": w, "b": torch.arange(32, dtype=torch.bfloat16), "emb": emb}}


def failure(e):
    """What each rank's failure of a CheckpointException says."""
    out = {}
    for r, (exc, _tb) in e.failures.items():
        d = {"type": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, ReplicaDivergence):
            d.update(tensor=exc.tensor, ranks=exc.ranks, crc_ranks=sorted(exc.crcs), committed=exc.committed)
            d["divergences"] = [t for t, _, _ in exc.divergences]
        out[str(r)] = d
    return out


def main():
    faulthandler.dump_traceback_later(int(os.environ.get("DBG_DUMP", "100000")), exit=True)
    scenario, rank, world, workdir, flip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    assert scenario == "dcp"
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")
    res = {}
    ckpts = os.path.join(workdir, "ckpts")

    def attempt(name, flipped, on_divergence="raise", use_async=False):
        path = os.path.join(ckpts, name)
        w = ShmckptWriter(path, check_replicas=group, on_divergence=on_divergence)
        st = state(mesh, flipped and rank == flip)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if use_async:
                    dcp.async_save(st, storage_writer=w).result()
                else:
                    dcp.save(st, storage_writer=w)
                out = {"ok": True}
            except CheckpointException as e:
                out = {"ok": False, "failures": failure(e)}
        dist.barrier()
        out["published"] = os.path.isfile(os.path.join(path, ".metadata"))
        out["exists"] = os.path.lexists(path)
        out["warnings"] = [f"{type(x.message).__name__}: {x.message}" for x in caught if "diverge" in str(x.message)]
        res[name] = out
        print(name, out, flush=True)

    attempt("clean", False)
    attempt("save_raise", True)
    attempt("async_raise", True, use_async=True)
    attempt("async_warn", True, on_divergence="warn", use_async=True)
    attempt("clean_after", False, use_async=True)
    dist.barrier()
    spool = os.path.join(ckpts, ".shmckpt-dcp")
    # No assembled or partial step of the refused saves is left in the spool.
    left = []
    for d, _dirs, files in os.walk(spool):
        left += [os.path.relpath(os.path.join(d, f), spool) for f in files if f.endswith(".safetensors")]
    res["spool_rank_files"] = sorted(left)
    res["listing"] = sorted(n for n in os.listdir(ckpts) if not n.startswith("."))
    release()
    with open(os.path.join(workdir, f"result-dcp-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
