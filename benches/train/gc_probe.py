#!/usr/bin/env python3
"""What guarded saves every step cost the trainer in CPython's cyclic garbage collector.

A host "trainer" of ``--params`` parameters (``--numel`` floats each) and their AdamW
state, saved non-blocking under the checkpointer's guard at every iteration (a save, then
the optimizer step: what the guard's hook and the speculative start run each step), the
disk taking every ``--disk-every``-th save. After ``--warmup`` iterations, ``--iters``
iterations are timed; per run, the collections of each generation over them (a collection
of the oldest one walks the whole heap, torch's included, holding the interpreter) and
the iteration's median, p99 and max. ``--rounds`` runs of fresh checkpointers in one
process, so the heap is the same for each.

    python3 benches/train/gc_probe.py --out $OUT
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--params", type=int, default=600)
    a("--numel", type=int, default=64)
    a("--iters", type=int, default=400)
    a("--warmup", type=int, default=20)
    a("--rounds", type=int, default=1)
    a("--disk-every", type=int, default=8)
    a("--dir", default="/var/tmp/gc_probe")
    a("--out", default=None)
    return p.parse_args(argv)


def run(args, torch, shmckpt):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.numel)) for _ in range(args.params)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    state = {"model": {f"p{i}": p for i, p in enumerate(params)}, "optim": opt.state_dict()}
    shutil.rmtree(args.dir, ignore_errors=True)
    ck = shmckpt.Checkpointer(args.dir, keep_last=2, cadence=shmckpt.Cadence(disk_every=args.disk_every))
    try:
        ck.guard(opt)
        for k in range(1, args.warmup + 1):
            ck.save(k, state, blocking=False)
            opt.step()
        ck.wait()
        gc.collect()
        before = [s["collections"] for s in gc.get_stats()]
        ts = []
        for k in range(args.warmup + 1, args.warmup + 1 + args.iters):
            t = time.perf_counter()
            ck.save(k, state, blocking=False)
            opt.step()
            ts.append((time.perf_counter() - t) * 1e3)
        collections = [s["collections"] - b for s, b in zip(gc.get_stats(), before)]
        ck.wait()
    finally:
        ck.close()
        shutil.rmtree(args.dir, ignore_errors=True)
    ts.sort()
    return {
        "collections": collections,
        "iter_ms_median": statistics.median(ts),
        "iter_ms_p99": ts[int(0.99 * (len(ts) - 1))],
        "iter_ms_max": ts[-1],
        "iters_over_100ms": sum(t > 100 for t in ts),
        "objects": len(gc.get_objects()),
    }


def main(argv=None):
    args = parse_args(argv)
    import torch

    import shmckpt

    rows = [run(args, torch, shmckpt) for _ in range(args.rounds)]
    for r in rows:
        print(
            f"collections (young, middle, oldest) {r['collections']}; iteration median {r['iter_ms_median']:.2f} ms, "
            f"p99 {r['iter_ms_p99']:.1f}, max {r['iter_ms_max']:.1f}; over 100 ms: {r['iters_over_100ms']}; "
            f"heap {r['objects']} objects"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gc_probe.json"), "w") as f:
            json.dump({"args": vars(args), "rounds": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
