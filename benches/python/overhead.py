#!/usr/bin/env python3
"""Per-tensor Python overhead of ``shmckpt.Checkpointer.save`` on small CPU tensors.

The state is a model (``nn.Parameter`` weights) plus an AdamW-like optimizer state dict
(per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``; plus ``param_groups``), so that a
state of N tensors has N/4 parameters. Tensors are tiny (``--numel`` elements), so the
engine's own staging time is small and what remains is Python-side work.

Reported per tensor count (medians over ``--reps`` saves, in microseconds per tensor):

* ``flatten``: ``_state.flatten`` + ``_state.encode`` alone (no engine, cyclic GC off);
* ``save - staging``: the wall time of a blocking ``save()`` minus the engine's reported
  ``staging`` (what the Python package adds around the engine);
* ``nb save()``: the wall time of a non-blocking ``save()`` call (includes the CPU
  clones a non-blocking save takes of unguarded tensors).

Example: ``python benches/python/overhead.py --tensors 1000,10000 --reps 15``
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time


def make_state(n_tensors: int, numel: int):
    import torch

    n = max(1, n_tensors // 4)
    model = {}
    for i in range(n):
        model[f"layers.{i // 4}.sub{i % 4}.weight"] = torch.nn.Parameter(
            torch.randn(numel, dtype=torch.float32)
        )
    state = {}
    for i in range(n):
        state[i] = {
            "step": torch.tensor(float(i + 1)),
            "exp_avg": torch.zeros(numel, dtype=torch.float32),
            "exp_avg_sq": torch.zeros(numel, dtype=torch.float32),
        }
    optim = {
        "state": state,
        "param_groups": [
            {
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.01,
                "amsgrad": False,
                "params": list(range(n)),
            }
        ],
    }
    return {"model": model, "optim": optim, "step": 7, "name": "bench"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", default="1000,10000", help="comma-separated tensor counts (default 1000,10000)")
    ap.add_argument("--numel", type=int, default=16, help="elements per tensor (float32; default 16)")
    ap.add_argument("--reps", type=int, default=15, help="timed saves per count (default 15)")
    ap.add_argument("--root", default=None, help="checkpoint root (default: a temporary directory)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of blocking saves (largest count)")
    args = ap.parse_args()

    import torch

    import shmckpt
    from shmckpt import _state

    counts = [int(x) for x in args.tensors.split(",") if x]
    print(
        f"# python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cpus, numel {args.numel}, reps {args.reps}"
    )
    print("| tensors | flatten+encode (no GC) µs/t | save - staging µs/t | save wall ms | staging ms | nb save() µs/t |")
    print("|---|---|---|---|---|---|")
    tmp = None
    root = args.root
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="shmckpt-overhead-")
        root = tmp.name
    step = 0
    for n in counts:
        state = make_state(n, args.numel)
        ntens = len(_state.flatten(state).leaves)
        fl = []
        gc.collect()
        gc.disable()  # the code alone: collections here depend on the heap's history
        try:
            for _ in range(args.reps):
                t0 = time.perf_counter()
                _state.encode(_state.flatten(state))
                fl.append(time.perf_counter() - t0)
        finally:
            gc.enable()
        with shmckpt.Checkpointer(root, keep_last=2, rank=0, world_size=1) as ck:
            ck.save(step, state).wait()  # warm-up
            step += 1
            over, walls, stag, nb = [], [], [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                h = ck.save(step, state)
                dt = time.perf_counter() - t0
                rep = h.wait()
                step += 1
                walls.append(dt)
                stag.append(rep["staging"])
                over.append(dt - rep["staging"])
            for _ in range(args.reps):
                t0 = time.perf_counter()
                h = ck.save(step, state, blocking=False)
                dt = time.perf_counter() - t0
                h.wait()
                step += 1
                nb.append(dt)
            if args.profile and n == counts[-1]:
                import cProfile
                import pstats

                pr = cProfile.Profile()
                pr.enable()
                for _ in range(3):
                    ck.save(step, state).wait()
                    step += 1
                pr.disable()
                pstats.Stats(pr, stream=sys.stderr).sort_stats("tottime").print_stats(25)
        med = statistics.median
        print(
            f"| {ntens} | {med(fl) / ntens * 1e6:.2f} | {med(over) / ntens * 1e6:.2f} | "
            f"{med(walls) * 1e3:.2f} | {med(stag) * 1e3:.2f} | {med(nb) / ntens * 1e6:.2f} |"
        )
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
