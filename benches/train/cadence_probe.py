#!/usr/bin/env python3
"""Where a save every step goes when saves come back to back (issue 38, item 2).

``snap_probe.py`` times one guarded save per round, from an idle engine. Saving every
step, each save starts while the previous one may still be copying: this probe runs
blocks of ``--steps`` consecutive steps (the forward and backward a spin kernel of
``--window-ms``, then the fused AdamW step, the trainer's stream synchronized as
``loss.item()`` would), one block per snapshot mode, alternated over ``--rounds``, and
times per step:

- ``call``: the ``save`` call (host), and ``engine``: the engine's ``save`` (inside the
  call, or on the submitting thread when the capture is deferred; mode ``at-call`` turns
  the deferral off, mode ``state-dict`` saves ``model.state_dict()`` and
  ``opt.state_dict()`` made in the call instead of the persistent dict of references,
  mode ``all-queued`` saves through a second checkpointer whose device copies are all
  queued at the save's start, ``Tuning(copy_ahead=0)``, instead of 256 MiB ahead, and
  mode ``alt`` through a checkpointer with the ``Tuning`` fields of ``--alt-tuning``);
- ``hook``: the guard's wait at ``opt.step()`` (host);
- ``step``: the whole step (host, synchronized); mode ``off`` saves nothing (the
  baseline);

and per save, from its report: ``staging`` (until every byte was staged) and
``backpressure`` (the part of it spent waiting for staging chunks or save slots).

    python3 benches/train/cadence_probe.py --state 8g --out $OUT/cprobe      # H200
    python3 benches/train/cadence_probe.py --device cpu --state tiny --steps 4 --rounds 1 --out /tmp/cprobe
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "common"))
sys.path.insert(0, _HERE)
from train_model import SIZES, build_model, build_optimizer, flat_state, spinner, state_nbytes  # noqa: E402


def spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"


class TimedEngine:
    """The Checkpointer's engine with its ``save`` timed per step (everything else passed
    on): on the caller's thread inside the save call, or on the submitting thread for a
    deferred capture (the guard's wait at the optimizer step waits for it)."""

    def __init__(self, engine, times):
        self._engine = engine
        self._times = times

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def save(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self._engine.save(*a, **kw)
        finally:
            self._times[a[0]] = (time.perf_counter() - t) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--state", default="8g", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=12, help="consecutive steps per block")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window-ms", type=float, default=160.0, help="forward+backward (spin kernel)")
    p.add_argument("--launch-bound", action="store_true", help="the forward+backward: tiny ops launched from the trainer's thread for --window-ms (calibrated), not one spin kernel or a sleep")
    p.add_argument(
        "--modes",
        default="off,none,device",
        help="snapshot modes, alternated (off: no save, the baseline; at-call: none, captured at the call;"
        " state-dict: none, the state made by model.state_dict() and opt.state_dict() at each call;"
        " all-queued: none, through a checkpointer with Tuning(copy_ahead=0); alt: none, through a checkpointer with --alt-tuning)",
    )
    p.add_argument("--alt-tuning", default="{}", help='JSON: Tuning fields of mode alt\'s checkpointer, e.g. {"chunk_size": 67108864}')
    p.add_argument("--staging-factor", type=float, default=3.0, help="staging capacity / state bytes")
    p.add_argument("--ck-kw", default="{}", help='JSON: Cadence fields, e.g. {"disk_every": 4}')
    p.add_argument("--dir", default="/var/tmp/cprobe")
    p.add_argument("--out", default=os.environ.get("OUT", "cprobe-out"))
    args = p.parse_args(argv)

    import torch

    import shmckpt

    cuda = args.device == "cuda"
    os.makedirs(args.out, exist_ok=True)
    model = build_model(SIZES[args.state], args.device, 1234)
    opt, _ = build_optimizer(model, args.device, "fused" if cuda else "foreach")
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    opt.step()
    sd = flat_state(model, opt)
    nbytes = state_nbytes(sd)
    print(f"state {nbytes / 2**30:.2f} GiB in {len(sd)} tensors", flush=True)

    spin = spinner(args.device, args.window_ms, args.launch_bound)

    def sync():
        if cuda:
            torch.cuda.current_stream().synchronize()

    modes = args.modes.split(",")
    engine_times = {}  # step -> ms in the engine's save

    def checkpointer(root, **tuning):
        shutil.rmtree(root, ignore_errors=True)
        c = shmckpt.Checkpointer(
            root,
            keep_last=1,
            cadence=shmckpt.Cadence(**{"disk_every": "auto", **json.loads(args.ck_kw)}),
            tuning=shmckpt.Tuning(staging_capacity=int(args.staging_factor * nbytes) + (256 << 20), **tuning),
        )
        if cuda:
            c.prepare_cuda()
        c._shared.engine = TimedEngine(c._shared.engine, engine_times)
        c.guard(opt)
        return c

    # The modes that save through a checkpointer of their own, and its Tuning fields
    # (all-queued: every device copy queued at once).
    own = {"all-queued": {"copy_ahead": 0}, "alt": json.loads(args.alt_tuning)}
    cks = {m: checkpointer(f"{args.dir}-{m}", **own[m]) for m in modes if m in own}
    ck = checkpointer(args.dir)
    rows = {m: [] for m in modes}
    saves = {m: [] for m in modes}
    step = 0
    for rnd in range(args.rounds + 1):  # round 0: warm-up, not kept
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            c = cks.get(mode, ck)
            c.wait()
            sync()
            handles = []
            for _ in range(args.steps):
                step += 1
                t0 = time.perf_counter()
                if mode == "at-call":
                    c._saver.deferrable = None  # the capture at the call (no deferred capture)
                state = sd
                if mode == "state-dict":  # made anew at each save, inside the timed call
                    state = {"model": model.state_dict(), "optim": opt.state_dict()}
                snap = None if mode in ("none", "at-call", "state-dict", *own) else mode
                h = None if mode == "off" else c.save(step, state, blocking=False, snapshot=snap)
                t1 = time.perf_counter()
                spin()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
                sync()
                t4 = time.perf_counter()
                if h is not None:
                    handles.append(h)
                if rnd:
                    saved = h is not None
                    rows[mode].append(dict(
                        call=(t1 - t0) * 1e3 if saved else None,
                        engine=engine_times.pop(step, None) if saved else None,
                        hook=(t3 - t2) * 1e3,
                        step=(t4 - t0) * 1e3,
                    ))
            for h in handles:
                r = h.wait()
                if rnd:
                    t = r.get("timings", r)
                    saves[mode].append(dict(staging=t["staging"] * 1e3, backpressure=t["backpressure"] * 1e3))
        print(f"round {rnd} done", flush=True)
    for c in (ck, *cks.values()):
        c.close()
    for m in ("", *(f"-{m}" for m in cks)):
        shutil.rmtree(args.dir + m, ignore_errors=True)

    dev = torch.cuda.get_device_name() if cuda else "cpu"
    lines = [
        f"# Saves every step, back to back ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {dev})",
        "",
        f"State {nbytes / 2**30:.2f} GiB in {len(sd)} tensors; forward+backward {args.window_ms:.0f} ms ({'launches' if args.launch_bound else 'spin'});"
        f" {args.rounds} rounds x {args.steps} steps per mode; staging {args.staging_factor} x state;"
        f" cadence {args.ck_kw}; alt tuning {args.alt_tuning}; median (min..max), ms.",
        "",
        "| snapshot | call | engine save | hook | step | staging | backpressure |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in modes:
        r, s = rows[m], saves[m]
        lines.append(
            f"| {m} | {spread([x['call'] for x in r])} | {spread([x['engine'] for x in r])} | {spread([x['hook'] for x in r])}"
            f" | {spread([x['step'] for x in r])} | {spread([x['staging'] for x in s])} | {spread([x['backpressure'] for x in s])} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, "cadence_probe.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "cadence_probe.json"), "w") as f:
        json.dump({"rows": rows, "saves": saves, "args": vars(args)}, f)


if __name__ == "__main__":
    main()
