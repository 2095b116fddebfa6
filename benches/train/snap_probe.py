"""Where the time of a guarded non-blocking save goes, per phase (issue 24).

drain_probe.py measures what a checkpoint costs a training loop; this probe splits that
cost into its phases, on the same model and optimizer (train_model, ``--state``), with
the forward and backward replaced by a spin kernel of the same length (``--window-ms``),
so every round has the same device work. Per round, alternated: ``none`` (no save),
``nb`` (``save(blocking=False)`` under the guard) and ``snap`` (the same with
``snapshot="device"``). Timed per round:

- ``call``: the ``save`` call (host);
- ``hook``: the guard's wait at ``opt.step()`` (host), for ``snap`` split into
  ``request`` (asking for the snapshot) and ``hold`` (until the engine queued it and the
  streams wait for it);
- ``step_gpu``: device time from before the spin to after the optimizer step (CUDA
  events), minus the ``none`` rounds' median: what the save added on the device;
- ``next_gpu``: device time of the next spin + step (the next training step), minus
  ``none``'s: what the background copies and the snapshot's free cost the step after.

Also, once: the driver's ``cuMemAlloc``/``cuMemFree`` and stream-ordered pool
alloc/free/trim of the snapshot's size (ctypes on libcuda), to size the allocation's part.

    python3 benches/train/snap_probe.py --state 8g --rounds 7 --out $OUT/snap
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "common"))
sys.path.insert(0, _HERE)
from train_model import SIZES, build_model, build_optimizer, flat_state, spinner, state_nbytes  # noqa: E402


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def spread(xs):
    return f"{med(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})" if xs else "-"


def driver_alloc_times(nbytes, reps=3):
    """ms of cuMemAlloc / cuMemFree and of pool alloc / free / trim of `nbytes`, medians."""
    cu = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_uint64()
    out = {"alloc": [], "free": [], "pool_alloc": [], "pool_free": [], "pool_trim": []}
    for _ in range(reps):
        t = time.perf_counter()
        assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0
        out["alloc"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        assert cu.cuMemFree_v2(ptr) == 0
        out["free"].append((time.perf_counter() - t) * 1e3)

    class Props(ctypes.Structure):
        _fields_ = [("allocType", ctypes.c_int), ("handleTypes", ctypes.c_int), ("locType", ctypes.c_int), ("id", ctypes.c_int), ("win32", ctypes.c_void_p), ("reserved", ctypes.c_ubyte * 64)]

    props = Props(1, 0, 1, 0, None)
    pool, stream = ctypes.c_void_p(), ctypes.c_void_p()
    assert cu.cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(props)) == 0
    assert cu.cuStreamCreate(ctypes.byref(stream), 1) == 0
    for _ in range(reps):
        t = time.perf_counter()
        assert cu.cuMemAllocFromPoolAsync(ctypes.byref(ptr), ctypes.c_size_t(nbytes), pool, stream) == 0
        out["pool_alloc"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        assert cu.cuMemFreeAsync(ptr, stream) == 0
        assert cu.cuStreamSynchronize(stream) == 0
        out["pool_free"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        assert cu.cuMemPoolTrimTo(pool, ctypes.c_size_t(0)) == 0
        out["pool_trim"].append((time.perf_counter() - t) * 1e3)
    cu.cuStreamDestroy_v2(stream)
    cu.cuMemPoolDestroy(pool)
    return {k: med(v) for k, v in out.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state", default="8g", choices=sorted(SIZES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--window-ms", type=float, default=50.0, help="the forward+backward window (spin kernel)")
    p.add_argument("--dir", default="/var/tmp/snapprobe")
    p.add_argument("--out", default=os.environ.get("OUT", "snap-out"))
    args = p.parse_args()

    import torch

    import shmckpt
    from shmckpt import _snapshot

    os.makedirs(args.out, exist_ok=True)
    cfg = SIZES[args.state]
    model = build_model(cfg, "cuda", 1234)
    opt, _ = build_optimizer(model, "cuda", "fused")
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    opt.step()
    sd = flat_state(model, opt)
    nbytes = state_nbytes(sd)
    print(f"state {nbytes / 2**30:.2f} GiB in {len(sd)} tensors", flush=True)

    spin = spinner("cuda", args.window_ms)

    # Time the guard's two calls (request, hold) by wrapping the module's hold.
    phases = {}
    real_hold = _snapshot.hold

    def timed_hold(rust, snapshot, streams):
        t0 = time.perf_counter()
        if snapshot:
            rust.request_snapshot()
        t1 = time.perf_counter()
        rust.hold_streams(list(streams))
        t2 = time.perf_counter()
        phases.update(request=(t1 - t0) * 1e3, hold=(t2 - t1) * 1e3)
        return int(rust.snapshot_bytes()) if snapshot else 0

    _snapshot.hold = timed_hold

    # Time the rest of the guard's wait too: where a hook's time goes besides the hold.
    from shmckpt.checkpointer.base import Shared
    from shmckpt.checkpointer.guard import Guard
    from shmckpt.checkpointer.handle import SaveHandle

    def timed(owner, name):
        real = getattr(owner, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + (time.perf_counter() - t) * 1e3

        setattr(owner, name, wrapper)

    for owner, name in ((SaveHandle, "_poll"), (SaveHandle, "wait_staged"), (SaveHandle, "_get_rust"), (SaveHandle, "done"), (Shared, "reap"), (Guard, "wait")):
        timed(owner, name)
    import shutil

    shutil.rmtree(args.dir, ignore_errors=True)
    ck = shmckpt.Checkpointer(args.dir, keep_last=1, tuning=shmckpt.Tuning(staging_capacity=nbytes + (256 << 20)))
    ck.prepare_cuda()
    ck.guard(opt)
    rows = {m: [] for m in ("none", "nb", "snap")}
    step = 0
    for rnd in range(args.rounds + 1):  # round 0: warm-up, not kept
        for mode in (("none", "nb", "snap") if rnd % 2 == 0 else ("snap", "nb", "none")):
            torch.cuda.synchronize()
            phases.clear()
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            step += 1
            t0 = time.perf_counter()
            h = None
            if mode != "none":
                h = ck.save(step, sd, blocking=False, snapshot="device" if mode == "snap" else None)
            t1 = time.perf_counter()
            in_call = {f"call:{k}": v for k, v in phases.items()}
            phases.clear()
            e[0].record()
            spin()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            in_hook = dict(phases)
            e[1].record()
            spin()
            opt.step()
            e[2].record()
            e[2].synchronize()
            snap_bytes = h.snapshot_bytes if h is not None else 0
            if h is not None:
                h.wait()
            if rnd == 0:
                continue
            rows[mode].append(dict(call=(t1 - t0) * 1e3, hook=(t3 - t2) * 1e3, step_gpu=e[0].elapsed_time(e[1]), next_gpu=e[1].elapsed_time(e[2]), snapshot_bytes=snap_bytes, **in_hook, **in_call))
        print(f"round {rnd} done", flush=True)
    ck.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    base_step = med([r["step_gpu"] for r in rows["none"]])
    base_next = med([r["next_gpu"] for r in rows["none"]])
    snap_size = max((r["snapshot_bytes"] for r in rows["snap"]), default=0)
    drv = driver_alloc_times(snap_size) if snap_size else {}
    lines = [f"# Phases of a guarded save ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {torch.cuda.get_device_name()})", "",
             f"State {nbytes / 2**30:.2f} GiB in {len(sd)} tensors; window {args.window_ms} ms (spin); {args.rounds} rounds alternated; ms, median (min..max).", "",
             "| mode | call | hook (request / hold) | step GPU over none | next step GPU over none | snapshot GB |", "|---|---|---|---|---|---|"]
    detail = []
    for m, rs in rows.items():
        hk = spread([r["hook"] for r in rs])
        if m == "snap":
            hk += f" ({spread([r['request'] for r in rs])} / {spread([r['hold'] for r in rs])})"
        extra = sorted({k for r in rs for k in r} - {"call", "hook", "step_gpu", "next_gpu", "snapshot_bytes"})
        detail.append(f"- {m}: " + ", ".join(f"{k} {spread([r.get(k, 0.0) for r in rs])}" for k in extra))
        lines.append(f"| {m} | {spread([r['call'] for r in rs])} | {hk} | {spread([r['step_gpu'] - base_step for r in rs])} | {spread([r['next_gpu'] - base_next for r in rs])} | {snap_size / 1e9 if m == 'snap' else 0:.2f} |")
    lines += ["", "Host ms inside the hook and the call, per function (median, min..max):", ""] + detail
    lines += ["", f"none: step GPU {base_step:.2f} ms, next {base_next:.2f} ms.", ""]
    if drv:
        lines.append(f"Driver, {snap_size / 1e9:.2f} GB once more (ms, medians of 3): " + ", ".join(f"{k} {v:.2f}" for k, v in drv.items()))
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, "snap.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "snap.json"), "w") as f:
        json.dump(dict(rows=rows, driver=drv, nbytes=nbytes, tensors=len(sd)), f)


if __name__ == "__main__":
    main()
