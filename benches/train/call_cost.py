"""What the ``Checkpointer.save(step, state, blocking=False)`` call itself costs the trainer,
per tensor count (issue 24, item 1: with ``snapshot="device"`` the copy is hidden and the
call is most of what a checkpoint costs).

The state is the training benchmark's (``train_model.flat_state``): a GPT-style decoder's
parameters plus its AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``), one flat dict of
references to the live tensors: ``--states 5g,8g`` gives 688 and 1,168 tensors (14 and 24
layers, as ``drain_probe.py --state 5g`` and ``train.py --state 8g``). The width ``--d``
sets the bytes only (default 64: a small state, the call's cost being per tensor; ``--d
1536`` is the real model). The optimizer is guarded (``Checkpointer.guard``), as in
``drain_probe.py``.

Each timed call is followed by ``opt.step()`` (the guard's hook: on CUDA the stream hold, with
the snapshot request for ``snap``; on the host a wait) and ``handle.wait()`` (the save
committed), so every call starts with nothing in flight. The configurations (state x mode)
take turns call by call, in an order reversed every round, after ``--warmup`` calls each.

Modes (``--modes``): ``nb`` (guarded, ``blocking=False``), ``snap`` (the same with
``snapshot="device"``; CUDA only), ``block`` (``blocking=True``: bytes-bound, for reference).

Prints, per configuration, the call's median, 10th/90th percentiles, min and max (ms), the
median per tensor (us), the median CPU time of the calling thread during the call
(``time.thread_time``: what the call computes, less what it waits for) and the median of
``opt.step()`` (the guard's hook plus AdamW); ``--json`` writes every sample.
``--profile`` runs cProfile over the calls of the first configuration (after the timed ones)
and prints the functions with the most own time. ``--step-int`` adds a plain ``"step": n`` to
the state, set to the call's step before each call (a trainer's counter: a plain value that
changes at every save).

``--capture`` also times, per call, the CPU time of the deferred capture: on the submitting
thread (``Saver._capture_deferred``: the tensors' metadata, the plan's match, the DLPack
capsules and ``Engine.save``), what a GPU trainer's thread loses to it right after the
call; or, for a save started at its call from the last save's plan, its check in the
guard's hook (``Saver._settle``: the same capture, the engine's call replaced by the
commit's confirmation). ``time.thread_time`` on the thread that runs it; the column
``capture ms``: median of the calls that were deferred; ``deferred`` counts them.
``--profile`` with ``--capture`` profiles that capture instead of the call.

    python3 benches/train/call_cost.py --device cuda --states 5g,8g --calls 50
    python3 benches/train/call_cost.py --device cpu --states 5g,8g --calls 50
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "common"))
sys.path.insert(0, _HERE)
from train_model import SIZES, build_model, build_optimizer, flat_state, state_nbytes  # noqa: E402

#: The layer counts of the H200 runs (drain_probe.py's 5g: 688 tensors; train.py's 8g:
#: 1,168 tensors); the width is --d.
STATES = {"5g": dict(SIZES["8g"], layers=14), "8g": dict(SIZES["8g"]), "16g": dict(SIZES["16g"])}
MODES = {"nb": {"blocking": False}, "snap": {"blocking": False, "snapshot": "device"}, "block": {}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", default="cuda", choices=["cuda", "cpu"])
    a("--states", default="5g,8g", help="comma list of " + ",".join(STATES))
    a("--d", type=int, default=64, help="model width (bytes only; 1536 = the real 5g/8g models)")
    a("--vocab", type=int, default=None, help="vocabulary (default: the model's, 32768)")
    a("--modes", default=None, help="comma list of " + ",".join(MODES) + " (default: snap,nb on cuda, nb on cpu)")
    a("--calls", type=int, default=50, help="timed calls per configuration")
    a("--warmup", type=int, default=5, help="untimed calls per configuration first")
    a("--dir", default=None, help="parent of the checkpoint roots (default: a temporary directory)")
    a("--json", default=None, help="write every sample to this file")
    a("--profile", type=int, default=0, help="cProfile this many more calls of the first configuration")
    a("--shmckpt-path", default=None, help="directory prepended to sys.path before `import shmckpt`")
    a("--step-int", action="store_true", help='add "step": n (an int, the call\'s step) to the state')
    a("--capture", action="store_true", help="time the deferred capture on the submitting thread")
    return p.parse_args(argv)


def stats(xs):
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    return dict(median=statistics.median(s), p10=q(0.1), p90=q(0.9), min=s[0], max=s[-1], n=len(s))


class Config:
    """One state (model, guarded optimizer, Checkpointer) and one save mode."""

    def __init__(self, shmckpt, torch, args, state_name, mode, root, shared):
        self.name = f"{state_name}/{mode}"
        self.mode = mode
        self.kw = MODES[mode]
        if state_name not in shared:
            cfg = dict(STATES[state_name], d=args.d, heads=max(1, min(STATES[state_name]["heads"], args.d // 16)))
            if args.vocab:
                cfg["vocab"] = args.vocab
            model = build_model(cfg, args.device, 1234)
            opt, _ = build_optimizer(model, args.device, "auto")
            for p_ in model.parameters():
                p_.grad = torch.zeros_like(p_)
            opt.step()  # the AdamW state exists from here on
            state = flat_state(model, opt)
            nbytes = state_nbytes(state)
            if args.step_int:
                state["step"] = 0
            ck = shmckpt.Checkpointer(
                os.path.join(root, state_name),
                keep_last=1,
                tuning=shmckpt.Tuning(staging_capacity=nbytes + nbytes // 8 + (64 << 20)),
            )
            ck.guard(opt)
            if args.device == "cuda":
                ck.prepare_cuda()
            shared[state_name] = dict(model=model, opt=opt, state=state, ck=ck, bytes=nbytes)
        s = shared[state_name]
        self.opt, self.state, self.ck, self.bytes = s["opt"], s["state"], s["ck"], s["bytes"]
        self.step_int = args.step_int
        self.tensors = len(self.state) - (1 if args.step_int else 0)
        self.calls, self.cpu, self.guard, self.capture = [], [], [], []

    def one(self, step, record=True):
        if self.step_int:
            self.state["step"] = step
        c0 = time.thread_time()
        t0 = time.perf_counter()
        h = self.ck.save(step, self.state, **self.kw)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        self.opt.step()  # the guard's hook (and AdamW)
        t2 = time.perf_counter()
        h.wait()
        if record:
            self.calls.append(t1 - t0)
            self.cpu.append(c1 - c0)
            self.guard.append(t2 - t1)
            if CAPTURED:
                self.capture.append(CAPTURED.pop())
        CAPTURED.clear()


#: The submitting thread's CPU time of each deferred capture (``--capture``).
CAPTURED = []
#: The profiler of the deferred captures (``--capture --profile``), enabled on that thread.
CAPTURE_PROFILE = []


def time_captures(shmckpt):
    """Wrap ``Saver._capture_deferred`` and ``Saver._settle`` (a deferred save's capture,
    or its check when it started at its call) to record the CPU time of the thread running
    them in ``CAPTURED``."""
    saver = shmckpt.checkpointer.save.Saver

    def timer(inner):
        def timed(self, *args):
            prof = CAPTURE_PROFILE[0] if CAPTURE_PROFILE else None
            c0 = time.thread_time()
            if prof is not None:
                prof.enable()
            try:
                return inner(self, *args)
            finally:
                if prof is not None:
                    prof.disable()
                CAPTURED.append(time.thread_time() - c0)

        return timed

    saver._capture_deferred = timer(saver._capture_deferred)
    if hasattr(saver, "_settle"):  # (a version without speculative starts has none)
        saver._settle = timer(saver._settle)


def capture_columns(xs):
    """The ``--capture`` columns: median, p10 and p90 (ms) and the count of deferred calls."""
    if not xs:
        return f" {'-':>10} {'-':>6} {'-':>6} {0:>8}"
    s = stats(xs)
    return f" {s['median'] * 1e3:>10.2f} {s['p10'] * 1e3:>6.2f} {s['p90'] * 1e3:>6.2f} {len(xs):>8}"


def main(argv=None):
    args = parse_args(argv)
    if args.shmckpt_path:
        sys.path.insert(0, args.shmckpt_path)
    import torch
    import shmckpt
    import shmckpt.checkpointer.save

    if args.capture:
        time_captures(shmckpt)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    modes = (args.modes or ("snap,nb" if args.device == "cuda" else "nb")).split(",")
    for m in modes:
        if m not in MODES:
            sys.exit(f"unknown mode {m!r}")
        if m == "snap" and args.device != "cuda":
            sys.exit("mode snap needs --device cuda")
    root = tempfile.mkdtemp(prefix="callcost-", dir=args.dir)
    shared = {}
    try:
        configs = [
            Config(shmckpt, torch, args, s, m, root, shared) for s in args.states.split(",") for m in modes
        ]
        print(
            f"shmckpt {getattr(shmckpt, '__version__', '?')} from {os.path.dirname(shmckpt.__file__)}; "
            f"torch {torch.__version__}; device {args.device}; step int {args.step_int}"
            + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""),
            flush=True,
        )
        for c in configs:
            print(f"  {c.name}: {c.tensors} tensors, {c.bytes / 2**20:.1f} MiB", flush=True)
        step = 0
        for c in configs:
            for _ in range(args.warmup):
                step += 1
                c.one(step, record=False)
        order = list(configs)
        for _ in range(args.calls):
            for c in order:
                step += 1
                c.one(step)
            order.reverse()
        print(
            f"{'config':<12} {'tensors':>7} {'median ms':>10} {'p10':>7} {'p90':>7} {'min':>7} {'max':>7} "
            f"{'us/tensor':>9} {'cpu ms':>7} {'guard ms':>8}"
            + (f" {'capture ms':>10} {'p10':>6} {'p90':>6} {'deferred':>8}" if args.capture else "")
        )
        out = []
        for c in configs:
            s = stats(c.calls)
            g = stats(c.guard)
            cpu = stats(c.cpu)
            print(
                f"{c.name:<12} {c.tensors:>7} {s['median'] * 1e3:>10.2f} {s['p10'] * 1e3:>7.2f} {s['p90'] * 1e3:>7.2f} "
                f"{s['min'] * 1e3:>7.2f} {s['max'] * 1e3:>7.2f} {s['median'] / c.tensors * 1e6:>9.1f} "
                f"{cpu['median'] * 1e3:>7.2f} {g['median'] * 1e3:>8.2f}"
                + (capture_columns(c.capture) if args.capture else "")
            )
            out.append(
                dict(
                    config=c.name,
                    tensors=c.tensors,
                    bytes=c.bytes,
                    call_s=c.calls,
                    call_cpu_s=c.cpu,
                    guard_s=c.guard,
                    capture_cpu_s=c.capture,
                )
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=args.device, d=args.d, step_int=args.step_int, results=out), f)
        if args.profile:
            c = configs[0]
            prof = cProfile.Profile()
            if args.capture:
                CAPTURE_PROFILE.append(prof)
            for _ in range(args.profile):
                step += 1
                if c.step_int:
                    c.state["step"] = step
                if not args.capture:
                    prof.enable()
                h = c.ck.save(step, c.state, **c.kw)
                if not args.capture:
                    prof.disable()
                c.opt.step()
                h.wait()
            CAPTURE_PROFILE.clear()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            print(f"cProfile of {args.profile} calls of {c.name}:\n{buf.getvalue()}")
    finally:
        for s in shared.values():
            s["ck"].close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
