"""The goodput benchmark's analysis: from the events of the trainer's lives of one run
(one system, one MTBF) the measured goodput and its components; per system, the components
pooled over its runs and the model-based goodput at the real MTBF; the table and the plot.

Definitions (every time from ``time.monotonic()`` of the host, seconds):

* ``T0``: the failure-free step time, the mean step of the baseline (no checkpoint, no
  failure; its first 3 steps left out).
* The run's clock starts at the end of the first life's first step (``t_start``); the
  initial start is reported apart (``start``), not as a restart.
* **goodput (measured)** = ``progress x T0 / (wall - checks)``: ``progress`` the steps from
  ``t_start`` to the last step of the last life (stopped by SIGTERM once the run's budget
  was spent), ``wall`` that time, ``checks`` the time the resumes spent in the bit-exact
  check (not part of any system's cost).
* Per kill (at ``kill_t``; the next life resumed at step ``r``): **lost work**
  ``lost_s = kill_t - (end of step r in the killed life)`` (or the start of its first step
  when it had resumed at ``r`` itself), ``lost_steps`` the steps done past ``r``; the
  **restart** ``restart_s = end of the next life's first step - kill_t - check_s - T0``,
  broken down into ``detect`` (kill to the new process spawned), ``interp`` (spawn to the
  script's first line), ``imports`` (torch and the system's module), ``cuda`` (CUDA
  context), ``open`` (the checkpoint system constructed: shmckpt's recovery and
  ``prepare_cuda`` there), ``load`` (latest step found and loaded onto the device),
  ``setup`` (the optimizer and shmckpt's guard; ``setup_parts`` splits it into the
  optimizer made, the calibration read and the system attached), ``other`` (the rest until the first step
  starts) and ``first_extra`` (the first step over ``T0``).
* A **warm** restart (``--restart warm``: the next life is a spare, started ahead, sent
  ``go`` at the kill) is measured the same way, from the kill; its ``detect`` runs from the
  kill to the go sent, ``spare_wait`` is what was left of the spare's own start when the go
  was sent (0 when it was ready; a restart that found it not ready counts in
  ``spare_not_ready``), ``go`` the go's way through the pipe (from the go sent, or from the
  spare ready if later, to the go read), ``open`` runs from the go read; ``interp``,
  ``imports`` and ``cuda`` are 0 (they ran before the failure). A cold restart has
  ``spare_wait`` and ``go`` 0. The spare's own start-up (spawn to spare-ready: interpreter,
  imports, CUDA, the system's modules and the optimizer's warm-up) is reported apart
  (``spare_start_s_mean``, ``spare_parts_mean``), with its host memory when ready.
* A step's ``dt`` runs from the previous step's end to its own (its update done and
  synchronized), so it holds the previous step's save call and poll; the step is logged
  before its save starts (a kill during the save finds it done).
* Per save: the **call** (seconds in the save call), the **stall** (the two steps after
  the save over ``2 T0``: the call, then the guard's or stager's wait; one step when saving
  every step) and
  ``durable_s`` (call to durable, as seen by the poll after each step: one step of
  resolution).
* Per system (pooled over its runs): ``step_s`` the mean step with checkpoints (every
  life's first step left out), ``overhead = 1 - T0 / step_s``, ``interval_s = every x
  step_s``, ``E[lost] = interval_s / 2 + median durable_s`` (a kill uniform in the save
  cycle loses half an interval, and a whole one more when it lands before the save it
  follows is durable), ``E[restart]`` the mean restart (of those that loaded a checkpoint,
  when any did: a restart killed before its first durable save loads nothing); the
  **model** goodput at MTBF
  ``M`` is ``1 - overhead - (E[lost] + E[restart]) / M`` (first order in 1 / M). With a
  warm launcher also ``E[restart]`` with the spare ready (``e_restart_ready_s``: every
  restart less its ``spare_wait``) and the model at the real MTBF with it: time-scaled,
  the next kill often comes before the spare has started, which at a real MTBF of
  minutes it rarely does. The overhead still holds whatever a restart leaves in the steps
  after its first (a wait for staging room, say), which the time scaling weighs as often
  as the kills.
"""

import json
import statistics


#: The parts of a restart, in order; they sum to ``restart_s``.
RESTART_PARTS = ("detect", "spare_wait", "go", "interp", "imports", "cuda", "open", "load", "setup", "other", "first_extra")
#: Those a table shows, per launcher mode (the others are 0 there).
SHOWN_PARTS = {
    "cold": ("detect", "interp", "imports", "cuda", "open", "load", "setup", "other", "first_extra"),
    "warm": ("detect", "spare_wait", "go", "open", "load", "setup", "other", "first_extra"),
}
#: A spare's start-up, spawn to spare-ready (``warm_up``: the system's modules and the
#: optimizer's warm-up).
SPARE_PARTS = ("interp", "imports", "cuda", "warm_up")


def _med(xs):
    return statistics.median(xs) if xs else None


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def by_life(events):
    """{life: {"main", "resume", "setup", "steps": [ev], "saves": [ev], "dur": [(step, t)],
    "stop", "closed", "error"}}."""
    out = {}
    for ev in events:
        lf = out.setdefault(ev["life"], {"steps": [], "saves": [], "dur": []})
        e = ev["e"]
        if e == "s":
            lf["steps"].append(ev)
        elif e == "sv":
            lf["saves"].append(ev)
        elif e == "d":
            lf["dur"].extend((int(s), float(t)) for s, t in ev["dur"])
        else:
            lf[e] = ev
    return out


def analyze_run(run, t0, every):
    """The measured goodput and the components of one run (``run``: the supervisor's record,
    with ``lives`` and ``events``). Adds nothing to ``run``; returns a dict."""
    lives = by_life(run["events"])
    sup = {lf["life"]: lf for lf in run["lives"]}
    order = sorted(sup)
    first = lives[order[0]]["steps"][0]
    t_start, k0 = first["t"], first["k"]
    last_life = lives[order[-1]]
    final = last_life["steps"][-1]
    wall = final["t"] - t_start
    checks = sum(lives[i]["resume"]["check_s"] for i in order[1:])
    progress = final["k"] - k0
    res = {
        "t_start": t_start, "k0": k0, "k_final": final["k"], "progress_steps": progress, "wall_s": wall, "checks_s": checks,
        "goodput": progress * t0 / (wall - checks) if wall > checks else None,
        "kills": [], "violations": [], "saves": [],
    }
    res["start"] = boot(lives[order[0]], sup[order[0]])
    res["spares"] = [spare_start(sp) for sp in run.get("spares", []) if sp.get("ready")]
    durable_by = []  # (t, step) of every durable save seen so far
    for n, life in enumerate(order):
        lf, sp = lives[life], sup[life]
        durable_by.extend((t, s) for s, t in lf["dur"])
        if sp.get("kill_t") is None:
            continue
        kill_t = sp["kill_t"]
        nxt = lives[order[n + 1]]
        r = nxt["resume"]["k"]
        ks = {ev["k"]: ev for ev in lf["steps"]}
        k_last = lf["steps"][-1]["k"] if lf["steps"] else lf["resume"]["k"]
        if r in ks:
            t_from = ks[r]["t"]
        elif r == lf["resume"]["k"] and lf["steps"]:
            t_from = lf["steps"][0]["t"] - lf["steps"][0]["dt"]
        else:
            t_from = None
            res["violations"].append(f"life {life + 1} resumed at step {r}, before life {life}'s own start at step {lf['resume']['k']}")
        newest_durable = max((s for t, s in durable_by if t <= kill_t), default=0)
        if r < newest_durable:
            res["violations"].append(f"life {life + 1} resumed at step {r}, but step {newest_durable} was durable before the kill")
        if r > k_last:
            res["violations"].append(f"life {life + 1} resumed at step {r}, never reached before the kill (last {k_last})")
        rb = restart(nxt, sup[order[n + 1]], kill_t, t0)
        res["kills"].append({
            "life": life, "kill_t": kill_t, "k_last": k_last, "resumed": r, "lost_steps": k_last - r,
            "lost_s": None if t_from is None else kill_t - t_from, "restart": rb,
            "source": nxt["resume"].get("info", {}).get("load_source"),
            "open_phases": nxt["resume"].get("info", {}).get("open_timings"),
            "prepare_cuda_s": nxt["resume"].get("info", {}).get("prepare_cuda_s"),
        })
    for life in order:
        lf = lives[life]
        dur = dict((s, t) for s, t in lf["dur"])
        dts = {ev["k"]: ev["dt"] for ev in lf["steps"]}
        n = min(2, every)  # the steps that pay for a save: its call, then the guard's or stager's wait
        for sv in lf["saves"]:
            k = sv["k"]
            rec = {"step": k, "call_s": sv["call_s"], "durable_s": dur[k] - sv["t"] if k in dur else None}
            if all(k + j in dts for j in range(1, n + 1)):
                rec["stall_s"] = sum(dts[k + j] for j in range(1, n + 1)) - n * t0
            res["saves"].append(rec)
    res["step_dts"] = [ev["dt"] for life in order for ev in lives[life]["steps"][1:]]
    # A save call that no step of its life followed (the trainer was stopped or killed
    # after it returned) is in no step's dt: its time still counts against training.
    res["calls_after_last_step_s"] = [
        sv["call_s"]
        for life in order
        for sv in lives[life]["saves"]
        if sv["k"] + 1 not in {ev["k"] for ev in lives[life]["steps"]}
    ]
    return res


def restart(lf, sp, kill_t, t0):
    """The restart that life ``lf`` (the supervisor's record ``sp``) made after the kill at
    ``kill_t``: its parts (``RESTART_PARTS``, summing to ``restart_s``) and ``check``."""
    rb = boot(lf, sp)
    fs = lf["steps"][0]
    rb["detect"] = (sp["go_t"] if rb["warm"] else sp["spawn_t"]) - kill_t
    rb["first_extra"] = fs["dt"] - t0
    rb["restart_s"] = fs["t"] - kill_t - rb["check"] - t0
    rb["other"] = rb["restart_s"] - sum(rb[x] for x in RESTART_PARTS if x != "other")
    return rb


def boot(lf, sp):
    """A life's start, phase by phase (seconds): a cold one's from its spawn (interpreter,
    imports, CUDA, then the open); a warm one's (a spare sent go: ``sp["go_t"]``) from the
    go, its interpreter, imports and CUDA 0 (they ran before)."""
    rs = lf["resume"]
    go = lf.get("go")
    if go is None:
        t_open_from = rs["t_cuda"]
        head = {"interp": lf["main"]["t"] - sp["spawn_t"], "imports": rs["t_import"] - lf["main"]["t"],
                "cuda": rs["t_cuda"] - rs["t_import"], "spare_wait": 0.0, "go": 0.0, "warm": False}
    else:
        t_open_from = go["t"]
        head = {"interp": 0.0, "imports": 0.0, "cuda": 0.0, "spare_wait": max(0.0, go["t_ready"] - sp["go_t"]),
                "go": go["t"] - max(sp["go_t"], go["t_ready"]), "warm": True}
    return {
        **head, "open": rs["t_open"] - t_open_from, "load": rs["t_load"] - rs["t_open"], "check": rs["check_s"],
        "setup": lf["setup"]["t"] - rs["t_check"], "resumed": rs["k"],
        # The set-up split, where the trainer reports it: optimizer, calibration, attach.
        "setup_parts": None if "t_opt" not in lf["setup"] else {
            "optimizer": lf["setup"]["t_opt"] - rs["t_check"],
            "calibration": lf["setup"]["t_calib"] - lf["setup"]["t_opt"],
            "attach": lf["setup"]["t"] - lf["setup"]["t_calib"],
        },
        "fresh": rs["fresh"],
    }


def spare_start(sp):
    """A spare's start-up from the supervisor's record of it (spawned, its spare-ready line):
    ``start_s`` (spawn to ready), its parts (``SPARE_PARTS``), its host memory when ready."""
    rd = sp["ready"]
    return {
        "start_s": rd["t"] - sp["spawn_t"], "interp": rd["t_main"] - sp["spawn_t"], "imports": rd["t_import"] - rd["t_main"],
        "cuda": rd["t_cuda"] - rd["t_import"], "warm_up": rd["t"] - rd["t_cuda"], "used": sp.get("life") is not None,
        "rss_bytes": rd.get("rss_bytes"), "anon_bytes": rd.get("anon_bytes"),
    }


def model_goodput(comp, mtbf_s):
    """``1 - overhead - (E[lost] + E[restart]) / M``, or None without a measured restart."""
    if comp.get("e_restart_s") is None or comp.get("e_lost_s") is None:
        return None
    return 1.0 - comp["overhead"] - (comp["e_lost_s"] + comp["e_restart_s"]) / mtbf_s


def components(analyses, t0, every):
    """One system's components, pooled over its runs' analyses."""
    dts = [d for a in analyses for d in a["step_dts"]]
    saves = [s for a in analyses for s in a["saves"]]
    kills = [k for a in analyses for k in a["kills"]]
    loaded = [k for k in kills if not k["restart"]["fresh"]]
    # The time of each step, its save call included (a step's dt holds the call before
    # it; the calls no step followed are added here).
    unfollowed = [c for a in analyses for c in a.get("calls_after_last_step_s", [])]
    step_s = None if not dts else (sum(dts) + sum(unfollowed)) / len(dts)
    durs = [s["durable_s"] for s in saves if s["durable_s"] is not None]
    comp = {
        "t0_s": t0, "every": every, "steps": len(dts), "step_s": step_s,
        "overhead": None if step_s is None else 1.0 - t0 / step_s,
        "interval_s": None if step_s is None else every * step_s,
        "saves": len(saves), "call_s_median": _med([s["call_s"] for s in saves]),
        "stall_s_median": _med([s["stall_s"] for s in saves if "stall_s" in s]),
        "durable_s_median": _med(durs), "durable_s_max": max(durs) if durs else None,
        "restarts": len(kills),
        "restarts_from_checkpoint": len(loaded),
        # a restart with nothing to load (killed before its first durable save) is cheaper
        # than one at the real MTBF, where a checkpoint is there: those count only when no
        # restart loaded one
        "e_restart_s": _mean([k["restart"]["restart_s"] for k in (loaded or kills)]),
        "e_lost_measured_s": _mean([k["lost_s"] for k in kills if k["lost_s"] is not None]),
        "lost_steps_mean": _mean([k["lost_steps"] for k in kills]),
    }
    comp["e_lost_s"] = None if step_s is None or comp["durable_s_median"] is None else comp["interval_s"] / 2 + comp["durable_s_median"]
    comp["restart_parts_mean"] = {
        p: _mean([k["restart"][p] for k in (loaded or kills)]) for p in RESTART_PARTS + ("check",)
    }
    split = [k["restart"]["setup_parts"] for k in (loaded or kills) if k["restart"].get("setup_parts")]
    comp["setup_parts_mean"] = {p: _mean([x[p] for x in split]) for p in ("optimizer", "calibration", "attach")} if split else None
    comp.update(spare_components(analyses, kills))
    if comp["restarts_warm"]:
        # The restart with its spare ready: at a real MTBF of minutes the spare (seconds to
        # start) is ready unless two failures come within its start-up; time-scaled, it
        # often is not.
        comp["e_restart_ready_s"] = _mean([k["restart"]["restart_s"] - k["restart"]["spare_wait"] for k in (loaded or kills)])
    return comp


def spare_components(analyses, kills):
    """Warm restarts: how many, how many found the spare not ready, and the spares' own
    start-up (every spare that became ready, used or not) and host memory, pooled."""
    spares = [sp for a in analyses for sp in a.get("spares", [])]
    warm = [k for k in kills if k["restart"].get("warm")]
    return {
        "restarts_warm": len(warm),
        "spare_not_ready": sum(k["restart"]["spare_wait"] > 0 for k in warm),
        "spares_ready": len(spares),
        "spare_start_s_mean": _mean([sp["start_s"] for sp in spares]),
        "spare_parts_mean": {p: _mean([sp[p] for sp in spares]) for p in SPARE_PARTS} if spares else None,
        "spare_rss_bytes_mean": _mean([sp["rss_bytes"] for sp in spares if sp.get("rss_bytes") is not None]),
        "spare_anon_bytes_mean": _mean([sp["anon_bytes"] for sp in spares if sp.get("anon_bytes") is not None]),
    }


def summarize(result):
    """Fill ``result["summary"]``: per run its analysis, per system its components and the
    measured and model goodputs per MTBF."""
    meta = result["meta"]
    t0, every, scale = meta["t0_s"], meta["every"], meta["time_scale"]
    per_sys = {}
    for run in result["runs"]:
        if run.get("error"):
            continue
        run["analysis"] = analyze_run(run, t0, meta["every_of"].get(run["system"], every))
        per_sys.setdefault(run["system"], []).append(run)
    summ = {}
    for name, runs in per_sys.items():
        ev = meta["every_of"].get(name, every)
        comp = components([r["analysis"] for r in runs], t0, ev)
        rows = []
        for r in runs:
            an = r["analysis"]
            m = r["mtbf_scaled_s"]
            rows.append({
                "mtbf_real_s": r["mtbf_real_s"], "mtbf_scaled_s": m, "kills": len(an["kills"]), "goodput_measured": an["goodput"],
                "model_at_scaled": model_goodput(comp, m), "model_at_real": model_goodput(comp, m * scale),
                "model_at_real_spare_ready": (
                    None if comp.get("e_restart_ready_s") is None
                    else model_goodput(dict(comp, e_restart_s=comp["e_restart_ready_s"]), m * scale)
                ),
                "violations": an["violations"],
            })
        summ[name] = {"components": comp, "runs": rows}
    result["summary"] = summ
    return summ


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def table(result):
    """The results as markdown tables (also printed by goodput.py)."""
    meta = result["meta"]
    mode = meta.get("restart", "cold")
    lines = [
        f"T0 (failure-free step) {meta['t0_s'] * 1e3:.1f} ms, state {meta['size_bytes'] / 2**30:.3f} GiB in {meta['tensors']} fp32 tensors "
        f"on {meta['device']}, checkpoint every {meta['every']} steps; time scale x{meta['time_scale']:g} "
        f"(a real MTBF of M s is injected as M / {meta['time_scale']:g} s of running time); "
        + ("restart **warm** (a spare started ahead is sent go at the kill)" if mode == "warm"
           else "restart **cold** (a new trainer process per failure, as torchrun's agent)"),
        "",
        "| system | MTBF real (scaled) | kills | goodput measured (scaled MTBF) | model at scaled | **model at real MTBF** |"
        + (" model at real MTBF, the spare ready |" if mode == "warm" else ""),
        "|---|---|---|---|---|---|" + ("---|" if mode == "warm" else ""),
    ]
    for name, s in result["summary"].items():
        for r in s["runs"]:
            lines.append(
                f"| {name} | {r['mtbf_real_s'] / 60:g} min ({r['mtbf_scaled_s']:g} s) | {r['kills']} | {_f(r['goodput_measured'])} | "
                f"{_f(r['model_at_scaled'])} | **{_f(r['model_at_real'])}** |"
                + (f" {_f(r.get('model_at_real_spare_ready'))} |" if mode == "warm" else "")
            )
    shown = SHOWN_PARTS[mode]
    lines += [
        "",
        "| system | step s | overhead | call s (median) | stall s (median) | durable s (median) | E[lost] s model (measured) | E[restart] s | "
        f"{mode} restart: {' / '.join(_PART_NAMES.get(x, x) for x in shown)} | restarts (from a checkpoint) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        c = s["components"]
        p = c["restart_parts_mean"]
        parts = " / ".join(_f(p.get(x), "{:.2f}") for x in shown)
        lines.append(
            f"| {name} | {_f(c['step_s'], '{:.4f}')} | {_f(c['overhead'], '{:.2%}')} | {_f(c['call_s_median'], '{:.4f}')} | "
            f"{_f(c['stall_s_median'], '{:.4f}')} | {_f(c['durable_s_median'], '{:.2f}')} | {_f(c['e_lost_s'], '{:.2f}')} "
            f"({_f(c['e_lost_measured_s'], '{:.2f}')}) | {_f(c['e_restart_s'], '{:.2f}')} | {parts} | {c['restarts']} ({c['restarts_from_checkpoint']}) |"
        )
    if mode == "warm":
        lines += spare_table(result)
    if result.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items())]
    bad = [(r["system"], r["mtbf_real_s"], r["error"]) for r in result["runs"] if r.get("error")]
    bad += [(n, r["mtbf_real_s"], v) for n, s in result["summary"].items() for r in s["runs"] for v in r["violations"]]
    if bad:
        lines += ["", "FAILED: " + "; ".join(f"{n} at {m / 60:g} min: {e}" for n, m, e in bad)]
    return "\n".join(lines)


_PART_NAMES = {"spare_wait": "spare wait", "first_extra": "first step"}


def spare_table(result):
    """The warm launcher's spares: their start-up (before the failure, off the restart's
    clock), the restarts that found one not ready, their memory."""
    lines = [
        "",
        "| system | warm restarts | spare not ready | spare start-up s (spawn to ready) | spare: interp / imports / cuda / warm-up | "
        "spares ready | spare host RSS MiB (anonymous) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        c = s["components"]
        p = c.get("spare_parts_mean") or {}
        mib = "{:.0f}"
        lines.append(
            f"| {name} | {c['restarts_warm']} | {c['spare_not_ready']} | {_f(c['spare_start_s_mean'], '{:.2f}')} | "
            f"{' / '.join(_f(p.get(x), '{:.2f}') for x in SPARE_PARTS)} | {c['spares_ready']} | "
            f"{_f(None if c['spare_rss_bytes_mean'] is None else c['spare_rss_bytes_mean'] / 2**20, mib)} "
            f"({_f(None if c['spare_anon_bytes_mean'] is None else c['spare_anon_bytes_mean'] / 2**20, mib)}) |"
        )
    g = result["meta"].get("spare_gpu")
    if g is not None:
        lines += ["", f"A ready spare's device memory (the driver's count, `mem_get_info` read by the baseline trainer without and "
                      f"with a spare ready beside it): {g['bytes'] / 2**20:.0f} MiB of {g['total'] / 2**30:.1f} GiB"]
    return lines


def plot(result, path):
    """Bars of the measured and the model goodput per system and MTBF; returns None or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not importable ({e}): no plot"
    names = list(result["summary"])
    mtbfs = sorted({r["mtbf_real_s"] for s in result["summary"].values() for r in s["runs"]}, reverse=True)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(names), 4))
    width = 0.8 / max(1, 2 * len(mtbfs))
    for j, m in enumerate(mtbfs):
        for q, (key, lab) in enumerate((("goodput_measured", "measured, scaled"), ("model_at_real", "model, real"))):
            xs, ys = [], []
            for i, n in enumerate(names):
                row = next((r for r in result["summary"][n]["runs"] if r["mtbf_real_s"] == m), None)
                if row is not None and row[key] is not None:
                    xs.append(i + (2 * j + q - len(mtbfs) + 0.5) * width)
                    ys.append(max(0.0, row[key]))
            ax.bar(xs, ys, width, label=f"MTBF {m / 60:g} min: {lab}")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("goodput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


if __name__ == "__main__":
    import sys

    with open(sys.argv[1]) as f:
        res = json.load(f)
    summarize(res)
    print(table(res))
