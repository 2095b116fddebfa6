#!/usr/bin/env python3
"""Training overhead of checkpointing to memory at the PCIe limit (issue 38, item 2).

Every save lands in the memory tier (the staging arena in /dev/shm, copied from the GPU
by a non-blocking save under the Checkpointer's guard); the disk takes only the saves it
can sustain (``disk_every="auto"``). Goal: <= 1 % training overhead with an 8 GiB state
saved every step at ~186 ms steps, and every 4 steps at ~57 ms steps. Each configuration
names its snapshot mode: saving every step, the device-to-host copy (8 GiB / 55 GB/s =
0.16 s) fits in the next forward and backward, and a device snapshot would only add its
device-to-device copy (and the save call measured 134 ms median on the H200 at 8 GiB
saved every step with it, nearly all inside the engine's save, against 9.6 ms without);
saving every 4 steps of 57 ms, the copy outlasts a step, and the snapshot lets the
optimizer step go on after a device-to-device copy.

One process per run; for each configuration (step length, save interval) the batch is
calibrated to the step length, then segments of ``--iters`` steps alternate, round after
round (order reversed every other round): ``baseline`` (no checkpoint) and ``tiered``
(a save every ``every`` steps). Every step is timed on the host with the trainer's stream
synchronized after it (as ``loss.item()`` does). Each step calls ``save`` at its start,
after the previous step's synchronization, with the device idle (``--call-at start``, the
default: the call's time is the step's), or at its end, after its optimizer step is queued
and before its synchronization (``--call-at end``: the call runs while the device runs the
optimizer step, and the save holds the state after it; the raw copy and the engine's save
are placed the same way). Before each segment every handle of the
previous one is waited for (untimed), so each segment starts from an idle disk; segments
are several disk drains long, so the disk drains during most of a tiered segment.

Per configuration: the mean step of each condition, the overhead = mean(tiered) /
mean(baseline) - 1 per round (adjacent segments), its median over rounds and a bootstrap
95 % interval of the mean, the saves' call time (stall), and how many saves the disk took;
in the JSON also, per condition and segment, every step's time and every save's tier,
staging time and backpressure, and every collection of CPython's oldest generation (its
step, length and thread) with the collections per generation (``segments``).

H200 (one call, about 4 minutes with --budget-s 200):
    python3 benches/train/cadence_overhead.py --out $OUT/cadence
CPU smoke test (tiny model, 2 rounds):
    python3 benches/train/cadence_overhead.py --device cpu --tiny --out /tmp/cadence
"""

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "common"))
sys.path.insert(0, _HERE)
from peers import log, now  # noqa: E402
from train_model import GiB, MiB, SIZES, cadence_trainer, med, staging_capacity, state_nbytes, time_steps  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", default="cuda", choices=["cuda", "cpu"])
    a("--tiny", action="store_true", help="smoke test: tiny model, 2 rounds, short segments")
    a("--state", default="8g", choices=sorted(SIZES))
    a("--configs", default="186:1:none,57:4:device", help="comma list of STEP_MS:EVERY[:SNAPSHOT] (a save every EVERY steps; SNAPSHOT none or device, default --snapshot)")
    a("--iters", type=int, default=None, help="steps per segment (default: about 8 s of steps)")
    a("--rounds", type=int, default=30)
    a("--budget-s", type=float, default=200.0, help="per configuration: no round starts past this")
    a("--ck-kw", default='{"cadence": {"disk_every": "auto"}}', help='JSON: the tiered Checkpointer\'s keywords, its groups as objects ({"cadence": {"disk_every": 4}, "tuning": {"writer_threads": 8}}; see checkpointer_kw)')
    a("--keep-last", type=int, default=2, help="committed checkpoints each checkpointer keeps on disk (each condition has its own root: with several --compare-tuning, 1 keeps a 64 GiB disk from filling at 8 GiB)")
    a("--staging-factor", type=float, default=3.0, help="staging capacity / state bytes (a disk save draining, the held memory-only step and the save being staged)")
    a("--snapshot", default="device", help='save(snapshot=...) of a configuration that names none ("none": no snapshot)')
    a("--compare-tuning", action="append", default=None, metavar="JSON", help='also alternate segments saving through another checkpointer with these Tuning fields over the bench\'s (a field with a leading underscore sets the saver\'s attribute: {"_early_snapshot": false}), e.g. {"copy_ahead": 0} (every device copy queued at once), reported as "compare"; repeat for more checkpointers ("compare2", "compare3", ...; each has its own staging: --staging-factor x the state)')
    a("--compare-engine", action="store_true", help='also alternate segments saving through a checkpointer with the bench\'s tuning, but straight into its engine from the trainer\'s thread (Engine.save with engine tuples built once, ordered after an event recorded at the call, the streams held before the optimizer step): the save without the package\'s Python capture, reported as "engine"')
    a("--compare-raw", action="store_true", help='also alternate segments that copy the state\'s bytes as one device-to-host copy (cudaMemcpyAsync of one buffer of the same size into pinned memory, on a side stream the optimizer step waits for): the physical cost of the copy beside the step, reported as "raw"')
    a("--call-at", default="start", choices=["start", "end"], help="where each step calls save: at its start, after the previous step's synchronization (the device idle: the call's time is the step's; default), or at its end, after the optimizer step is queued and before the step's synchronization (the call runs while the device runs the optimizer step; the save holds the state after that step)")
    a("--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval for the whole run (how long a thread holding the interpreter keeps it while another waits; Python's default 5 ms)")
    a("--dir", default="/var/tmp/cadence", help="parent of the run's checkpoint root")
    a("--out", default=None)
    a("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.compare_raw and args.device != "cuda":
        p.error("--compare-raw copies device memory to the host: it needs --device cuda")
    if args.tiny:
        args.state, args.rounds, args.iters = "tiny", 2, args.iters or 6
        args.configs = "5:1:none,5:2"
    return args


def p90(xs):
    """The 90th percentile of ``xs`` (nearest rank below)."""
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def bootstrap_mean_ci(xs, n=2000, seed=7):
    if len(xs) < 2:
        return None
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(n))
    return [means[int(0.025 * n)], means[int(0.975 * n) - 1]]


def checkpointer_kw(kw, **tuning):
    """The Checkpointer keywords of ``--ck-kw`` (JSON): its groups ``"cadence"``,
    ``"tuning"``, ``"replicas"``, ``"remote"`` given as objects become ``shmckpt.Cadence``,
    ``Tuning``, ``Replicas``, ``RemoteTier`` (the shorthands ``"replicas": 1`` and
    ``"remote": "s3://..."`` are passed on as they are); a flat cadence or tuning keyword of earlier versions
    (``"disk_every": "auto"``, the old default) goes into its group, as the Checkpointer
    would put it, without its deprecation warning; any other keyword is passed on (a flat
    remote or replica keyword too: it needs its tier, and the Checkpointer warns).
    ``tuning``: the bench's own ``Tuning`` fields (the chunk size and the staging it
    sized), which ``--ck-kw`` may not set."""
    import shmckpt
    from shmckpt.config import LEGACY

    classes = {"cadence": shmckpt.Cadence, "tuning": shmckpt.Tuning, "replicas": shmckpt.Replicas, "remote": shmckpt.RemoteTier}
    out, groups = {}, {g: {} for g in classes}
    for k, v in kw.items():
        if k in LEGACY and LEGACY[k][0] in ("cadence", "tuning"):
            g, f = LEGACY[k]
            groups[g][f] = v
        elif k in classes and isinstance(v, dict):
            groups[k].update(v)
        else:
            out[k] = v
    both = sorted(set(groups["tuning"]) & set(tuning))
    if both:
        raise SystemExit(f"cadence_overhead: --ck-kw sets {both}, which the bench sizes itself")
    groups["tuning"].update(tuning)
    for g, fields in groups.items():
        if fields:
            out[g] = classes[g](**fields)
    return out


def engine_entries(state):
    """The engine tuples of flat state ``state`` (name, safetensors dtype, shape, tensor,
    bytes, CUDA ordinal or -1), built once for ``--compare-engine`` (each save makes their
    capsules anew: ``engine_tuples``)."""
    from shmckpt._state import TORCH_TO_ST

    return [(k, TORCH_TO_ST[t.dtype], list(t.shape), t, t.numel() * t.element_size(), t.device.index if t.is_cuda else -1) for k, t in state.items()]


def run_config(tr, state, cks, step_ms, every, snapshot, args, cuda, step_no, engines=None):
    """``cks``: the checkpointer of each saving condition (``tiered``, and ``compare``,
    ``compare2``, ... with ``--compare-tuning``); condition ``raw`` with ``--compare-raw``. ``step_no``: ``[last step saved]``, shared by the
    configurations: the checkpointers and their roots are the same for all of them, so
    step numbers keep increasing (the second configuration restarted at 1 and would have
    hit steps kept on disk). ``engines``: ``{"engine": (Engine, entries)}`` with
    ``--compare-engine``."""
    import torch
    from shmckpt._util import engine_tuples
    from sweep import calibrate

    engines = engines or {}

    if cuda:
        cal = calibrate(tr, [step_ms / 1e3], argparse.Namespace(batches=None, quick=False))
        tr.cfg["batch"] = cal["chosen"][0]["batch"]
    time_steps(tr, 3)
    step_s = med(time_steps(tr, 10))
    iters = args.iters or max(20, int(round(8.0 / max(step_s, 1e-3))))
    snap = None if snapshot == "none" else snapshot
    at_end = args.call_at == "end"
    log(f"config {step_ms} ms every {every} (snapshot {snapshot}): batch {tr.cfg['batch']}, step {step_s * 1e3:.1f} ms, {iters} steps per segment")
    conds = ["baseline", *cks] + (["engine"] if "engine" in engines else []) + (["raw"] if args.compare_raw else [])
    raws = None
    if args.compare_raw:
        nbytes = state_nbytes(state)
        raws = (torch.cuda.Stream(), torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        raws[1].fill_(1)
    rounds = []
    stalls = {c: [] for c in conds}
    staged = {c: [] for c in conds}
    disk_saves = {c: 0 for c in [*cks, *engines]}
    saves = {c: 0 for c in [*cks, *engines]}
    first_step = step_no[0] + 1
    segments = {c: [] for c in conds}
    t_end = now() + args.budget_s

    def segment(cond):
        ck = cks.get(cond)
        eng = engines.get(cond)
        raw = raws if cond == "raw" else None
        handles = []
        held = []  # the engine's saves not yet held before an optimizer step
        copied = []  # the raw copies not yet waited for before an optimizer step

        def save(i):
            t0 = now()
            if ck is not None and i % every == 0:
                step_no[0] += 1
                kw = {"blocking": False}
                if snap:
                    kw["snapshot"] = snap
                handles.append(ck.save(step_no[0], state, **kw))
                stalls[cond].append(now() - t0)
            if eng is not None and i % every == 0:
                step_no[0] += 1
                engine, entries = eng
                after = []
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record()
                    after = [(0, "event", ev)]
                h = engine.save(step_no[0], engine_tuples(entries), {}, after, False)
                handles.append(h)
                held.append(h)
                stalls[cond].append(now() - t0)
            if raw is not None and i % every == 0:
                side, src, dst = raw
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
                copied.append(side)

        def before_step():
            # As the guard's hook does for a checkpointer: the optimizer step waits for
            # the copies of the saves made since the last one.
            while held:
                h = held.pop()
                if cuda:
                    h.hold_streams([(0, torch.cuda.current_stream())])
                else:
                    h.wait_staged()
            while copied:
                torch.cuda.current_stream().wait_stream(copied.pop())  # as the guard's wait

        tr.sync()
        walls = []
        # Every collection of CPython's oldest generation during the segment (a walk of
        # the whole heap, holding the interpreter): the step it fell in, its length and
        # its thread; and the collections of each generation.
        full, begun, at = [], [0.0], [0]

        def on_gc(phase, info):
            if info["generation"] != 2:
                return
            if phase == "start":
                begun[0] = now()
            else:
                full.append({"step": at[0], "ms": (now() - begun[0]) * 1e3, "thread": threading.current_thread().name})

        counts0 = [g["collections"] for g in gc.get_stats()]
        gc.callbacks.append(on_gc)
        try:
            for i in range(iters):
                at[0] = i
                t0 = now()
                if not at_end:
                    save(i)
                tr.fwd_bwd()
                before_step()
                tr.step()
                if at_end:
                    save(i)
                tr.sync()
                walls.append(now() - t0)
        finally:
            gc.callbacks.remove(on_gc)
        gc_counts = [g["collections"] - c for g, c in zip(gc.get_stats(), counts0)]
        before_step()  # (--call-at end: the last save's copies, untimed)
        per_save = []
        for h in handles:  # untimed: the next segment starts from an idle disk
            rep = h.wait()
            saves[cond] += 1
            tm = rep.get("timings", rep)
            # From the call until every byte was in staging: longer than the forward and
            # backward after the call, and the optimizer step waited for the copy.
            staged[cond].append(tm["staging"])
            disk = not rep.get("memory_only")
            if disk:
                disk_saves[cond] += 1
            per_save.append({"disk": disk, "staging_ms": tm["staging"] * 1e3, "backpressure_ms": tm.get("backpressure", 0.0) * 1e3})
        # Every step's time and every save's, per segment: which steps of a slow round were
        # slow, and whether a disk save or a wait for staging room came with them.
        segments[cond].append({"round": len(rounds), "steps_ms": [w * 1e3 for w in walls], "saves": per_save, "gc_full": full, "gc_collections": gc_counts})
        return walls

    r = 0
    while r < args.rounds and now() < t_end:
        order = conds if r % 2 == 0 else conds[::-1]
        seg = {c: segment(c) for c in order}
        rounds.append({c: statistics.fmean(w[1:]) for c, w in seg.items()})
        log(f"  round {r}: " + ", ".join(f"{c} {rounds[-1][c] * 1e3:.2f} ms" for c in conds))
        r += 1
    for c in conds:  # collections of the whole heap per condition (the steps' tail)
        fl = [f for sg in segments[c] for f in sg["gc_full"]]
        tail = f": median {med([f['ms'] for f in fl]):.1f} ms, max {max(f['ms'] for f in fl):.1f} ms" if fl else ""
        log(f"  {c}: {len(fl)} full collections of the heap in {sum(len(sg['steps_ms']) for sg in segments[c])} steps{tail}")
    res = summary(rounds, "tiered", stalls, staged)
    res.update(
        step_ms_target=step_ms,
        every=every,
        call_at=args.call_at,
        snapshot=snapshot,
        batch=tr.cfg["batch"],
        iters_per_segment=iters,
        rounds=len(rounds),
        baseline_mean_ms=statistics.fmean(x["baseline"] for x in rounds) * 1e3,
        step_s_alone=step_s,
        saves=saves["tiered"],
        disk_saves=disk_saves["tiered"],
        steps=[first_step, step_no[0]],
        segments=segments,
    )
    for i, tuning in enumerate(args.compare_tuning or []):
        name = compare_name(i)
        res[name] = summary(rounds, name, stalls, staged)
        res[name].update(tuning=tuning, saves=saves[name], disk_saves=disk_saves[name])
    if "engine" in engines:
        res["engine"] = summary(rounds, "engine", stalls, staged)
        res["engine"].update(saves=saves["engine"], disk_saves=disk_saves["engine"])
    if raws is not None:
        res["raw"] = summary(rounds, "raw", stalls, staged)
        res["raw"].update(saves=0, disk_saves=0)
    return res


def compare_name(i):
    """The condition of the ``i``-th ``--compare-tuning``: ``compare``, ``compare2``, ..."""
    return "compare" if i == 0 else f"compare{i + 1}"


def summary(rounds, cond, stalls, staged):
    """Condition ``cond``'s overhead against the baseline of the same rounds, its save
    calls (``stall``) and staging times."""
    over = [x[cond] / x["baseline"] - 1 for x in rounds]
    st, sg = stalls[cond], staged[cond]
    return {
        "tiered_mean_ms": statistics.fmean(x[cond] for x in rounds) * 1e3,
        "overhead_median": med(over),
        "overhead_mean": statistics.fmean(over),
        "overhead_mean_ci95": bootstrap_mean_ci(over),
        "overhead_per_round": over,
        "stall_ms_median": med(st) * 1e3 if st else None,
        "stall_ms_p90": p90(st) * 1e3 if st else None,
        "staging_ms_median": med(sg) * 1e3 if sg else None,
        "staging_ms_p90": p90(sg) * 1e3 if sg else None,
    }


def main(argv=None):
    import torch

    import shmckpt

    args = parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "cadence")
    os.makedirs(out, exist_ok=True)
    cuda = args.device == "cuda"
    tr = cadence_trainer(args.device, args.state, args.seed)
    state = tr.build_state()
    nbytes = state_nbytes(state)
    log(f"state {nbytes / GiB:.2f} GiB in {len(state)} tensors")
    root = os.path.join(args.dir, f"run-{os.getpid()}")
    kw = json.loads(args.ck_kw)
    chunk = 1 * MiB if args.tiny else 8 * MiB
    res = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv, "switch_interval_s": sys.getswitchinterval(), "state_bytes": nbytes, "tensors": len(state), "ck_kw": kw, "torch": torch.__version__}, "configs": []}
    if cuda:
        res["meta"]["gpu"] = torch.cuda.get_device_name(0)
    cap = staging_capacity(nbytes, chunk, args.staging_factor)
    res["meta"]["staging_capacity"] = cap
    cks = {"tiered": shmckpt.Checkpointer(root, keep_last=args.keep_last, **checkpointer_kw(kw, chunk_size=chunk, staging_capacity=cap))}
    compares = [json.loads(t) for t in args.compare_tuning or []]
    if compares:
        res["meta"]["compare_tuning"] = compares[0] if len(compares) == 1 else compares
    for i, fields in enumerate(compares):
        # A field with a leading underscore is the checkpointer's saver's attribute, not a
        # Tuning field: an A/B of its Python side (e.g. {"_early_snapshot": false}).
        saver = {k[1:]: v for k, v in fields.items() if k.startswith("_")}
        tuning = {"chunk_size": chunk, "staging_capacity": cap, **{k: v for k, v in fields.items() if not k.startswith("_")}}
        name = compare_name(i)
        cks[name] = shmckpt.Checkpointer(f"{root}-{name}", keep_last=args.keep_last, **checkpointer_kw(kw, **tuning))
        for k, v in saver.items():
            if not hasattr(cks[name]._saver, k):
                raise SystemExit(f"cadence_overhead: --compare-tuning {k!r}: the saver has no attribute {k[1:]!r}")
            setattr(cks[name]._saver, k, v)
    engines = {}
    opened = list(cks.values())  # every checkpointer, the engine condition's included
    if args.compare_engine:
        ek = shmckpt.Checkpointer(f"{root}-engine", keep_last=args.keep_last, **checkpointer_kw(kw, chunk_size=chunk, staging_capacity=cap))
        engines["engine"] = (ek._shared.engine, engine_entries(state))
        opened.append(ek)
    try:
        for ck in opened:
            if cuda:
                ck.prepare_cuda()
            if ck in cks.values():  # the engine's saves hold the streams themselves
                ck.guard(tr.opt)
            ck.save(0, state).wait()  # warm-up: the arena sized, first-file costs
        step_no = [0]
        for c in args.configs.split(","):
            step_ms, every, *snap = c.split(":")
            snapshot = snap[0] if snap else args.snapshot
            if snapshot not in ("none", "device"):
                raise SystemExit(f"cadence_overhead: snapshot {snapshot!r} in {c!r}: none or device")
            res["configs"].append(run_config(tr, state, cks, float(step_ms), int(every), snapshot, args, cuda, step_no, engines))
            for ck in cks.values():
                ck.flush()
    finally:
        for ck in opened:
            ck.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(f"{root}-engine", ignore_errors=True)
        for i in range(len(compares)):
            shutil.rmtree(f"{root}-{compare_name(i)}", ignore_errors=True)
    with open(os.path.join(out, "cadence.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = ["| step (target) | save every | snapshot | baseline mean | tiered mean | overhead median | mean [95 % CI] | stall median / p90 | staging median / p90 | saves (disk) | rounds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        labelled = [("", c)] + [(f" ({t})", c.get(compare_name(i))) for i, t in enumerate(args.compare_tuning or [])]
        for label, v in labelled + [(" (engine only)", c.get("engine")), (" (raw copy)", c.get("raw"))]:
            if v is None:
                continue
            ci = v["overhead_mean_ci95"]
            ci_s = f"[{ci[0] * 100:+.2f}, {ci[1] * 100:+.2f}] %" if ci else "-"
            # The raw copy makes no save call and stages nothing: "-".
            stall = "-" if v["stall_ms_median"] is None else f"{v['stall_ms_median']:.2f} / {v['stall_ms_p90']:.2f} ms"
            staging = "-" if v["staging_ms_median"] is None else f"{v['staging_ms_median']:.1f} / {v['staging_ms_p90']:.1f} ms"
            lines.append(
                f"| {c['step_ms_target']:.0f} ms | {c['every']}{' (called at the step end)' if c.get('call_at') == 'end' else ''} | {c['snapshot']}{label} | {c['baseline_mean_ms']:.1f} ms | {v['tiered_mean_ms']:.1f} ms | {v['overhead_median'] * 100:+.2f} % | {v['overhead_mean'] * 100:+.2f} % {ci_s} | {stall} | {staging} | {v['saves']} ({v['disk_saves']}) | {c['rounds']} |"
            )
    table = "\n".join(lines)
    with open(os.path.join(out, "cadence.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return res


if __name__ == "__main__":
    main()
