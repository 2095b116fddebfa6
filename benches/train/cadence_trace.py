#!/usr/bin/env python3
"""Where the GPU waits when a save runs beside every step (issue 38, item 2).

``cadence_overhead.py`` measures the overhead; this traces it. The decoder of the sweep
(batch calibrated to ``--step-ms``), its state saved every step through a guarded
``Checkpointer`` (``blocking=False``, no snapshot), traced with ``torch.profiler``
(CUPTI: every kernel and every device-to-host copy of the process, the engine's own
included) for ``--steps`` steps without a save, then as many with one, alternated
``--rounds`` times. Per step, from the trace:

- ``kernels``: first kernel start to last kernel end on the trainer's stream, and the
  idle time inside that span (``idle``; the gaps over 20 us listed with where they fall);
- ``copies``: the device-to-host copies' first start and last end (from the step's
  start), their count and bytes;
- host ranges: the save call, the forward and backward, the guard's wait (inside
  ``opt.step()``), the optimizer step, the synchronize.

The Chrome trace of the last round goes to ``--out``/trace.json (open in Perfetto).

    python3 benches/train/cadence_trace.py --out $OUT/trace      # H200, about 2 minutes
    python3 benches/train/cadence_trace.py --device cpu --state tiny --out /tmp/trace
    python3 benches/train/cadence_trace.py --step-ms 57 --every 4 --snapshot device \
        --call-at end --steps 8 --out $OUT/trace4      # a save every 4 steps of 57 ms

Per position in the save cycle (``--every``), also: the trainer's kernel time (``busy``:
slower kernels) against its idle gaps (a starved queue); the trainer thread's CUDA API
calls (``launches``, their total and longest, on every thread: the backward launches from
autograd's thread; ``launch_thread_ms`` the trainer's thread alone: a driver slowed by the
engine's calls); the
device-to-device copies (the snapshot's: count, bytes, first start and last end from the
step's start).
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
from peers import log  # noqa: E402
from train_model import GiB, MiB, SIZES, cadence_trainer, staging_capacity, state_nbytes  # noqa: E402

RANGES = ("save_call", "fwd_bwd", "guard_wait", "opt_step", "sync")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", default="cuda", choices=["cuda", "cpu"])
    a("--state", default="8g", choices=sorted(SIZES))
    a("--step-ms", type=float, default=186.0)
    a("--steps", type=int, default=4, help="steps per traced block")
    a("--every", type=int, default=1, help="a save every EVERY steps of a saving block (at its first step, then every EVERY)")
    a("--snapshot", default="none", choices=["none", "device"], help='save(snapshot=...) ("device": the guard snapshots what is not copied yet)')
    a("--call-at", default="start", choices=["start", "end"], help="the save's call at the step's start or after its optimizer step (as cadence_overhead.py --call-at)")
    a("--rounds", type=int, default=3)
    a("--tuning", default="{}", help="JSON: Tuning fields over the bench's chunk size and staging")
    a("--dir", default="/var/tmp/cadence-trace")
    a("--out", default=None)
    return p.parse_args(argv)


def spans(trace):
    """Per category of interest, a list of (start_us, end_us, name, extra) from a Chrome trace."""
    out = {"kernel": [], "copy": [], "dtod": [], "range": [], "step": [], "runtime": []}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat, name = ev.get("cat", ""), ev.get("name", "")
        t0 = float(ev["ts"])
        t1 = t0 + float(ev.get("dur", 0))
        args = ev.get("args", {})
        if cat == "kernel":
            out["kernel"].append((t0, t1, name, args.get("stream")))
        elif cat == "gpu_memcpy" and "DtoH" in name:
            out["copy"].append((t0, t1, name, int(args.get("bytes", 0))))
        elif cat == "gpu_memcpy" and "DtoD" in name:
            out["dtod"].append((t0, t1, name, int(args.get("bytes", 0))))
        elif cat in ("cuda_runtime", "cuda_driver"):
            out["runtime"].append((t0, t1, name, ev.get("tid")))
        elif cat == "user_annotation" and name.startswith("step:"):
            out["step"].append((t0, t1, name, ev.get("tid")))
        elif cat == "user_annotation" and name in RANGES:
            out["range"].append((t0, t1, name, None))
    return out


def per_step(sp):
    """One row per traced step (``step:<mode>:<i>`` ranges)."""
    rows = []
    steps = sorted(sp["step"])
    # The trainer's stream: where most kernel time is.
    busy = {}
    for k0, k1, _, s in sp["kernel"]:
        busy[s] = busy.get(s, 0.0) + (k1 - k0)
    main = max(busy, key=busy.get) if busy else None
    tid = steps[0][3] if steps else None
    for i, (s0, s1, name, _) in enumerate(steps):
        end = steps[i + 1][0] if i + 1 < len(steps) else s1 + 1e6
        ks = sorted((k0, k1, n) for k0, k1, n, st in sp["kernel"] if st == main and s0 <= k0 < end)
        row = {"step": name, "host_ms": (s1 - s0) / 1e3}
        # Device time of the trainer's kernels in the step (slower kernels) against its idle
        # gaps (a starved queue), and the trainer's CUDA API calls (a slower driver): its
        # thread's (the forward, the optimizer step) and the others' (the backward runs on
        # autograd's device thread; the engine's own driver calls are not in the trace).
        row["busy_ms"] = sum(k1 - k0 for k0, k1, _ in ks) / 1e3
        rt = [r for r in sp["runtime"] if s0 <= r[0] < s1]
        if rt:
            mine = [r for r in rt if r[3] == tid]
            row.update(
                launches=len(rt),
                launch_ms=sum(r1 - r0 for r0, r1, _, _ in rt) / 1e3,
                launch_max_ms=max(r1 - r0 for r0, r1, _, _ in rt) / 1e3,
                launch_thread_ms=sum(r1 - r0 for r0, r1, _, _ in mine) / 1e3,
            )
        dd = [c for c in sp["dtod"] if s0 <= c[0] < end]
        if dd:
            row.update(dtod=len(dd), dtod_bytes=sum(c[3] for c in dd), dtod_from_ms=(min(c[0] for c in dd) - s0) / 1e3, dtod_to_ms=(max(c[1] for c in dd) - s0) / 1e3, dtod_busy_ms=sum(c[1] - c[0] for c in dd) / 1e3)
        if ks:
            gaps, last = [], ks[0][1]
            for k0, k1, n in ks[1:]:
                if k0 - last > 20:
                    gaps.append({"at_ms": (last - s0) / 1e3, "ms": (k0 - last) / 1e3, "before": n[:60]})
                last = max(last, k1)
            row.update(
                kernels_from_ms=(ks[0][0] - s0) / 1e3,
                kernels_to_ms=(last - s0) / 1e3,
                idle_ms=sum(g["ms"] for g in gaps),
                gaps=sorted(gaps, key=lambda g: -g["ms"])[:8],
            )
        cs = [c for c in sp["copy"] if s0 <= c[0] < end]
        if cs:
            row.update(copies=len(cs), copy_bytes=sum(c[3] for c in cs), copies_from_ms=(min(c[0] for c in cs) - s0) / 1e3, copies_to_ms=(max(c[1] for c in cs) - s0) / 1e3)
        for r0, r1, n, _ in sp["range"]:
            if s0 <= r0 < s1:
                row[f"{n}_ms"] = (r1 - r0) / 1e3
                row[f"{n}_at_ms"] = (r0 - s0) / 1e3
        rows.append(row)
    return rows


def main(argv=None):
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    import shmckpt
    from shmckpt.checkpointer.guard import Guard
    from sweep import calibrate

    args = parse_args(argv)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "trace")
    os.makedirs(out, exist_ok=True)
    cuda = args.device == "cuda"
    tr = cadence_trainer(args.device, args.state, 1234)
    if cuda:
        cal = calibrate(tr, [args.step_ms / 1e3], argparse.Namespace(batches=None, quick=False))
        tr.cfg["batch"] = cal["chosen"][0]["batch"]
    state = tr.build_state()
    nbytes = state_nbytes(state)
    chunk = 8 * MiB if cuda else MiB
    cap = staging_capacity(nbytes, chunk, 3)
    tuning = {"chunk_size": chunk, "staging_capacity": cap, **json.loads(args.tuning)}
    log(f"state {nbytes / GiB:.2f} GiB in {len(state)} tensors, batch {tr.cfg['batch']}, tuning {tuning}")
    root = os.path.join(args.dir, f"run-{os.getpid()}")
    ck = shmckpt.Checkpointer(root, keep_last=2, cadence=shmckpt.Cadence(disk_every="auto"), tuning=shmckpt.Tuning(**tuning))
    wait = Guard.wait

    def timed_wait(self):
        with record_function("guard_wait"):
            return wait(self)

    Guard.wait = timed_wait
    rows, step_no = [], [0]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        if cuda:
            ck.prepare_cuda()
        ck.guard(tr.opt)
        ck.save(0, state).wait()

        kw = {"blocking": False, **({"snapshot": "device"} if args.snapshot == "device" else {})}

        def block(mode, handles):
            for i in range(args.steps):
                saving = mode == "save" and i % args.every == 0

                def call():
                    with record_function("save_call"):
                        step_no[0] += 1
                        handles.append(ck.save(step_no[0], state, **kw))

                with record_function(f"step:{mode}:{i}"):
                    if saving and args.call_at == "start":
                        call()
                    with record_function("fwd_bwd"):
                        tr.fwd_bwd()
                    with record_function("opt_step"):
                        tr.step()
                    if saving and args.call_at == "end":
                        call()
                    with record_function("sync"):
                        tr.sync()
            for h in handles:  # the next block starts with nothing staging
                h.wait_staged()

        for r in range(args.rounds):
            handles = []
            for _ in range(2):
                block("save", handles)  # untraced: the engine in its steady state
                block("none", [])
            for h in handles:
                h.wait()
            handles = []
            with profile(activities=acts) as prof:
                for mode in (("none", "save") if r % 2 == 0 else ("save", "none")):
                    block(mode, handles)
            for h in handles:
                h.wait()
            path = os.path.join(out, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                got = per_step(spans(json.load(f)))
            for row in got:
                row["round"] = r
                log(f"round {r} " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "gaps"}))
                for g in row.get("gaps", [])[:3]:
                    log(f"    gap {g['ms']:.2f} ms at {g['at_ms']:.1f} ms before {g['before']}")
            rows.extend(got)
    finally:
        Guard.wait = wait
        ck.close()
        shutil.rmtree(root, ignore_errors=True)
    summary = {}
    keys = ("host_ms", "busy_ms", "idle_ms", "kernels_to_ms", "copies_to_ms", "launches", "launch_ms", "launch_max_ms", "launch_thread_ms", "dtod", "dtod_bytes", "dtod_from_ms", "dtod_to_ms", "dtod_busy_ms", *(f"{n}_ms" for n in RANGES), *(f"{n}_at_ms" for n in RANGES))
    for mode in ("none", "save"):
        for pos in range(args.every):
            mine = [x for x in rows if x["step"].startswith(f"step:{mode}:") and int(x["step"].rsplit(":", 1)[1]) % args.every == pos]
            summary[f"{mode}@{pos}"] = {k: statistics.median(x[k] for x in mine if k in x) for k in keys if any(k in x for x in mine)}
    res = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv, "batch": tr.cfg["batch"], "tuning": tuning, "every": args.every, "snapshot": args.snapshot, "call_at": args.call_at, "state_bytes": nbytes, "torch": torch.__version__}, "summary": summary, "rows": rows}
    with open(os.path.join(out, "trace_steps.json"), "w") as f:
        json.dump(res, f, indent=1)
    for mode, s in summary.items():
        print(mode, json.dumps({k: round(v, 2) for k, v in s.items()}))
    return res


if __name__ == "__main__":
    main()
