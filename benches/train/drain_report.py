"""Part of drain_probe.py (issue 24: what slows training steps while a save drains): the
analysis of a run's segments and its markdown report. Pure functions of the results dict
drain_probe.py writes (``drain.json``), so a run can be analysed again elsewhere:

    python3 benches/train/drain_probe.py --reanalyze DIR/drain.json --out DIR

Every statistic is of per-step wall times (ms), the first ``meta.skip_first`` steps of
each segment left out. A segment's steps are split at its load's end (``split_ms``, from
the first timed step's start): *during* (the step started before the load ended) and
*after*. Segments without a load (the baseline) are split at the median end of the
``shm`` segments, so their two parts are position-matched controls.
"""

import math
import random

from train_model import med, pct

#: Per-step fields of a segment's ``steps`` rows (drain_probe.py writes them in this order).
STEP_FIELDS = ["start_ms", "wall_ms", "gpu_ms", "launch_ms", "cpu_ms", "nivcsw", "nvcsw"]
PARTS = ("all", "during", "after")
BOOT = 2000


def median_ci(xs, z=1.959964):
    """Distribution-free 95 % CI of the median from order statistics (binomial ranks),
    assuming independent samples: (lo, hi), or None below 6 samples."""
    xs = sorted(x for x in xs if x is not None)
    n = len(xs)
    if n < 6:
        return None
    h = z * math.sqrt(n) / 2.0
    j = max(1, int(math.floor(n / 2.0 - h)))
    k = min(n, int(math.ceil(1 + n / 2.0 + h)))
    return [xs[j - 1], xs[k - 1]]


def boot_median_ci(xs, seed=12345):
    """Percentile-bootstrap 95 % CI of the median of `xs` (one value per segment), or
    None below 2 values."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    rng = random.Random(seed)
    n = len(xs)
    meds = sorted(med([xs[rng.randrange(n)] for _ in range(n)]) for _ in range(BOOT))
    return [meds[int(0.025 * BOOT)], meds[min(BOOT - 1, int(0.975 * BOOT))]]


def _col(rows, field):
    i = STEP_FIELDS.index(field)
    return [r[i] for r in rows if r[i] is not None]


def part_rows(seg, part, skip):
    """The segment's step rows of one part (all / during / after its split)."""
    rows = seg["steps"][skip:]
    if part == "all":
        return rows
    split = seg.get("split_ms")
    if split is None:
        return rows if part == "during" else []
    if part == "during":
        return [r for r in rows if r[0] < split]
    return [r for r in rows if r[0] >= split]


def _ref(base_by_round, rnd, exclude_own):
    """Mean of the baseline values of the rounds next to `rnd` (rnd-1, rnd, rnd+1; the
    own round left out for the baseline's own drift)."""
    vals = [base_by_round[r] for r in (rnd - 1, rnd, rnd + 1) if r in base_by_round and not (exclude_own and r == rnd)]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def summarize(results):
    """Per condition: for all / during / after, the pooled median step with its
    order-statistic CI, p90, the median over segments of (segment median / the adjacent
    rounds' baseline median) with a bootstrap CI over segments, and the GPU, launch and CPU
    times per step against the baseline's; the load's own numbers; PSI and CPU-time
    shares per second of segment. Returns the summary dict (also stored in results)."""
    meta = results["meta"]
    skip = meta.get("skip_first", 0)
    segs = [s for s in results["segments"] if s.get("ok") and not s.get("extra")]
    conds = meta["conditions"]
    shm_ends = [s["load"].get("end_ms") for s in segs if s["cond"] == "shm" and s.get("load")]
    shm_ends = [x for x in shm_ends if x is not None]
    any_ends = [s["load"].get("end_ms") for s in segs if s.get("load") and s["load"].get("end_ms") is not None]
    control_split = med(shm_ends) if shm_ends else med(any_ends)
    for s in segs:
        end = (s.get("load") or {}).get("end_ms")
        s["split_ms"] = end if end is not None else control_split
    # baseline per round and part: segment medians (wall, gpu, launch)
    base = {p: {f: {} for f in ("wall_ms", "gpu_ms", "launch_ms")} for p in PARTS}
    for s in segs:
        if s["cond"] != "baseline":
            continue
        for p in PARTS:
            rows = part_rows(s, p, skip)
            for f in base[p]:
                base[p][f][s["round"]] = med(_col(rows, f))
    out = {"control_split_ms": control_split, "conditions": {}}
    for c in conds:
        mine = [s for s in segs if s["cond"] == c]
        rec = {"segments": len(mine), "rounds": [s["round"] for s in mine]}
        for p in PARTS:
            rows = [r for s in mine for r in part_rows(s, p, skip)]
            walls = _col(rows, "wall_ms")
            per_seg = []
            gpu_r, launch_r = [], []
            for s in mine:
                sr = part_rows(s, p, skip)
                ref = _ref(base[p]["wall_ms"], s["round"], c == "baseline")
                per_seg.append(_ratio(med(_col(sr, "wall_ms")), ref))
                gpu_r.append(_ratio(med(_col(sr, "gpu_ms")), _ref(base[p]["gpu_ms"], s["round"], c == "baseline")))
                launch_r.append(_ratio(med(_col(sr, "launch_ms")), _ref(base[p]["launch_ms"], s["round"], c == "baseline")))
            per_seg_ok = [x for x in per_seg if x is not None]
            nst = len(rows)
            rec[p] = {
                "steps": nst,
                "median_ms": med(walls),
                "ci95_ms": median_ci(walls),
                "p90_ms": pct(walls, 90),
                "ratio": {"median": med(per_seg_ok), "ci95": boot_median_ci(per_seg_ok), "per_segment": per_seg},
                "gpu_ms_median": med(_col(rows, "gpu_ms")),
                "gpu_ratio": med([x for x in gpu_r if x is not None]),
                "launch_ms_median": med(_col(rows, "launch_ms")),
                "launch_ratio": med([x for x in launch_r if x is not None]),
                "cpu_ms_median": med(_col(rows, "cpu_ms")),
                "nivcsw_per_step": (sum(_col(rows, "nivcsw")) / nst) if nst else None,
                "nvcsw_per_step": (sum(_col(rows, "nvcsw")) / nst) if nst else None,
            }
        # drift-free: the steps during the load over those after it, in the same segment
        dva = [_ratio(med(_col(part_rows(s, "during", skip), "wall_ms")), med(_col(part_rows(s, "after", skip), "wall_ms"))) for s in mine]
        dva = [x for x in dva if x is not None]
        rec["during_over_after"] = {"median": med(dva), "ci95": boot_median_ci(dva), "segments": len(dva)}
        loads = [s.get("load") or {} for s in mine]
        ends = [x["end_ms"] for x in loads if x.get("end_ms") is not None]
        rec["load"] = {
            "end_s_median": med(ends) / 1e3 if ends else None,
            "stall_s_median": med([x.get("stall_s") for x in loads]),
            "gbps_median": med([x.get("gbps") for x in loads]),
            "bytes": med([x.get("bytes") for x in loads]),
            "late_ms_p99_median": med([x.get("late_ms_p99") for x in loads]),
        }
        rec["system"] = _system_rates(mine)
        rec["first_steps"] = _first_steps(mine, skip, base["all"])
        out["conditions"][c] = rec
    def above_one(ci):
        return bool(ci) and ci[0] > 1.0

    out["slower"] = [
        c
        for c in conds
        if c != "baseline" and (above_one(out["conditions"][c]["all"]["ratio"]["ci95"]) or above_one(out["conditions"][c]["during"]["ratio"]["ci95"]) or above_one(out["conditions"][c]["during_over_after"]["ci95"]))
    ]
    results["summary"] = out
    return out


def _first_steps(segs, skip, base_all):
    """The cost of a checkpoint that lands on the first ``skip`` steps of its segment (a
    non-blocking save's copy): per segment, the wall and GPU time of those steps over
    ``skip`` x the adjacent rounds' baseline median, and with the call (``stall_s``) added;
    medians with min-max over segments."""
    wall, gpu, total = [], [], []
    for s in segs:
        rows = s["steps"][:skip]
        if len(rows) < skip or not skip:
            continue
        ref_w = _ref(base_all["wall_ms"], s["round"], s["cond"] == "baseline")
        ref_g = _ref(base_all["gpu_ms"], s["round"], s["cond"] == "baseline")
        if ref_w is not None:
            extra = sum(r[1] for r in rows) - skip * ref_w
            wall.append(extra)
            total.append(extra + 1e3 * ((s.get("load") or {}).get("stall_s") or 0.0))
        if ref_g is not None and all(r[2] is not None for r in rows):
            gpu.append(sum(r[2] for r in rows) - skip * ref_g)

    def mm(xs):
        return {"median": med(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None

    return {"extra_wall_ms": mm(wall), "extra_gpu_ms": mm(gpu), "per_checkpoint_ms": mm(total)}


def _system_rates(segs):
    """Medians over segments of PSI stall ms per second, the share of all CPUs' time in
    each /proc/stat state, and this process's threads' CPU seconds per second."""
    psi, share, threads = {}, {}, {}
    for s in segs:
        d = s.get("sys") or {}
        secs = d.get("seconds") or 0
        if secs <= 0:
            continue
        for k, v in (d.get("psi_us") or {}).items():
            psi.setdefault(k[: -len("_us")] if k.endswith("_us") else k, []).append(v / 1e3 / secs)
        st = d.get("cpu_ticks") or {}
        tot = sum(st.values())
        for k, v in st.items():
            if tot:
                share.setdefault(k, []).append(v / tot)
        for k, v in (d.get("threads_cpu_s") or {}).items():
            threads.setdefault(k, []).append(v / secs)
    return {
        "psi_ms_per_s": {k: med(v) for k, v in psi.items()},
        "cpu_share": {k: med(v) for k, v in share.items()},
        "threads_cpu_s_per_s": {k: med(v) for k, v in sorted(threads.items(), key=lambda kv: -max(kv[1]))[:8]},
    }


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _ci(c, fmt="{:.2f}"):
    return "" if not c else " [" + fmt.format(c[0]) + ", " + fmt.format(c[1]) + "]"


def markdown(results):
    """The report: the step table, the system-pressure table and the nvidia-smi captures."""
    m, s = results["meta"], results["summary"]
    L = [
        f"# Steps while a save drains ({m.get('started')}, {m.get('gpu') or 'cpu'})",
        "",
        f"Model {m.get('params', 0) / 1e6:.1f} M parameters, state {m.get('state_bytes', 0) / (1 << 30):.2f} GiB in {m.get('tensors')} tensors, "
        f"batch {m.get('model', {}).get('batch')}, {m.get('seg_iters')} steps per segment ({m.get('skip_first')} left out), "
        f"{m.get('rounds_done')} rounds alternated; checkpoint dir {m.get('ckpt_fs', {}).get('mount')} ({m.get('ckpt_fs', {}).get('fstype')}).",
        "Ratios: per segment, its median over the mean of the baseline medians of the adjacent rounds (same part); "
        "median over segments with a bootstrap 95 % CI over segments; during / after: the two parts of the same segment (no baseline, no drift). Step CI: order statistics over pooled steps "
        "(assumes independent steps: narrower than the truth). Baseline ratio = its drift against its neighbours. "
        f"Baseline during/after split at {_f((s.get('control_split_ms') or 0) / 1e3)} s (median shm drain end).",
        "",
        "| condition | segs | steps | median ms [95 % CI] | p90 ms | x baseline [95 % CI] | during: steps, median ms, x baseline [CI] | after: steps, median ms, x baseline [CI] | during / after, same segment [CI] | GPU ms x base (all / during) | launch ms x base (all / during) | load end s | stall s | load GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, r in s["conditions"].items():
        a, d, af, ld = r["all"], r["during"], r["after"], r["load"]

        def part(p):
            return f"{p['steps']}, {_f(p['median_ms'])}, {_f(p['ratio']['median'], '{:.3f}')}{_ci(p['ratio']['ci95'], '{:.3f}')}"

        L.append(
            f"| {c} | {r['segments']} | {a['steps']} | {_f(a['median_ms'])}{_ci(a['ci95_ms'])} | {_f(a['p90_ms'])} | "
            f"{_f(a['ratio']['median'], '{:.3f}')}{_ci(a['ratio']['ci95'], '{:.3f}')} | {part(d)} | {part(af)} | "
            f"{_f(r['during_over_after']['median'], '{:.3f}')}{_ci(r['during_over_after']['ci95'], '{:.3f}')} | "
            f"{_f(a['gpu_ratio'], '{:.3f}')} / {_f(d['gpu_ratio'], '{:.3f}')} | {_f(a['launch_ratio'], '{:.3f}')} / {_f(d['launch_ratio'], '{:.3f}')} | "
            f"{_f(ld['end_s_median'])} | {_f(ld['stall_s_median'], '{:.3f}')} | {_f(ld['gbps_median'])} |"
        )
    L += ["", "Slower (95 % CI above 1 of the ratio to the baseline, all steps or during the load, or of during / after): " + (", ".join(s["slower"]) or "none"), ""]
    L += [
        f"Cost per checkpoint (ms; medians over segments, min-max): the first {m.get('skip_first')} steps of each segment "
        "(left out above) over the adjacent baseline, wall and GPU time, and wall plus the save call.",
        "",
        "| condition | extra wall, first steps | extra GPU, first steps | call + extra wall |",
        "|---|---|---|---|",
    ]

    def mm(v):
        return "-" if not v else f"{v['median']:.1f} ({v['min']:.1f}..{v['max']:.1f})"

    for c, r in s["conditions"].items():
        fs = r.get("first_steps") or {}
        L.append(f"| {c} | {mm(fs.get('extra_wall_ms'))} | {mm(fs.get('extra_gpu_ms'))} | {mm(fs.get('per_checkpoint_ms'))} |")
    L += [""]
    L += [
        "System pressure per second of segment (medians over segments): PSI stall ms/s, share of all CPUs' time, "
        "and this process's busiest threads (CPU s/s).",
        "",
        "| condition | PSI cpu some | io some | io full | mem some | user | system | iowait | irq | softirq | cs invol./step | cs vol./step | threads CPU s/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, r in s["conditions"].items():
        sy, a = r["system"], r["all"]
        p, sh = sy["psi_ms_per_s"], sy["cpu_share"]
        th = ", ".join(f"{k} {v:.2f}" for k, v in sy["threads_cpu_s_per_s"].items() if v and v >= 0.01)
        L.append(
            f"| {c} | {_f(p.get('cpu_some'))} | {_f(p.get('io_some'))} | {_f(p.get('io_full'))} | {_f(p.get('memory_some'))} | "
            + " | ".join(_f(sh.get(k), "{:.1%}") for k in ("user", "system", "iowait", "irq", "softirq"))
            + f" | {_f(a['nivcsw_per_step'])} | {_f(a['nvcsw_per_step'])} | {th or '-'} |"
        )
    smi = results.get("smi") or {}
    if smi.get("captures"):
        L += ["", f"nvidia-smi ({smi.get('query')}, every 100 ms) in one extra segment each, outside the statistics:", ""]
        L += ["| capture | step median ms | samples | clocks.sm MHz | clocks.mem MHz | power W | temp C |", "|---|---|---|---|---|---|---|"]
        for name, cap in smi["captures"].items():
            for label, key in ((name, "fields"), (f"{name}, during its load", "during_load")):
                vals = cap.get(key) or {}
                if not any(vals.values()):
                    continue
                cells = []
                for fld in ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"):
                    v = vals.get(fld)
                    cells.append("-" if not v else f"{v['median']:.0f} ({v['min']:.0f}-{v['max']:.0f})")
                n = max((v["n"] for v in vals.values() if v), default=0)
                step = _f(cap.get("step_median_ms")) if key == "fields" else ""
                L.append(f"| {label} | {step} | {n} | " + " | ".join(cells) + " |")
    elif smi.get("why"):
        L += ["", f"nvidia-smi: not captured ({smi['why']})."]
    if results.get("skipped"):
        L += ["", "Skipped: " + "; ".join(results["skipped"])]
    if results.get("failed"):
        L += ["", "Failed: " + "; ".join(f"{k}: {v}" for k, v in results["failed"].items())]
    return "\n".join(L) + "\n"
