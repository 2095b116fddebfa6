"""Child process of test_divergence.py (not a test module): one rank of a gloo world whose
checkpointers compare data-parallel replicas (``check_replicas``).

    python divergence_worker.py ROOT RANK WORLD PORT OUT FLIP

Rank FLIP's copy of ``model.w`` has one bit flipped in the steps marked below; every rank
writes a JSON report of what each step did to OUT.
"""

import json
import os
import sys
import warnings

import torch


def state(rank, step, flip):
    g = torch.Generator().manual_seed(step)
    w = torch.randn(64, 33, generator=g)
    if flip:
        w.view(torch.int32)[7, 5] ^= 1 << 9  # one bit of one element
    return {
        "model": {"w": w, "b": torch.arange(4, dtype=torch.int64) + step},
        # Not replicas: a name of this rank's own, and a shard whose shape differs per rank.
        "rng": {f"rank{rank}": torch.full((3,), float(rank))},
        "shard": torch.full((rank + 1,), float(rank)),
        "step": step,
    }


def outcome(fn):
    try:
        rep = fn()
    except Exception as e:
        return {
            "error": type(e).__name__,
            "step": getattr(e, "step", None),
            "tensor": getattr(e, "tensor", None),
            "ranks": getattr(e, "ranks", None),
            "crc_ranks": sorted(getattr(e, "crcs", {}) or {}),
            "distinct_crcs": len(set((getattr(e, "crcs", {}) or {}).values())),
            "divergences": [d[0] for d in getattr(e, "divergences", [])],
            "committed": getattr(e, "committed", None),
            "message": str(e),
        }
    div = rep.get("replica_divergence")
    return {
        "ok": True,
        "dir": os.path.basename(rep["dir"]) if rep.get("dir") else None,
        "check_seconds": rep.get("replica_check"),
        "divergence": None if div is None else {"tensor": div.tensor, "ranks": div.ranks, "committed": div.committed},
    }


def listing(root):
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


def main(root, rank, world, port, out, flip):
    import torch.distributed as dist

    import shmckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    kw = dict(tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20), check_replicas=group)
    res = {}

    # on_divergence="raise" (the default).
    r = os.path.join(root, "raise")
    ck = shmckpt.Checkpointer(r, **kw)
    res["raise_1"] = outcome(lambda: ck.save(1, state(rank, 1, False)).wait())
    h = ck.save(2, state(rank, 2, rank == flip), blocking=False)  # checked in wait()
    res["raise_2"] = outcome(h.wait)
    # Step 3 is checked at the start of step 4's save, step 4 at ck.wait().
    h3 = ck.save(3, state(rank, 3, False))
    h4 = ck.save(4, state(rank, 4, False))
    ck.wait()
    res["raise_3"] = outcome(h3.wait)
    res["raise_4"] = outcome(h4.wait)
    dist.barrier()
    res["raise_list"] = ck.list()
    res["raise_listing"] = listing(r)
    ck.close()

    # on_divergence="warn": committed, with a warning naming the rank and tensor.
    r = os.path.join(root, "warn")
    ck = shmckpt.Checkpointer(r, on_divergence="warn", **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res["warn_1"] = outcome(lambda: ck.save(1, state(rank, 1, rank == flip)).wait())
    res["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    dist.barrier()
    res["warn_list"] = ck.list()
    ck.close()

    # A callback: commits when every rank's answers True (here: only rank 0 says no at
    # step 1; all say yes at step 2).
    r = os.path.join(root, "callback")
    seen = []

    def decide(err):
        seen.append((err.step, err.tensor, err.ranks))
        return not (err.step == 1 and rank == 0)

    ck = shmckpt.Checkpointer(r, on_divergence=decide, **kw)
    res["cb_1"] = outcome(lambda: ck.save(1, state(rank, 1, rank == flip)).wait())
    res["cb_2"] = outcome(lambda: ck.save(2, state(rank, 2, rank == flip)).wait())
    res["cb_seen"] = seen
    dist.barrier()
    res["cb_list"] = ck.list()
    res["cb_listing"] = listing(r)
    ck.close()

    with open(out, "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), int(a[3]), a[4], int(a[5]))
