"""Part of repl_overhead.py (issue 25: what replication costs a training loop): the
analysis of a run's segments and its markdown report. Pure functions of the results dict
repl_overhead.py writes (``repl.json``), so a run can be analysed again elsewhere:

    python3 benches/replicas/repl_overhead.py --reanalyze DIR/repl.json --out DIR

The step statistics (median step, CI, ratios to the baseline of the adjacent rounds, the
split at the load's end, the cost per checkpoint of the first steps, system pressure) are
``benches/train/drain_report.py``'s. Added here, per segment of a checkpoint condition
(step walls in ms; ``ref``: the mean of the baseline segments' median steps of the
adjacent rounds, each segment's first ``skip_first`` steps left out):

* ``cost_ms``: the save call plus the extra of the first ``skip_first`` steps over ``ref``
  (drain_report's cost per checkpoint);
* ``during_extra_ms``: the sum of (step - ref) over the later steps that started before the
  load ended (nb: durable; nb-repl: k-safe);
* ``interval_s``: from the save call to the load's end: the shortest interval at which this
  condition's checkpoints do not queue (the disk-bound interval: both ranks' files share
  one disk; with replication each file is then read back from it and sent);
* ``overhead_pct``: (cost + during extra) / (interval - that extra): the training time lost
  if checkpoints were taken every interval; ``cost_pct``: the same with the cost alone;
* ``repl_ratio``: the median of the steps that started between durable and k-safe (the
  replication alone, the disk drained) over ``ref``;
* ``covered``: the segment's steps lasted past the load's end (else the extra misses the
  steps a longer segment would have had).
"""

import drain_report
from train_model import med

#: Per-segment values summarized as median, min, max (repl_report.summarize).
KEYS = ["call_ms", "first_extra_ms", "cost_ms", "during_extra_ms", "total_extra_ms", "interval_s", "durable_s", "ksafe_s", "durable_to_ksafe_s", "overhead_pct", "cost_pct", "repl_ratio", "transfer_s", "partner_durable_s", "partner_ksafe_s", "start_lag_s"]


def mm(xs):
    """{median, min, max, n} of the values that are not None, or None."""
    xs = [x for x in xs if x is not None]
    return {"median": med(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def _div(a, b):
    return a / b if (a is not None and b) else None


def segment_cost(seg, skip, base):
    """The record of one checkpoint segment (see the module's docstring); ``base``: the
    baseline's median step by round."""
    ld, rows = seg["load"], seg["steps"]
    ref = drain_report._ref(base, seg["round"], False)
    end_ms, dur_ms = ld["end_ms"], ld["committed_ms"]
    later = [r for r in rows[skip:] if r[0] < end_ms]
    ksafe = ld.get("ksafe_s")
    repl = [r[1] for r in rows[skip:] if dur_ms <= r[0] < end_ms] if ksafe is not None else []
    call = ld["stall_s"] * 1e3
    first = sum(r[1] for r in rows[:skip]) - min(skip, len(rows)) * ref if ref is not None else None
    during = sum(r[1] - ref for r in later) if ref is not None else None
    cost = None if first is None else call + first
    total = None if cost is None else cost + during
    interval = ld["end_s"]
    rep = ld.get("replication") or {}
    peer = ld.get("partner") or {}
    return {
        "round": seg["round"],
        "step": ld.get("step"),
        "ref_ms": ref,
        "call_ms": call,
        "first_extra_ms": first,
        "cost_ms": cost,
        "during_steps": len(later),
        "during_extra_ms": during,
        "total_extra_ms": total,
        "interval_s": interval,
        "durable_s": ld["durable_s"],
        "ksafe_s": ksafe,
        "durable_to_ksafe_s": None if ksafe is None else ksafe - ld["durable_s"],
        "overhead_pct": None if total is None else 100.0 * total / (interval * 1e3 - total),
        "cost_pct": None if cost is None else 100.0 * cost / (interval * 1e3 - cost),
        "repl_steps": len(repl),
        "repl_ratio": _div(med(repl), ref),
        "covered": bool(rows) and rows[-1][0] + rows[-1][1] >= end_ms,
        "k_safe": rep.get("k_safe") if rep else None,
        "transfer_s": rep.get("transfer_seconds"),
        "partner_k_safe": peer.get("k_safe") if ksafe is not None else None,
        "partner_durable_s": peer.get("durable_s"),
        "partner_ksafe_s": peer.get("ksafe_s"),
        "start_lag_s": peer.get("start_lag_s"),
    }


def summarize(results):
    """drain_report's summary, plus ``summary["replication"][condition]``: every checkpoint
    segment's record (``per_segment``) and the median, min, max of each of ``KEYS``.
    Returns the summary dict (also stored in results)."""
    out = drain_report.summarize(results)
    meta = results["meta"]
    skip = meta.get("skip_first", 0)
    segs = [s for s in results["segments"] if s.get("ok") and not s.get("extra")]
    base = {s["round"]: med([r[1] for r in s["steps"][skip:]]) for s in segs if s["cond"] == "baseline"}
    repl = {}
    for c in meta["conditions"]:
        if c == "baseline":
            continue
        per = [segment_cost(s, skip, base) for s in segs if s["cond"] == c]
        rec = {k: mm([p[k] for p in per]) for k in KEYS}
        rec.update(
            per_segment=per,
            segments=len(per),
            covered=sum(p["covered"] for p in per),
            k_safe=[p["k_safe"] for p in per] if c == "nb-repl" else None,
        )
        repl[c] = rec
    out["replication"] = repl
    return out


def _mm(v, fmt="{:.1f}"):
    if not v:
        return "-"
    return fmt.format(v["median"]) + " (" + fmt.format(v["min"]) + ".." + fmt.format(v["max"]) + ")"


def _ratio(p):
    r = p["ratio"]
    return drain_report._f(r["median"], "{:.3f}") + drain_report._ci(r["ci95"], "{:.3f}")


def markdown(results):
    """The overhead table, the replication table, then drain_report's per-step report."""
    m, s = results["meta"], results["summary"]
    model = m.get("model") or {}
    base = s["conditions"].get("baseline", {}).get("all", {})
    L = [
        f"# Training overhead with replication on ({m.get('started')}, {m.get('gpu') or 'cpu'})",
        "",
        f"Trainer (rank 0, node m0) on {m.get('device')}: {m.get('params', 0) / 1e6:.1f} M parameters, state {m.get('state_bytes', 0) / (1 << 30):.2f} GiB "
        f"in {m.get('tensors')} tensors, batch {model.get('batch')}, baseline step {drain_report._f(base.get('median_ms'))} ms; "
        f"partner (rank 1, node m1, CPU) saving a state of the same size; gloo on 127.0.0.1. {m.get('rounds_done')} rounds alternated, "
        f"steps per segment {m.get('seg_iters')}, the first {m.get('skip_first')} left out of the step statistics; "
        f"replica_bandwidth {m.get('replica_bandwidth')}; snapshot {'device' if m.get('snapshot') else 'none'}; checkpoint dir "
        f"{(m.get('ckpt_fs') or {}).get('mount')} ({(m.get('ckpt_fs') or {}).get('fstype')}), one disk for both ranks.",
        "",
        "Per checkpoint segment, against ref = the mean of the adjacent rounds' baseline median steps: cost = the save call + "
        f"the extra of the first {m.get('skip_first')} steps; during extra = the sum of (step - ref) of the later steps started "
        "before the load ended (nb: durable; nb-repl: k-safe); interval = save call to the load's end, the shortest interval at "
        "which the condition's checkpoints do not queue (both ranks' files on one disk; with replication each file is then "
        "read back and sent): overhead = (cost + during extra) / (interval - them), cost only = cost / (interval - cost). "
        "Medians over segments (min..max); ratios: median over segments [bootstrap 95 % CI].",
        "",
        "| condition | segs | median step ms [95 % CI] | x baseline, all steps | x baseline, during the load | x baseline, durable to k-safe | "
        "cost per checkpoint ms | during extra ms | save to durable s | save to k-safe s | overhead % at the interval | cost only % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, r in s["conditions"].items():
        a, d = r["all"], r["during"]
        rp = s.get("replication", {}).get(c)
        row = f"| {c} | {r['segments']} | {drain_report._f(a['median_ms'])}{drain_report._ci(a['ci95_ms'])} | {_ratio(a)} | "
        if rp is None:
            L.append(row + "- | - | - | - | - | - | - | - |")
            continue
        L.append(
            row + f"{_ratio(d)} | {_mm(rp['repl_ratio'], '{:.3f}')} | {_mm(rp['cost_ms'])} | {_mm(rp['during_extra_ms'])} | "
            f"{_mm(rp['durable_s'], '{:.2f}')} | {_mm(rp['ksafe_s'], '{:.2f}')} | {_mm(rp['overhead_pct'], '{:.2f}')} | {_mm(rp['cost_pct'], '{:.2f}')} |"
        )
    rp = s.get("replication", {}).get("nb-repl")
    if rp and rp["overhead_pct"]:
        o = rp["overhead_pct"]
        L += ["", f"nb-repl at its interval (every {_mm(rp['interval_s'], '{:.2f}')} s): overhead {_mm(o, '{:.2f}')} % "
              f"(the issue's goal: <= 1 % at 137 ms steps; this run's baseline step {drain_report._f(base.get('median_ms'))} ms; "
              f"{rp['covered']} of {rp['segments']} segments lasted past k-safe)."]
    L += [
        "",
        "The loads: the trainer's call and the partner's save (seconds from each one's own call; start lag: the partner's call "
        "after the trainer's), the trainer's replication exchange (the report's transfer_seconds), the segments whose steps "
        "lasted past the load's end, and every nb-repl step's k_safe (trainer / partner).",
        "",
        "| condition | call ms | partner: save to durable s | partner: save to k-safe s | partner start lag s | exchange s | durable to k-safe s | segments covering the load | k_safe |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c, rp in s.get("replication", {}).items():
        ks = "-"
        if c == "nb-repl":
            ks = ", ".join(f"{p['k_safe']}/{p['partner_k_safe']}" for p in rp["per_segment"]) or "-"
        L.append(
            f"| {c} | {_mm(rp['call_ms'])} | {_mm(rp['partner_durable_s'], '{:.2f}')} | {_mm(rp['partner_ksafe_s'], '{:.2f}')} | "
            f"{_mm(rp['start_lag_s'], '{:.3f}')} | {_mm(rp['transfer_s'], '{:.2f}')} | {_mm(rp['durable_to_ksafe_s'], '{:.2f}')} | "
            f"{rp['covered']} of {rp['segments']} | {ks} |"
        )
    detail = drain_report.markdown(results).splitlines()
    L += ["", "## Per-step detail (benches/train/drain_report.py; \"load end\" = durable for nb, k-safe for nb-repl)", ""] + detail[1:]
    return "\n".join(L) + "\n"
