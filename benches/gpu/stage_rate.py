"""Staging rate of shmckpt's save paths against a plain pinned device-to-host copy (issue 24).

One process, one GPU. A state like a trainer's (fp32 weights plus fused-AdamW moments,
``--gib`` GiB in a few hundred tensors) is copied out by, in alternated rounds:

* ``pinned``: ``copy_(non_blocking=True)`` of every tensor into one preallocated pinned
  buffer on the current stream, then ``synchronize`` (the physical limit, same bytes);
* ``block``: ``Checkpointer.save(step, state)`` (returns once staged);
* ``nb_ws_guard``: ``save(..., blocking=False)`` then ``handle.wait_staged()``, with
  ``guard(opt)`` installed (weights and moments are copied by the engine);
* ``nb_ws_noguard``: the same without a guard (every CUDA tensor is captured at the call);
* ``nb_step``: ``save(..., blocking=False)`` then ``opt.step()`` (the guard's pre-hook waits);
* ``nb_busy``: ``save(..., blocking=False)``, then ``--busy-ms`` of matrix products on the
  trainer's stream, then ``opt.step()``: time to staged, and how much longer the products
  took than the same products without a save in flight (``busy_base``).
* ``nb_win`` / ``nb_win_snap`` (not in the default list): ``save(..., blocking=False)``
  (``nb_win_snap``: ``snapshot="device"``), then ``--busy-ms`` of products (the forward and
  backward window), then ``opt.step()`` under the guard; the sample is the device time of
  the step (CUDA events around ``opt.step()`` on the trainer's stream: the guard's wait on
  the copies plus the step's kernels), against ``step_base``, the same step without a save.
  The floor of the default mode is max(0, copy - window); ``nb_win_snap_bytes`` is the
  snapshot's size and ``*_host`` the host time of ``opt.step()`` (the hook). (Their
  "GB/s" and "x pinned" columns mean nothing: the sample is a step time.)

Each save is waited for (durable) before the next variant, so the disk never overlaps a
timed copy. Prints a table of medians (min-max) and writes every sample to ``--out``.

Start-up (``--startup``): ``Checkpointer(tuning=Tuning(staging_capacity=--cap-gb GB))`` construction,
``prepare_cuda``, the time until the staging memory is ready (where the build has
``wait_staging_ready``), and the stall of the first saves, first right after start-up, then
after a pause.

    python3 benches/gpu/stage_rate.py --dir /var/tmp/sr --out $OUT --startup --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def make_state(gib: float, dev: torch.device):
    """Parameters (fp32) with fused AdamW state: 12 bytes per parameter."""
    shapes = [(4608, 1536), (1536, 1536), (6144, 1536), (1536, 6144), (1536,), (1536,)]
    target = int(gib * (1 << 30)) // 12
    params, n, i = [], 0, 0
    while n < target:
        s = shapes[i % len(shapes)]
        k = 1
        for d in s:
            k *= d
        g = torch.Generator(device=dev).manual_seed(i)
        params.append(torch.nn.Parameter(torch.randn(s, device=dev, generator=g)))
        n += k
        i += 1
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    for p in params:
        p.grad.zero_()  # kept: nb_step and nb_busy run opt.step() (the guard's hook)
    torch.cuda.synchronize()
    state = {"model": {f"p{j}": p for j, p in enumerate(params)}, "optim": opt.state_dict()}
    nbytes = sum(p.numel() * 4 * 3 for p in params)
    return params, opt, state, nbytes


def tensors_of(state):
    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return out


def med(xs):
    if not xs:
        return "-"
    return f"{statistics.median(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=5.07)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="pinned,block,nb_ws_guard,nb_ws_noguard,nb_step,nb_busy")
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--startup", action="store_true")
    ap.add_argument("--cap-gb", type=float, default=9.0)
    ap.add_argument("--pause-s", type=float, default=6.0)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    import shmckpt

    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rec = {"argv": sys.argv, "tag": args.tag, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "cpus": os.cpu_count()}
    t = time.perf_counter()
    params, opt, state, nbytes = make_state(args.gib, dev)
    rec["state_bytes"] = nbytes
    rec["tensors"] = len(tensors_of(state))
    log(f"state {nbytes / 2**30:.2f} GiB in {rec['tensors']} tensors ({time.perf_counter() - t:.1f}s)")

    if args.startup:
        su = {}
        new_api = hasattr(shmckpt.Checkpointer, "wait_staging_ready")
        su["background_api"] = new_api
        for phase in ("immediate", "after_ready"):
            root = os.path.join(args.dir, "startup-" + phase)
            os.makedirs(root)
            t0 = time.perf_counter()
            ck = shmckpt.Checkpointer(root, keep_last=1, tuning=shmckpt.Tuning(staging_capacity=int(args.cap_gb * 1e9)))
            su[phase + "_ctor_s"] = time.perf_counter() - t0
            t = time.perf_counter()
            if new_api:
                ck.prepare_cuda(background=True)
            else:
                ck.prepare_cuda()
            su[phase + "_prepare_cuda_s"] = time.perf_counter() - t
            if phase == "after_ready":
                if new_api:
                    ck.wait_staging_ready()
                su[phase + "_ready_s"] = time.perf_counter() - t0
                time.sleep(args.pause_s)
            stalls = []
            for i in range(3):
                t = time.perf_counter()
                h = ck.save(i, state)
                stalls.append(time.perf_counter() - t)
                h.wait()
            su[phase + "_stalls"] = stalls
            t = time.perf_counter()
            ck.close()
            su[phase + "_close_s"] = time.perf_counter() - t
            shutil.rmtree(root)
            log("startup", phase, json.dumps(su))
        rec["startup"] = su

    variants = [v for v in args.variants.split(",") if v]
    root = os.path.join(args.dir, "rate")
    os.makedirs(root)
    ck = shmckpt.Checkpointer(root, keep_last=1, tuning=shmckpt.Tuning(staging_capacity=nbytes + (256 << 20)))
    ck.prepare_cuda()
    if hasattr(ck, "wait_staging_ready"):
        ck.wait_staging_ready()
    srcs = [x.detach().reshape(-1).view(torch.uint8) for x in tensors_of(state)]
    pinned = None
    if "pinned" in variants:
        t = time.perf_counter()
        pinned = torch.empty(sum(s.numel() for s in srcs), dtype=torch.uint8, pin_memory=True)
        rec["pinned_alloc_s"] = time.perf_counter() - t
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy(ms: float) -> float:
        """GPU time (events on the current stream) of ~ms of bf16 products: the engine's
        copies run on its own stream, so a device-wide synchronize would count them."""
        torch.cuda.current_stream().synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = max(1, int(ms / 1.4))  # ~1.4 ms per 8192^3 bf16 product on an H200
        e0.record()
        for _ in range(n):
            torch.mm(a, b)
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3

    small = torch.randn(1 << 16, device=dev)

    def launches(n: int = 3000) -> float:
        """Host seconds to queue and run n small element-wise kernels."""
        torch.cuda.current_stream().synchronize()
        t = time.perf_counter()
        for _ in range(n):
            small.mul_(1.0001)
        torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t

    busy(20)
    launches()
    samples = {v: [] for v in variants}
    extra = {}
    step = 1000
    guarded = False

    def set_guard(on: bool) -> None:
        nonlocal guarded
        if on and not guarded:
            ck.guard(opt)
        if not on and guarded:
            ck.unguard(opt)
        guarded = on

    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            step += 1
            torch.cuda.synchronize()
            h = None
            if v == "pinned":
                t = time.perf_counter()
                o = 0
                for s in srcs:
                    n = s.numel()
                    pinned[o:o + n].copy_(s, non_blocking=True)
                    o += n
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
            elif v == "block":
                set_guard(True)
                t = time.perf_counter()
                h = ck.save(step, state)
                dt = time.perf_counter() - t
                # While the writers drain this save, then once it is durable: host time of
                # a launch-bound loop of small kernels (a short training step's CPU side).
                extra.setdefault("launch_drain", []).append(launches())
                h.wait()
                extra.setdefault("launch_idle", []).append(launches())
            elif v in ("nb_ws_guard", "nb_ws_noguard"):
                set_guard(v == "nb_ws_guard")
                t = time.perf_counter()
                h = ck.save(step, state, blocking=False)
                call = time.perf_counter() - t
                rep = h.wait_staged()
                dt = time.perf_counter() - t
                extra.setdefault(v + "_call", []).append(call)
                if rep:
                    extra.setdefault(v + "_engine_staging", []).append(rep.get("staging"))
            elif v == "nb_step":
                set_guard(True)
                t = time.perf_counter()
                h = ck.save(step, state, blocking=False)
                opt.step()
                extra.setdefault("nb_step_host_returned", []).append(time.perf_counter() - t)
                torch.cuda.current_stream().synchronize()
                dt = time.perf_counter() - t
            elif v in ("nb_win", "nb_win_snap"):
                set_guard(True)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                busy(args.busy_ms)  # untimed: the same window without a save
                e0.record()
                opt.step()
                e1.record()
                e1.synchronize()
                extra.setdefault("step_base", []).append(e0.elapsed_time(e1) / 1e3)
                torch.cuda.synchronize()
                snap = "device" if v == "nb_win_snap" else None
                h = ck.save(step, state, blocking=False, snapshot=snap)
                busy(args.busy_ms)  # the copy runs meanwhile, on the engine's stream
                t = time.perf_counter()
                e0.record()
                opt.step()
                extra.setdefault(v + "_host", []).append(time.perf_counter() - t)
                e1.record()
                e1.synchronize()
                dt = e0.elapsed_time(e1) / 1e3
                if snap:
                    extra.setdefault(v + "_bytes", []).append(h.snapshot_bytes)
            elif v == "nb_busy":
                set_guard(True)
                extra.setdefault("busy_base", []).append(busy(args.busy_ms))
                torch.cuda.synchronize()
                t = time.perf_counter()
                h = ck.save(step, state, blocking=False)
                extra.setdefault("busy_during", []).append(busy(args.busy_ms))
                opt.step()
                dt = time.perf_counter() - t
            else:
                raise SystemExit(f"unknown variant {v}")
            samples[v].append(dt)
            if h is not None:
                w = h.wait()
                extra.setdefault(v + "_durable", []).append(w.get("durable"))
            log(f"round {r} {v}: {dt:.4f}s {nbytes / dt / 1e9:.1f} GB/s")
    set_guard(False)
    ck.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    rec["samples"] = samples
    rec["extra"] = extra
    with open(os.path.join(args.out, f"stage_rate{args.tag}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(f"\n{args.tag} {rec['gpu']} {nbytes / 2**30:.2f} GiB, {rec['tensors']} tensors, {args.rounds} rounds")
    print("variant | median s (min-max) | GB/s at median | x pinned")
    pm = statistics.median(samples["pinned"]) if samples.get("pinned") else None
    for v in variants:
        m = statistics.median(samples[v])
        print(f"{v} | {med(samples[v])} | {nbytes / m / 1e9:.1f} | {m / pm if pm else float('nan'):.2f}")
    for k, xs in extra.items():
        xs = [x for x in xs if x is not None]
        print(f"{k} | {med(xs)}")
    if "startup" in rec:
        print("startup", json.dumps(rec["startup"]))


if __name__ == "__main__":
    main()
