#!/usr/bin/env python3
"""Python-level benchmarks of the shmckpt package on a GPU (issue 11, docs/benchmarks.md).

    python scripts/bench_python.py DIR stall --size-gib 8 --tensors 64
    python scripts/bench_python.py DIR stall --size-gib 16 --tensors 1000 --mixed
    python scripts/bench_python.py DIR guard --size-gib 8 --tensors 64 --compute-ms 300
    python scripts/bench_python.py DIR load  --size-gib 8 --tensors 64

Prints one JSON object. ``stall``: median time of ``ckpt.save(step, state)`` (blocking,
returns when staged) against one pinned device-to-host copy of the same tensors measured
in the same run (compare with ``shmckpt bench --source cuda --size 8GiB --tensors 64
--json`` on the same machine and directory). ``guard``: a trainer loop whose forward and
backward is ``--compute-ms`` of GPU work; a non-blocking save under ``guard`` every
iteration-with-save; reports the time ``opt.step()`` waited for staging against the pinned
copy. ``load``: ``ckpt.load(map_location="cuda")`` against
``safetensors.torch.load_file(device="cuda")`` and ``torch.load(map_location="cuda")`` of
the same state (page cache dropped only if run as root with ``--drop-caches``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import shmckpt


def make_state(size_gib, n, mixed, device="cuda"):
    total = int(size_gib * (1 << 30))
    g = torch.Generator(device=device).manual_seed(0)
    state = {}
    if not mixed:
        per = total // n // 2  # bf16 elements
        for i in range(n):
            t = torch.empty(per, dtype=torch.bfloat16, device=device)
            t.view(torch.int16).random_(generator=g)
            state[f"layer.{i}.weight"] = t
        return state
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.float32]
    # Sizes from 4 KiB to a few hundred MiB, summing to `total`.
    weights = [1 + (i * 7919) % 97 for i in range(n)]
    scale = total / sum(weights)
    for i, w in enumerate(weights):
        dt = dtypes[i % len(dtypes)]
        es = torch.empty(0, dtype=dt).element_size()
        numel = max(1024, int(w * scale) // es)
        t = torch.empty(numel, dtype=dt, device=device)
        t.view(torch.uint8).random_(generator=g)
        state[f"block.{i // 8}.p{i % 8}"] = t
    return state


def pinned_copy_s(tensors):
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    s = torch.cuda.Stream()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            for b, t in zip(bufs, tensors):
                b.copy_(t, non_blocking=True)
        s.synchronize()
        times.append(time.perf_counter() - t0)
    del bufs
    return statistics.median(times)


def nbytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())


def bench_stall(a):
    state = make_state(a.size_gib, a.tensors, a.mixed)
    b = nbytes(state)
    d2h = pinned_copy_s(list(state.values()))
    out = {"bytes": b, "tensors": len(state), "d2h_s": d2h}
    with shmckpt.Checkpointer(a.dir, staging_capacity=b + (256 << 20)) as ck:
        out["register_s"] = ck.prepare_cuda([0])
        first = (ck.latest() or 0) + 1
        stalls, durable = [], []
        for i in range(a.repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = ck.save(first + i, {"model": state})
            stalls.append(time.perf_counter() - t0)
            r = h.wait()
            durable.append(r["durable"])
        out.update(
            stall_s=statistics.median(stalls),
            stall_runs_s=stalls,
            stall_ratio=statistics.median(stalls) / d2h,
            durable_s=statistics.median(durable),
        )
    return out


def bench_guard(a):
    params = [torch.nn.Parameter(t) for t in make_state(a.size_gib, a.tensors, False).values()]
    b = sum(p.numel() * p.element_size() for p in params)
    d2h = pinned_copy_s([p.detach() for p in params])
    opt = torch.optim.SGD(params, lr=0.0)
    for p in params:
        p.grad = torch.zeros_like(p)
    x = torch.randn(4096, 4096, device="cuda")
    # Calibrate the fake forward+backward to about --compute-ms.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        x = torch.tanh(x @ x / 4096)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 10
    iters = max(1, int(a.compute_ms / 1000 / per))
    waits, calls = [], []
    with shmckpt.Checkpointer(a.dir, staging_capacity=b + (256 << 20)) as ck:
        ck.prepare_cuda([0])
        ck.guard(opt)
        real = ck.wait_staged

        def timed():
            t = time.perf_counter()
            real()
            waits.append(time.perf_counter() - t)

        ck.wait_staged = timed
        first = (ck.latest() or 0) + 1
        for i in range(a.repeat):
            t = time.perf_counter()
            h = ck.save(first + i, {"model": {f"p{j}": p for j, p in enumerate(params)}}, blocking=False)
            calls.append(time.perf_counter() - t)
            for _ in range(iters):  # forward + backward
                x = torch.tanh(x @ x / 4096)
            opt.step()  # waits for what is left of the copy
            h.wait()
    per_save = waits[-a.repeat:]
    return {
        "bytes": b,
        "d2h_s": d2h,
        "compute_s": iters * per,
        "save_call_s": statistics.median(calls),
        "step_wait_s": statistics.median(per_save),
        "step_wait_runs_s": per_save,
        "step_wait_ratio": statistics.median(per_save) / d2h,
    }


def bench_load(a):
    from safetensors.torch import load_file

    state = make_state(a.size_gib, a.tensors, a.mixed)
    b = nbytes(state)
    out = {"bytes": b}
    with shmckpt.Checkpointer(a.dir, staging_capacity=b + (256 << 20)) as ck:
        step = (ck.latest() or 0) + 1
        ck.save(step, {"model": state}).wait()
        path = os.path.join(a.dir, f"step-{step}", "rank-00000-of-00001.safetensors")
        tpath = os.path.join(a.dir, f"torch-{step}.pt")
        torch.save(state, tpath)
        del state
        torch.cuda.empty_cache()  # the benchmark's own memory between runs, not the engine

        def timed(fn):
            if a.drop_caches:
                subprocess.run(["sync"])
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            del r
            torch.cuda.empty_cache()
            return dt

        out["shmckpt_load_s"] = timed(lambda: ck.load(step, map_location="cuda:0"))
        out["safetensors_load_file_s"] = timed(lambda: load_file(path, device="cuda:0"))
        out["torch_load_s"] = timed(lambda: torch.load(tpath, map_location="cuda:0"))
        os.remove(tpath)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("what", choices=["stall", "guard", "load"])
    p.add_argument("--size-gib", type=float, default=8)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--mixed", action="store_true", help="mixed dtypes and sizes")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--compute-ms", type=float, default=300)
    p.add_argument("--drop-caches", action="store_true")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    out = {"what": a.what, "device": torch.cuda.get_device_name(0)}
    out.update({"stall": bench_stall, "guard": bench_guard, "load": bench_load}[a.what](a))
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
