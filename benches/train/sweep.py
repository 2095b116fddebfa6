#!/usr/bin/env python3
"""Checkpoint-interval sweep (issue 24, item 3): training overhead against the interval
between checkpoints, for every system of train.py, at two step lengths, in ONE run.

The number users compare is **the shortest interval each system sustains at <= 1 %
overhead**. For each step length (by default ~60 ms and ~140 ms, set by the batch size
of one model: the state, and so the bytes each checkpoint moves, is the same for both)
and each interval (geometric, from the disk-bound minimum, state bytes / raw O_DIRECT
write rate measured in this run, to ``--span`` times it), every system runs one segment
(``--lead`` iterations, then 2 checkpoints K steps apart at the short intervals, 1 at the
long ones, each followed by K steps); a ``none`` segment (no checkpoint) opens every
interval's group, and the order of the systems is reversed from one group to the next,
so the baseline's drift is measured in the same run, next to the segments it is compared
with.

Overhead of one checkpoint window (the K iterations from the checkpoint iteration on):
``sum(iteration times) / (K x mean iteration of the group's none segment) - 1``. An
interval is *sustained* by a system when every window of it is at most 1 % and the disk
kept up (every save durable before the window ended). The per-checkpoint cost (window
excess seconds, median over windows where the disk kept up) also gives a fitted
interval at 1 % (cost / 0.01), which is reported beside the measured one.

The iteration loop, the systems and their exact calls are train.py's (``train_run.
run_segment``, ``train_systems``): see README.md. Every system gets one untimed warm-up
save first (worker spawn, CUDA init in workers, first pinned allocation). Outputs in
``--out`` (default $OUT): sweep.json (raw: every iteration, segment, checkpoint, window),
sweep.md (tables), sweep.png (``plot_sweep.py``; without matplotlib, draw it elsewhere
with ``python3 benches/train/plot_sweep.py DIR/sweep.json``), sweep.log.

H200 (one call, <= 9 minutes):
    python3 benches/train/sweep.py --out $OUT --budget-s 480
CPU smoke test (tiny model, CPU tensors, 2 intervals):
    python3 benches/train/sweep.py --quick --out /tmp/sweep-quick
Everything that runs is under the __main__ guard: DCP and NVRx spawn processes that
re-import this file.
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import traceback

if os.environ.get("TRAINBENCH_CPU_SMOKE") == "1":  # --quick: NVRx syncs CUDA in workers
    try:
        import torch as _t

        _t.cuda.synchronize = lambda *a, **k: None
    except Exception:  # pragma: no cover
        pass

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "common"))
sys.path.insert(0, _HERE)
from peers import elapsed, free_port, fs_type_of, log, now, pkg_version, raise_nofile, set_log_file  # noqa: E402
from train_measure import raw_write  # noqa: E402
from train_model import GiB, MiB, SYSTEMS, Trainer, mean, med, state_nbytes, time_steps  # noqa: E402
from train_run import Ctx, run_segment  # noqa: E402
from train_systems import SYSTEM_CLASSES  # noqa: E402

#: The sweep's model: d 1024, 12 layers, 0.186 B parameters, 2.08 GiB of fp32 weights +
#: AdamW moments (12 bytes per parameter); its batch sets the step length.
SWEEP_MODEL = dict(d=1024, layers=12, heads=16, vocab=32768, seq=1024, batch=4)
QUICK_MODEL = dict(d=64, layers=2, heads=2, vocab=512, seq=64, batch=2)
DEFAULT_SYSTEMS = ["none", "torch", "dcp", "dcp-shm", "nvrx", "shm-block", "shm-async"]
TARGET_PCT = 1.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--quick", action="store_true", help="CPU smoke test: tiny model, CPU tensors, 2 intervals, short segments")
    a("--systems", default=None, help="comma list of " + ",".join(SYSTEMS) + ",shm-snap (default " + ",".join(DEFAULT_SYSTEMS) + "; none is always run)")
    a("--steps-ms", default="60,140", help="target step lengths, ms (set by the batch size)")
    a("--batches", default=None, help="batch size per step length instead of calibrating (comma list)")
    a("--layers", type=int, default=None, help="override the model's layer count (state size)")
    a("--d", type=int, default=None, help="override the model width (state size)")
    a("--intervals", type=int, default=5, help="intervals per step length (geometric from the disk-bound minimum)")
    a("--span", type=float, default=10.0, help="largest interval / disk-bound minimum")
    a("--min-factor", type=float, default=1.0, help="smallest interval / disk-bound minimum")
    a("--two-ckpt-below", type=float, default=3.5, help="intervals up to this many disk-bound minima get 2 checkpoints per segment, longer ones 1")
    a("--none-s", type=float, default=2.5, help="length of each none segment, s (at least the group's K, capped by this)")
    a("--lead", type=int, default=3, help="iterations before the first checkpoint of a segment")
    a("--dir", default="/var/tmp/sweepbench", help="checkpoint directory on the real disk (cleared at start and end)")
    a("--out", default=None, help="results directory (default $OUT, else ./sweep-out)")
    a("--budget-s", type=float, default=480, help="wall-clock budget of the whole run; segments whose estimate would end past their step length's share are skipped (recorded)")
    a("--keep-last", type=int, default=1)
    a("--threads", type=int, default=4)
    a("--timeout", type=float, default=120)
    a("--host-mem-gib", type=float, default=120)
    a("--dcp-state", default="nested", choices=["nested", "flat"])
    a("--dcp-plan-caching", default="on", choices=["on", "off"])
    a("--shm-staging-bytes", type=int, default=0)
    a("--shmckpt-path", default=None, help="directory prepended to sys.path before `import shmckpt`")
    a("--seed", type=int, default=1234)
    a("--fused", default="auto", choices=["auto", "fused", "foreach", "single"])
    args = p.parse_args(argv)
    args.device = "cpu" if args.quick else "cuda"
    if args.systems is None:
        args.systems = ",".join(DEFAULT_SYSTEMS if not args.quick else [s for s in DEFAULT_SYSTEMS if s != "nvrx"])
    if args.quick:
        args.intervals = min(args.intervals, 2)
        args.span = min(args.span, 3.0)
        args.none_s = min(args.none_s, 0.5)
        args.budget_s = min(args.budget_s, 240)
    return args


class NoSampler:
    """run_segment's host-memory sampler, replaced by nothing: no thread takes the GIL
    every 100 ms in the sweep's segments (train.py's sampler ran in every segment alike)."""

    def mark(self):
        pass

    def window(self):
        return {}


def geometric(lo, hi, n):
    if n <= 1:
        return [lo]
    r = (hi / lo) ** (1.0 / (n - 1))
    return [lo * r**i for i in range(n)]


def interval_ks(i_min_s, step_s, args):
    """Distinct K (steps) for the intervals, ascending."""
    ks = []
    for f in geometric(args.min_factor, args.span, args.intervals):
        k = max(2, int(round(f * i_min_s / step_s)))
        if ks and k <= ks[-1]:
            k = ks[-1] + 1
        ks.append(k)
    return ks


def interleaved(n):
    """Interval indices in run order: the extremes first, so a budget cut drops middle
    intervals (0, n-1, 1, n-2, ...)."""
    out, lo, hi = [], 0, n - 1
    while lo <= hi:
        out.append(lo)
        if hi != lo:
            out.append(hi)
        lo, hi = lo + 1, hi - 1
    return out


def calibrate(tr, targets_s, args):
    """Batch per target step length: step time measured at two batch sizes, a line
    through them, then each chosen batch measured (median of 10)."""
    cal = {"points": []}
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    else:
        pts = []
        for b in (4, 12) if not args.quick else (1, 4):
            tr.cfg["batch"] = b
            time_steps(tr, 3)
            m = med(time_steps(tr, 8))
            pts.append((b, m))
            cal["points"].append({"batch": b, "median_step_s": m})
            log(f"  calibration: batch {b}: {m * 1e3:.1f} ms")
        (b0, t0), (b1, t1) = pts
        slope = max((t1 - t0) / (b1 - b0), 1e-6)
        batches = [max(1, int(round(b0 + (t - t0) / slope))) for t in targets_s]
        if args.quick:
            batches = [1, 4][: len(targets_s)]
    out = []
    for tgt, b in zip(targets_s, batches):
        tr.cfg["batch"] = b
        time_steps(tr, 3)
        m = med(time_steps(tr, 10))
        out.append({"target_s": tgt, "batch": b, "step_s": m})
        log(f"  step length {tgt * 1e3:.0f} ms target: batch {b}, measured {m * 1e3:.1f} ms")
    cal["chosen"] = out
    return cal


def windows_of(ctx, seg, base_mean):
    """One record per checkpoint window of a segment (K iterations from the checkpoint's)."""
    if not seg or not seg.get("ok") or seg["checkpoints"] == 0 or not base_mean:
        return []
    g0, k, lead = seg["first_global_iter"], seg["k"], seg["lead"]
    rows = [r for r in ctx.iters if g0 <= r["g"] <= seg["last_global_iter"]]
    recs = {r["seg_iter"]: r for r in ctx.ckpts if r.get("global_iter", -1) >= g0 and r.get("global_iter", -1) <= seg["last_global_iter"] and r["system"] == seg["system"]}
    out = []
    for j in range(seg["checkpoints"]):
        c = lead - 1 + j * k
        w = [r["dt"] for r in rows if c <= r["i"] < c + k]
        rec = recs.get(c, {})
        wall = sum(w)
        dur = rec.get("durable_s")
        out.append(
            {
                "system": seg["system"],
                "step_ms": seg["step_ms"],
                "k": k,
                "interval_s": k * base_mean,
                "window": j,
                "n": len(w),
                "wall_s": wall,
                "base_mean_s": base_mean,
                "excess_s": wall - len(w) * base_mean,
                "overhead_pct": 100.0 * (wall / (len(w) * base_mean) - 1.0) if w else None,
                "call_s": rec.get("call_s"),
                "durable_s": dur,
                "pending_at_call": rec.get("pending_at_call"),
                "skipped": rec.get("skipped"),
                # the disk kept up: durable before the window ended (poll resolution: one
                # iteration) and nothing pending at the call
                "kept_up": dur is not None and dur <= wall + base_mean and not rec.get("pending_at_call"),
            }
        )
    return out


def summarize(results):
    """Per step length and system: overhead per interval (median, min, max over windows),
    the shortest measured interval at <= 1 % with the disk keeping up, the fitted one, and
    the none segments' drift."""
    summ = {}
    for L in results["step_lengths"]:
        sm = L["step_ms"]
        ws = [w for w in results["windows"] if w["step_ms"] == sm]
        nones = [s for s in results["segments"] if s.get("step_ms") == sm and s["system"] == "none" and s.get("ok") and s.get("mean_iter_s")]
        pooled = mean([s["mean_iter_s"] for s in nones])
        drift = [100.0 * (s["mean_iter_s"] / pooled - 1.0) for s in nones] if pooled else []
        per = {"none_drift_pct": {"values": drift, "min": min(drift) if drift else None, "max": max(drift) if drift else None}, "systems": {}}
        for name in results["meta"]["systems"]:
            if name == "none":
                continue
            mine = [w for w in ws if w["system"] == name and w["overhead_pct"] is not None]
            rows = []
            for k in sorted({w["k"] for w in mine}):
                kw = [w for w in mine if w["k"] == k]
                ov = [w["overhead_pct"] for w in kw]
                rows.append(
                    {
                        "k": k,
                        "interval_s": med([w["interval_s"] for w in kw]),
                        "windows": len(kw),
                        "overhead_pct_median": med(ov),
                        "overhead_pct_min": min(ov),
                        "overhead_pct_max": max(ov),
                        "kept_up": all(w["kept_up"] for w in kw),
                        "sustained": all(w["kept_up"] for w in kw) and max(ov) <= TARGET_PCT,
                    }
                )
            # Only a sustained interval whose longer neighbours are sustained too counts as
            # "shortest" (a lucky window among failing ones is not a sustained rate).
            for i, r in enumerate(rows):
                if all(x["sustained"] for x in rows[i:]):
                    shortest = r
                    break
            else:
                shortest = None
            costs = [w["excess_s"] for w in mine if w["kept_up"]]
            cost = med(costs)
            per["systems"][name] = {
                "intervals": rows,
                "shortest_sustained": shortest,
                "cost_per_checkpoint_s": {"median": cost, "min": min(costs) if costs else None, "max": max(costs) if costs else None, "windows": len(costs)},
                "fitted_interval_at_1pct_s": (max(cost, 0.0) / (TARGET_PCT / 100.0)) if cost is not None else None,
                "failed": results["failed"].get(name, {}).get("error"),
                # shm-snap: the device snapshot's size per save (its peak extra device memory)
                "snapshot_bytes_max": max(
                    [r["report"].get("snapshot_bytes") or 0 for r in results.get("checkpoints", []) if r.get("system") == name and isinstance(r.get("report"), dict)],
                    default=None,
                ),
            }
        summ[str(sm)] = per
    return summ


def fmt_pct(x):
    return "-" if x is None else f"{x:+.2f} %"


def write_outputs(ctx, results, out_dir):
    results["segments"] = ctx.segments
    results["checkpoints"] = [{k: v for k, v in r.items() if k != "report" or isinstance(v, (dict, str))} for r in ctx.ckpts]
    results["iters"] = ctx.iters
    results["failed"] = ctx.failed
    results["summary"] = summarize(results)
    with open(os.path.join(out_dir, "sweep.json.tmp"), "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(os.path.join(out_dir, "sweep.json.tmp"), os.path.join(out_dir, "sweep.json"))
    m = results["meta"]
    lines = [
        f"# Checkpoint-interval sweep ({m.get('started')}, {m.get('gpu') or 'cpu'})",
        "",
        f"State {m.get('state_bytes', 0) / GiB:.2f} GiB in {m.get('tensors')} tensors; raw disk {results.get('raw_disk', {}).get('gbps', 0):.2f} GB/s, "
        f"disk-bound minimum interval {results.get('i_min_s', 0):.2f} s. Overhead = window time over K x the group's none mean; "
        "sustained = every window <= 1 % and durable before the window ended.",
        "",
    ]
    for sm, per in results["summary"].items():
        d = per["none_drift_pct"]
        lines += [f"## Step ~{sm} ms", "", f"none drift (segment mean vs pooled none mean): {fmt_pct(d['min'])} .. {fmt_pct(d['max'])}", ""]
        lines += ["| system | shortest sustained interval (measured) | fitted at 1 % | cost / checkpoint (median, min-max) | " + " | ".join(f"K={r}" for r in sorted({x['k'] for s in per['systems'].values() for x in s['intervals']})) + " |"]
        ks = sorted({x["k"] for s in per["systems"].values() for x in s["intervals"]})
        lines += ["|---|---|---|---|" + "---|" * len(ks)]
        for name, s in per["systems"].items():
            sh = s["shortest_sustained"]
            shs = f"{sh['interval_s']:.2f} s (K={sh['k']}; {sh['overhead_pct_min']:+.2f}..{sh['overhead_pct_max']:+.2f} %)" if sh else ("failed: " + s["failed"] if s["failed"] else "not at any interval run")
            c = s["cost_per_checkpoint_s"]
            cs = f"{c['median'] * 1e3:.0f} ms ({c['min'] * 1e3:.0f}..{c['max'] * 1e3:.0f}, n={c['windows']})" if c["median"] is not None else "-"
            fit = f"{s['fitted_interval_at_1pct_s']:.1f} s" if s["fitted_interval_at_1pct_s"] is not None else "-"
            cells = []
            byk = {x["k"]: x for x in s["intervals"]}
            for k in ks:
                x = byk.get(k)
                cells.append("-" if x is None else f"{x['overhead_pct_median']:+.2f} % [{x['overhead_pct_min']:+.1f}, {x['overhead_pct_max']:+.1f}]" + ("" if x["kept_up"] else " (disk behind)"))
            label = name
            if s.get("snapshot_bytes_max"):
                label += f" (snapshot up to {s['snapshot_bytes_max'] / GiB:.2f} GiB)"
            lines.append(f"| {label} | {shs} | {fit} | {cs} | " + " | ".join(cells) + " |")
        lines.append("")
    if results.get("skipped"):
        lines += ["Skipped (budget): " + "; ".join(results["skipped"]), ""]
    with open(os.path.join(out_dir, "sweep.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    args = parse_args(argv)
    out_dir = args.out or os.environ.get("OUT") or "./sweep-out"
    os.makedirs(out_dir, exist_ok=True)
    set_log_file(open(os.path.join(out_dir, "sweep.log"), "a"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.quick:
        os.environ["TRAINBENCH_CPU_SMOKE"] = "1"
    if args.shmckpt_path:
        sys.path.insert(0, os.path.abspath(args.shmckpt_path))
    t_start = now()
    log(f"sweep start argv={sys.argv[1:]} out={out_dir}")
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if not cuda:
        torch.cuda.synchronize = lambda *a, **k: None
    elif not torch.cuda.is_available():
        log("CUDA is not available; use --quick for the CPU smoke test")
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEM_CLASSES:
            log(f"unknown system {s!r}")
            return 2
    if "none" not in systems:
        systems.insert(0, "none")
    ctx = Ctx(args, out_dir)
    ctx.base_ckpts = 1
    shutil.rmtree(ctx.ckpt_dir, ignore_errors=True)
    os.makedirs(ctx.ckpt_dir, exist_ok=True)
    results = {"meta": {}, "skipped": [], "windows": [], "step_lengths": []}
    m = results["meta"]
    m.update(started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), argv=sys.argv[1:], device=args.device, systems=systems, target_pct=TARGET_PCT)
    m["nofile"] = raise_nofile()
    try:
        import shmckpt

        shm_ver = getattr(shmckpt, "__version__", "unknown") + f" ({getattr(shmckpt, '__file__', '?')})"
    except Exception as e:
        shm_ver = f"import failed: {type(e).__name__}: {e}"
        ctx.shm_error = shm_ver
        for s in ("shm-block", "shm-async", "shm-snap", "dcp-shm"):
            ctx.failed[s] = {"error": f"import shmckpt: {type(e).__name__}: {e}"}
    m["versions"] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "nvidia-resiliency-ext": pkg_version("nvidia-resiliency-ext"), "shmckpt": shm_ver}
    m["host"], m["cpus"] = platform.node(), os.cpu_count()
    m["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    m["ckpt_fs"] = fs_type_of(ctx.ckpt_dir)
    log(f"versions {m['versions']}; ckpt dir {ctx.ckpt_dir} on {m['ckpt_fs']}")
    if any(s in ("dcp", "dcp-shm", "nvrx", "nvrx-fswa") for s in systems) and not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True

    cfg = dict(QUICK_MODEL if args.quick else SWEEP_MODEL)
    if args.layers:
        cfg["layers"] = args.layers
    if args.d:
        cfg["d"] = args.d
    t = now()
    tr = Trainer(cfg, args.device, args.fused, args.seed)
    time_steps(tr, 3)
    state = tr.build_state()
    m["model"], m["params"], m["optimizer"] = dict(cfg), tr.params(), tr.opt_mode
    m["state_bytes"] = ctx.state_bytes = state_nbytes(state)
    m["tensors"] = len(state)
    log(f"model {cfg}: {m['params'] / 1e9:.3f} B params, state {m['state_bytes'] / GiB:.2f} GiB in {m['tensors']} tensors ({now() - t:.1f}s)")
    if any(s.startswith("shm-") for s in systems) and ctx.shm_error is None:
        try:
            ctx.get_shm().guard(tr.opt)
            m["shmckpt_open_s"] = ctx.shm.open_s
            if cuda:
                t = now()
                ctx.shm.ck.prepare_cuda()
                m["shmckpt_prepare_cuda_s"] = now() - t
        except Exception as e:
            for s in ("shm-block", "shm-async", "shm-snap"):
                ctx.failed[s] = {"error": f"Checkpointer/guard: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"shmckpt unavailable: {e!r}")

    targets = [float(x) / 1e3 for x in args.steps_ms.split(",")]
    results["calibration"] = calibrate(tr, targets, args)

    rp = os.path.join(ctx.ckpt_dir, "raw-write.bin")
    try:
        rd = raw_write(rp, m["state_bytes"], 16, 8 * MiB)
    except Exception as e:
        rd = {"error": repr(e)}
    results["raw_disk"] = rd
    i_min = m["state_bytes"] / (rd["gbps"] * 1e9) if rd.get("gbps") else 1.0
    results["i_min_s"] = i_min
    log(f"raw disk {rd.get('gbps', 0):.2f} GB/s (O_DIRECT, 16 x 8 MiB in flight): disk-bound minimum interval {i_min:.2f} s")
    write_outputs(ctx, results, out_dir)

    # one untimed save per system: worker spawn, CUDA in workers, first allocations
    tr.cfg["batch"] = results["calibration"]["chosen"][0]["batch"]
    for name in systems:
        if name == "none":
            continue
        seg = run_segment(ctx, tr, NoSampler(), name, "warmup", 0, 2, 1, 2)
        if seg:
            seg.update(step_ms=None, lead=2)
    write_outputs(ctx, results, out_dir)

    # per-system time estimate beyond the iterations: measured per checkpoint, else a prior
    extra = {}

    def est(name, k, nck, step_s, none_k):
        if name == "none":
            return (args.lead + none_k) * step_s + 0.2
        prior = {"torch": 2.5 * i_min + 0.5, "dcp": 1.0 * i_min + 0.5}.get(name, 0.3 * i_min + 0.2)
        return (args.lead + nck * k) * step_s + nck * extra.get(name, prior) + 0.3

    n_lengths = len(results["calibration"]["chosen"])
    for li, ch in enumerate(results["calibration"]["chosen"]):
        step_ms = int(round(ch["target_s"] * 1e3))
        tr.cfg["batch"] = ch["batch"]
        time_steps(tr, 3)
        step_s = ch["step_s"]
        ks = interval_ks(i_min, step_s, args)
        L = {"step_ms": step_ms, "batch": ch["batch"], "calibrated_step_s": step_s, "ks": ks, "intervals_s": [k * step_s for k in ks]}
        results["step_lengths"].append(L)
        # this step length's share of what is left of the budget
        deadline = now() + (args.budget_s - (now() - t_start)) / (n_lengths - li)
        log(f"== step ~{step_ms} ms (batch {ch['batch']}, {step_s * 1e3:.1f} ms): K = {ks} ({', '.join(f'{k * step_s:.2f}' for k in ks)} s); until +{deadline - t_start:.0f}s")
        order = [s for s in systems if s != "none"]
        plan_s = 0.0
        for k in ks:
            nck = 2 if k * step_s / i_min <= args.two_ckpt_below else 1
            nk = max(2, min(k, int(args.none_s / step_s)))
            plan_s += sum(est(n, k, nck, step_s, nk) for n in ["none"] + order if n not in ctx.failed)
        L["planned_s"] = plan_s
        log(f"  planned {plan_s:.0f}s of segments (estimates) for {deadline - now():.0f}s of budget")
        for gi, ii in enumerate(interleaved(len(ks))):
            k = ks[ii]
            f = k * step_s / i_min
            nck = 2 if f <= args.two_ckpt_below else 1
            none_k = max(2, min(k, int(args.none_s / step_s)))
            group = ["none"] + (order if gi % 2 == 0 else order[::-1])
            log(f"  -- K = {k} ({k * step_s:.2f} s, {f:.1f} x the disk-bound minimum), {nck} checkpoint(s) per segment, order {group}")
            base_mean = None
            for name in group:
                if name in ctx.failed:
                    continue
                e = est(name, k, nck, step_s, none_k)
                if now() + e > deadline:
                    results["skipped"].append(f"{step_ms} ms K={k} {name} (estimate {e:.1f}s)")
                    log(f"    {name}: skipped (estimate {e:.1f}s past the step length's budget)")
                    continue
                if name == "none":
                    seg = run_segment(ctx, tr, NoSampler(), "none", f"sweep-{step_ms}", gi, none_k, 0, args.lead)
                else:
                    seg = run_segment(ctx, tr, NoSampler(), name, f"sweep-{step_ms}", gi, k, nck, args.lead)
                if not seg:
                    continue
                seg.update(step_ms=step_ms, lead=args.lead, interval_index=ii)
                if name == "none" and seg.get("ok"):
                    base_mean = seg["mean_iter_s"]
                    seg["none_k"] = none_k
                    continue
                if base_mean is None:  # the group's none was skipped: the nearest earlier one
                    prev = [s for s in ctx.segments if s["system"] == "none" and s.get("step_ms") == step_ms and s.get("ok")]
                    base_mean = prev[-1]["mean_iter_s"] if prev else None
                ws = windows_of(ctx, seg, base_mean)
                results["windows"].extend(ws)
                if seg.get("ok") and seg["checkpoints"]:
                    per = (seg["wall_s"] - seg["n_iters"] * (base_mean or step_s)) / seg["checkpoints"]
                    extra[name] = max(per, 0.0)
                if ws:
                    log("    windows: " + ", ".join(f"{w['overhead_pct']:+.2f} %" + ("" if w["kept_up"] else " (behind)") for w in ws))
                write_outputs(ctx, results, out_dir)
            gc.collect()

    log("closing systems")
    for name, s in list(ctx.systems.items()):
        try:
            s.release_refs()
            s.close()
        except Exception as e:
            log(f"  {name}: close: {e!r}")
    if ctx.shm is not None:
        try:
            ctx.shm.close()
        except Exception as e:
            log(f"  shmckpt close: {e!r}")
    m["wall_s"] = now() - t_start
    write_outputs(ctx, results, out_dir)
    shutil.rmtree(ctx.ckpt_dir, ignore_errors=True)
    for sm, per in results["summary"].items():
        for name, s in per["systems"].items():
            sh = s["shortest_sustained"]
            log(f"  {sm} ms {name:10s} shortest sustained: " + (f"{sh['interval_s']:.2f} s (K={sh['k']})" if sh else "none measured") + (f", fitted {s['fitted_interval_at_1pct_s']:.1f} s" if s["fitted_interval_at_1pct_s"] is not None else ""))
    try:
        import plot_sweep

        plot_sweep.plot(os.path.join(out_dir, "sweep.json"), os.path.join(out_dir, "sweep.png"))
        log(f"plot: {os.path.join(out_dir, 'sweep.png')}")
    except ImportError as e:
        log(f"no plot here ({e}); draw it with: python3 benches/train/plot_sweep.py {os.path.join(out_dir, 'sweep.json')}")
    log(f"done in {m['wall_s']:.0f}s ({elapsed():.0f}s since import)")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
