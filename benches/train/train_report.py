"""Part of train.py (the training-loop checkpoint benchmark; see its docstring and
README.md): the summary of a run (summarize), results.md (render_md), the output files
(write_outputs: results.json, iters.csv, results.md) and the plot (iters.png)."""

import collections
import csv
import json
import os
import traceback

from peers import log
from train_model import GiB, SYSTEMS, mean, med, pct
from train_systems import MEM_FLOOR


# ----------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------
def summarize(ctx, results):
    # baseline: the main phase's none segments (or, with --rounds 0, the fast phase's)
    base_phase = "main" if any(r["system"] == "none" and r["phase"] == "main" for r in ctx.iters) else "fast"
    base_rows = [r for r in ctx.iters if r["system"] == "none" and r["phase"] == base_phase]
    base_med = med([r["dt"] for r in base_rows])
    base_mean = mean([r["dt"] for r in base_rows])
    iters_by = collections.defaultdict(list)
    for r in ctx.iters:
        iters_by[(r["phase"], r["system"])].append(r)
    segs_by = collections.defaultdict(list)
    for s in ctx.segments:
        segs_by[(s["phase"], s["system"])].append(s)
    base_segs = [s for s in ctx.segments if s["system"] == "none" and s["phase"] == base_phase and s["ok"]]
    base_reserved = med([s.get("gpu_peak_reserved") for s in base_segs])
    base_alloc = med([s.get("gpu_peak_allocated") for s in base_segs])
    first_ckpt_iter = {}
    for c in ctx.ckpts:
        if not c.get("skipped"):
            first_ckpt_iter.setdefault(c["system"], c["global_iter"])
    summary = {}
    for phase in ("main", "fast"):
        rows_out = {}
        ph_base = [r["dt"] for r in iters_by.get((phase, "none"), [])]
        ph_base_mean = mean(ph_base) if ph_base else None
        for name in SYSTEMS:
            rows = iters_by.get((phase, name), [])
            segs = segs_by.get((phase, name), [])
            if not rows and name not in ctx.failed:
                continue
            r = {"system": name}
            if name in ctx.failed:
                r["error"] = ctx.failed[name]["error"]
            if rows:
                dts = [x["dt"] for x in rows]
                r["iters"] = len(dts)
                r["mean_iter_s"] = mean(dts)
                r["median_iter_s"] = med(dts)
                r["p99_iter_s"] = pct(dts, 99)
                if base_mean:
                    r["overhead_pct"] = 100.0 * (r["mean_iter_s"] / base_mean - 1.0)
                if phase != "main" and ph_base_mean:
                    r["overhead_vs_phase_none_pct"] = 100.0 * (r["mean_iter_s"] / ph_base_mean - 1.0)
                # per-segment overhead (vs the mean of all baseline segments): spread across rounds
                r["segment_overhead_pct"] = [100.0 * (s["mean_iter_s"] / base_mean - 1.0) for s in segs if s.get("mean_iter_s") and base_mean]
                r["segment_overhead_pct_median"] = med(r["segment_overhead_pct"])
                # steady state: rounds after the first (the first pays worker spawns, first pinned allocations)
                st_rows = [x for x in rows if x["round"] > 1]
                st_base = [x["dt"] for x in ctx.iters if x["system"] == "none" and x["phase"] == phase and x["round"] > 1]
                if st_rows and base_mean:
                    r["mean_iter_steady_s"] = mean([x["dt"] for x in st_rows])
                    r["overhead_steady_pct"] = 100.0 * (r["mean_iter_steady_s"] / base_mean - 1.0)
                    if st_base:
                        r["overhead_steady_vs_steady_base_pct"] = 100.0 * (r["mean_iter_steady_s"] / mean(st_base) - 1.0)
            ck = [c for c in ctx.ckpts if c["system"] == name and c["phase"] == phase and not c.get("skipped")]
            r["checkpoints_skipped_low_memory"] = sum(1 for c in ctx.ckpts if c["system"] == name and c["phase"] == phase and c.get("skipped"))
            if ck and base_med is not None:
                byg = {x["g"]: x["dt"] for x in rows}
                stalls = []
                for c in ck:
                    g = c["global_iter"]
                    ex = sum(max(0.0, byg.get(g + j, base_med) - base_med) for j in range(3))
                    c["stall_excess_s"] = ex
                    stalls.append(ex)
                steady = [c for c in ck if c["global_iter"] != first_ckpt_iter.get(name)]
                ss = [c["stall_excess_s"] for c in steady] or stalls
                r["checkpoints"] = len(ck)
                r["first_checkpoint_stall_s"] = ck[0]["stall_excess_s"] if ck[0]["global_iter"] == first_ckpt_iter.get(name) else None
                r["stall_max_s"] = max(ss)
                r["stall_median_s"] = med(ss)
                r["call_median_s"] = med([c.get("call_s") for c in steady] or [c.get("call_s") for c in ck])
                dur = [c.get("durable_s") for c in steady if c.get("durable_s") is not None] or [c.get("durable_s") for c in ck if c.get("durable_s") is not None]
                r["durable_median_s"] = med(dur)
                r["durable_max_s"] = max(dur) if dur else None
                r["max_pending_at_call"] = max(c.get("pending_at_call", 0) for c in ck)
            if segs and ctx.cuda:
                pr = med([s.get("gpu_peak_reserved") for s in segs])
                pa = med([s.get("gpu_peak_allocated") for s in segs])
                r["gpu_peak_reserved_bytes"] = pr
                r["gpu_peak_allocated_bytes"] = pa
                r["gpu_peak_reserved_vs_base_bytes"] = (pr - base_reserved) if (pr is not None and base_reserved is not None) else None
                r["gpu_peak_allocated_vs_base_bytes"] = (pa - base_alloc) if (pa is not None and base_alloc is not None) else None
                held = [s.get("gpu_device_used_held_after_durable") for s in segs]
                r["gpu_device_used_held_after_durable_first_bytes"] = held[0]
                r["gpu_device_used_held_after_durable_max_later_bytes"] = max(held[1:]) if len(held) > 1 else None
                r["gpu_reserved_held_after_durable_max_bytes"] = max(s.get("gpu_reserved_held_after_durable") or 0 for s in segs)
            if segs:
                r["host_rss_tree_peak_delta_bytes"] = max(s["host"].get("rss_tree_peak_delta") or 0 for s in segs)
                r["host_rss_tree_peak_bytes"] = max(s["host"].get("rss_tree_peak") or 0 for s in segs)
                r["dev_shm_peak_delta_bytes"] = max(s["host"].get("shm_peak_delta") or 0 for s in segs)
                r["dev_shm_peak_bytes"] = max(s["host"].get("shm_peak") or 0 for s in segs)
                r["host_used_peak_delta_bytes"] = max(s["host"].get("host_used_peak_delta") or 0 for s in segs)
                r["drain_max_s"] = max(s.get("drain_s") or 0 for s in segs)
                r["segments"] = len(segs)
            sysobj = ctx.systems.get(name)
            if sysobj is not None:
                r["api"] = sysobj.api
                r["notes"] = sysobj.notes
                r["setup_s"] = getattr(sysobj, "setup_s", None)
            rows_out[name] = r
        summary[phase] = rows_out
    # the goals, computed from the numbers above (main phase)
    goals = {}
    mainrows = summary.get("main") or {}
    sa, sb = mainrows.get("shm-async") or {}, mainrows.get("shm-block") or {}
    k = results["meta"].get("k")
    if sa.get("mean_iter_s") is not None:
        ov = sa.get("overhead_steady_pct", sa.get("overhead_pct"))
        others = [r.get("overhead_steady_pct", r.get("overhead_pct")) for n, r in mainrows.items() if n not in ("none", "shm-async") and r.get("mean_iter_s") is not None]
        goals["shm_async_overhead_pct"] = ov
        goals["shm_async_overhead_le_1pct"] = ov is not None and ov <= 1.0
        goals["shm_async_lowest_overhead"] = ov is not None and all(o is None or ov <= o for o in others)
        goals["shm_async_gpu_peak_reserved_vs_base_bytes"] = sa.get("gpu_peak_reserved_vs_base_bytes")
    d2h = (results.get("d2h") or {}).get("seconds")
    # The overhead is measured over whole segments (lead iterations and the tail after the
    # last checkpoint included), so the prediction uses the same iterations per checkpoint.
    bsegs = [s for s in results.get("segments") or [] if s.get("system") == "shm-block" and s.get("phase") == "main" and s.get("ok") and s.get("checkpoints")]
    per_ck = (sum(s["n_iters"] for s in bsegs) / sum(s["checkpoints"] for s in bsegs)) if bsegs else k
    if sb.get("mean_iter_s") is not None and d2h and per_ck and base_mean:
        pred = 100.0 * d2h / (per_ck * base_mean)
        goals["shm_block_iters_per_checkpoint"] = per_ck
        meas = sb.get("overhead_steady_pct", sb.get("overhead_pct"))
        goals["shm_block_predicted_overhead_pct"] = pred
        goals["shm_block_measured_overhead_pct"] = meas
        goals["shm_block_within_10pct_of_prediction"] = meas is not None and abs(meas - pred) <= 0.1 * pred
    # issue 13: DCP through shmckpt within 1.10 x shmckpt's native (blocking) Python path
    ds = mainrows.get("dcp-shm") or {}
    if ds.get("mean_iter_s") is not None and sb.get("mean_iter_s") is not None:
        ratios = {}
        for key in ("mean_iter_s", "stall_median_s", "durable_median_s", "host_rss_tree_peak_delta_bytes", "dev_shm_peak_delta_bytes"):
            a, b = ds.get(key), sb.get(key)
            if key.endswith("_bytes") and a is not None and b is not None:
                # Memory peaks below 64 MiB are the sampler's noise (the interpreter's own
                # allocations, log buffers): compared with that floor, not as a ratio of
                # two near-zero numbers.
                a, b = max(a, MEM_FLOOR), max(b, MEM_FLOOR)
            if a is not None and b:
                ratios[key] = a / b
        goals["dcp_shm_over_shm_block"] = ratios
        goals["dcp_shm_within_1_10x_of_native"] = all(v <= 1.10 for v in ratios.values()) if ratios else None
    col = {c["system"]: c for c in results.get("colocated") or [] if c.get("ok")}
    if "shm-async" in col:
        goals["shm_async_colocated_not_returned_bytes"] = col["shm-async"].get("not_returned_bytes")
    summary["goals"] = goals
    summary["baseline_phase"] = base_phase
    summary["baseline_median_iter_s"] = base_med
    summary["baseline_mean_iter_s"] = base_mean
    results["summary"] = summary


def fmt_b(x):
    return "-" if x is None else f"{x / GiB:+.2f}"


def fmt_gb(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def fmt_s(x, p=2):
    return "-" if x is None else f"{x:.{p}f}"


def render_md(results):
    m = results["meta"]
    out = [f"# Training-loop checkpoint benchmark, state {m.get('state')} ({m.get('state_bytes', 0) / GiB:.2f} GiB, {m.get('tensors')} tensors, {m.get('params', 0) / 1e9:.3f} B params)", ""]
    out.append(f"device {m.get('gpu') or m.get('device')}; torch {m.get('versions', {}).get('torch')}; NVRx {m.get('versions', {}).get('nvidia-resiliency-ext')}; shmckpt {m.get('versions', {}).get('shmckpt')}")
    raw = results.get("raw_disk") or {}
    if raw.get("best_gbps"):
        out.append(f"raw disk limit (best of single-stream and {m.get('raw_inflight')}-in-flight O_DIRECT): {raw['best_gbps']:.2f} GB/s ({raw.get('best')}); state / raw = {raw.get('state_write_s', 0):.2f} s")
    s = results.get("summary", {})
    if m.get("shmckpt_open_s") is not None:
        out.append(f"shmckpt start-up, outside the timed loop: Checkpointer({m.get('shmckpt_kwargs')}) {m['shmckpt_open_s']:.2f} s, prepare_cuda {fmt_s(m.get('shmckpt_prepare_cuda_s'))} s")
    out.append(f"baseline iteration: median {fmt_s((s.get('baseline_median_iter_s') or 0) * 1e3, 1)} ms, mean {fmt_s((s.get('baseline_mean_iter_s') or 0) * 1e3, 1)} ms")
    for phase, title in (("main", f"K = {m.get('k')} (disk keeps up)"), ("fast", f"K = {m.get('k_fast')} (disk cannot keep up)")):
        rows = s.get(phase) or {}
        if not rows:
            continue
        out += ["", f"## {title}", ""]
        out.append("| system | mean ms | p99 ms | overhead % (all rounds) | overhead % (rounds 2+) | stall median s | stall max s | first stall s | durable median s | durable max s | max pending | drain s | GPU peak reserved vs base GiB | GPU peak alloc vs base GiB | GPU held after durable GiB (first / later) | host RSS tree peak Δ GiB | /dev/shm peak Δ GiB | host used peak Δ GiB |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            if r.get("mean_iter_s") is None:
                out.append(f"| {name} | FAILED: {r.get('error', '')[:200]} |" + " |" * 16)
                continue
            held = f"{fmt_b(r.get('gpu_device_used_held_after_durable_first_bytes'))} / {fmt_b(r.get('gpu_device_used_held_after_durable_max_later_bytes'))}"
            out.append(
                f"| {name} | {r['mean_iter_s'] * 1e3:.1f} | {r['p99_iter_s'] * 1e3:.1f} | {fmt_s(r.get('overhead_pct'), 1)} | {fmt_s(r.get('overhead_steady_pct'), 1)} | {fmt_s(r.get('stall_median_s'))} | {fmt_s(r.get('stall_max_s'))} | "
                f"{fmt_s(r.get('first_checkpoint_stall_s'))} | {fmt_s(r.get('durable_median_s'))} | {fmt_s(r.get('durable_max_s'))} | {r.get('max_pending_at_call', '-')} | {fmt_s(r.get('drain_max_s'))} | "
                f"{fmt_b(r.get('gpu_peak_reserved_vs_base_bytes'))} | {fmt_b(r.get('gpu_peak_allocated_vs_base_bytes'))} | {held} | {fmt_gb(r.get('host_rss_tree_peak_delta_bytes'))} | "
                f"{fmt_gb(r.get('dev_shm_peak_delta_bytes'))} | {fmt_gb(r.get('host_used_peak_delta_bytes'))} |"
            )
    col = results.get("colocated") or []
    mt = results.get("colocated_main_trainer")
    if mt and mt.get("before_free"):
        out += ["", f"Main trainer (saved by every system) freed before the colocated trials: {fmt_gb(mt.get('freed_by_trainer_bytes'))} GiB freed, "
                f"{fmt_gb(mt.get('device_returned_without_empty_cache_bytes'))} GiB back without empty_cache, {fmt_gb(mt.get('device_returned_after_empty_cache_bytes'))} GiB after "
                f"({fmt_s(mt.get('empty_cache_s'), 3)} s), not returned {fmt_gb(mt.get('not_returned_bytes'))} GiB"]
    if col:
        out += ["", "## Colocated: free weights + grads + optimizer state after a durable save", ""]
        out.append("| system | freed by trainer GiB | device memory back without empty_cache GiB | back after empty_cache GiB | empty_cache s | device used beyond torch reserved GiB | not returned GiB |")
        out.append("|---|---|---|---|---|---|---|")
        for c in col:
            if not c.get("ok"):
                out.append(f"| {c['system']} | FAILED: {(c.get('error') or '')[:200]} | | | | | |")
                continue
            out.append(
                f"| {c['system']} | {fmt_gb(c.get('freed_by_trainer_bytes'))} | {fmt_gb(c.get('device_returned_without_empty_cache_bytes'))} | {fmt_gb(c.get('device_returned_after_empty_cache_bytes'))} | "
                f"{fmt_s(c.get('empty_cache_s'), 3)} | {fmt_gb(c.get('device_used_not_torch_reserved_bytes'))} | {fmt_gb(c.get('not_returned_bytes'))} |"
            )
    cl = results.get("close") or {}
    if cl:
        out += ["", "Device memory given back when each system was closed at the end (mem_get_info): " + ", ".join(f"{k} {fmt_gb(v.get('device_freed_bytes'))} GiB ({fmt_s(v.get('close_s'))} s)" for k, v in cl.items())]
    skipped = results.get("skipped") or []
    if skipped:
        out += ["", "Skipped: " + "; ".join(skipped)]
    if results.get("failed"):
        out += ["", "Failures:"] + [f"- {k}: `{v['error'][:300]}`" for k, v in results["failed"].items()]
    out += ["", "Goals (issue 14): shm-async overhead <= 1 % at the smallest K the disk sustains, lowest of all; 0 bytes extra GPU memory reserved; all memory back in the colocated case. shm-block overhead = (pinned copy of the state) / (K x iteration time) within 10 %."]
    g = s.get("goals") or {}
    if g:
        out.append("Computed from this run (overheads: rounds 2+ when there are any): " + "; ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in g.items()))
    d = results.get("d2h") or {}
    if d.get("seconds"):
        out.append(f"Pinned D2H copy of the state (reference): {d['seconds']:.3f} s, {d['gbps']:.1f} GB/s")
    return "\n".join(out) + "\n"


def write_outputs(ctx, results, final=False):
    try:
        if ctx.iters and ctx.segments:
            summarize(ctx, results)
        results["segments"] = ctx.segments
        results["checkpoints"] = ctx.ckpts
        results["failed"] = ctx.failed
        p = os.path.join(ctx.out_dir, "results.json")
        with open(p + ".tmp", "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(p + ".tmp", p)
        with open(os.path.join(ctx.out_dir, "iters.csv"), "w", newline="") as f:
            if ctx.iters:
                w = csv.DictWriter(f, fieldnames=list(ctx.iters[0].keys()))
                w.writeheader()
                w.writerows(ctx.iters)
        with open(os.path.join(ctx.out_dir, "results.md"), "w") as f:
            f.write(render_md(results))
    except Exception as e:
        log(f"writing results failed: {e!r}\n{traceback.format_exc()}")
    if final:
        plot(ctx.out_dir)


COLORS = {"none": "#444444", "torch": "#d62728", "dcp": "#ff7f0e", "dcp-shm": "#e6ab02", "nvrx": "#9467bd", "nvrx-fswa": "#8c564b", "shm-block": "#1f77b4", "shm-async": "#2ca02c"}


def plot(out_dir):
    """iteration time against global step, one colour per system, checkpoints
    marked; also runnable alone: python3 train.py --plot-only DIR."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        log(f"no matplotlib here ({e!r}); iters.csv + `train.py --plot-only DIR` plot elsewhere")
        return None
    rows = []
    with open(os.path.join(out_dir, "iters.csv")) as f:
        for r in csv.DictReader(f):
            rows.append(r)
    if not rows:
        return None
    with open(os.path.join(out_dir, "results.json")) as f:
        res = json.load(f)
    phases = [p for p in ("main", "fast") if any(r["phase"] == p for r in rows)]
    fig, axes = plt.subplots(len(phases), 1, figsize=(16, 5 * len(phases)), squeeze=False)
    for ax, phase in zip(axes[:, 0], phases):
        seen = set()
        pr = [r for r in rows if r["phase"] == phase]
        segs = collections.OrderedDict()
        for r in pr:
            segs.setdefault((r["system"], r["round"], r["phase"]), []).append(r)
        for (name, _rnd, _ph), rs in segs.items():
            g = [int(r["g"]) for r in rs]
            y = [float(r["dt"]) * 1e3 for r in rs]
            ax.plot(g, y, lw=0.8, color=COLORS.get(name, "k"), label=None if name in seen else name)
            seen.add(name)
            cg = [int(r["g"]) for r in rs if r["ckpt"] == "1"]
            cy = [float(r["dt"]) * 1e3 for r in rs if r["ckpt"] == "1"]
            ax.scatter(cg, cy, marker="v", s=30, color=COLORS.get(name, "k"), zorder=3)
            ax.text(g[0], ax.get_ylim()[1] if False else max(y) * 1.05, name, fontsize=7, color=COLORS.get(name, "k"))
        durable_marked = False
        for c in res.get("checkpoints", []):
            if c.get("phase") == phase and c.get("durable_at_global_iter") is not None:
                # a dot on the x axis where the poll first saw the save durable
                ax.plot([c["global_iter"], c["durable_at_global_iter"]], [0.02, 0.02], transform=ax.get_xaxis_transform(), color=COLORS.get(c["system"], "k"), lw=1.5,
                        label=None if durable_marked else "checkpoint call -> durable")
                ax.plot([c["durable_at_global_iter"]], [0.02], "o", ms=3, transform=ax.get_xaxis_transform(), color=COLORS.get(c["system"], "k"))
                durable_marked = True
        ax.set_yscale("log")
        ax.set_xlabel("global iteration (systems run in turn; triangles = checkpoint iterations)")
        ax.set_ylabel("iteration time, ms (log)")
        m = res.get("meta", {})
        ax.set_title(f"{phase}: state {m.get('state')} {m.get('state_bytes', 0) / GiB:.2f} GiB, K = {m.get('k') if phase == 'main' else m.get('k_fast')}")
        ax.legend(loc="upper right", fontsize=8, ncol=4)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out_dir, "iters.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    log(f"plot: {p}")
    return p
