#!/usr/bin/env python3
"""What replication costs a training loop (issue 25: "training overhead with replication
on, at the disk-bound interval, goal <= 1 % at 137 ms steps").

The launcher (the default role) starts two processes over gloo on 127.0.0.1, two simulated
machines of one ``torch.distributed`` world:

* rank 0, the **trainer** (``--role trainer``, node "m0"): ``train_model.Trainer`` (the model
  of ``benches/train/drain_probe.py``, ``--state`` 5g or 8g, its batch calibrated to
  ``--step-ms``) on ``--device``, every step timed as drain_probe times it;
* rank 1, the **partner** (``--role partner``, node "m1"): it never trains; it holds a CPU
  state of the trainer's byte size (``replica_bench.make_state``: seeded float32 pieces)
  and saves it whenever the trainer saves, with the same step, so that the step commits
  (one shared root: a step is committed once every rank's file is durable) and the
  replication, collective over its own gloo group, runs in lockstep.

Each rank opens one ``Checkpointer`` per checkpoint condition, in the same order (building
one with ``replicas=1`` is collective), each its own root under ``--dir``, ``keep_last=1``,
``keep_in_memory=True``, staging = the state plus a margin:

* ``baseline``: no save;
* ``nb``: ``replicas=0``: the trainer's non-blocking save under its Checkpointer's guard
  (``guard(opt)``, as drain_probe's ``shm-nb``: the copy overlaps the first steps), then
  training while both ranks' files drain to the one disk;
* ``nb-repl``: the same with ``replicas=1`` (``replica_bandwidth`` default 1 GiB/s,
  ``--replica-bandwidth``): after the save is durable each rank reads its committed file and
  sends it to its partner's ``/dev/shm``, where it is CRC-checked (k-safe), in the
  background; a thread of the trainer waits in ``wait_replicated()`` and notes when it
  returned (the trainer's loop is never blocked by it).

Conditions alternate by segments (every condition once per round, the order rotated and
reversed every other round), each load active in its own segment only. At a segment's
start the trainer sends the partner a command (the condition and the step; -1 ends) on the
default group; both ranks call ``save(step, state, blocking=False)``; the partner then
waits for its save (``wait()``, and ``wait_replicated()``) and sends back its times, which
the trainer receives after the segment's last step (untimed). One warm-up save per
checkpointer measures how long its load lasts (save to durable; save to k-safe); a
condition's segment is ``--seg-factor`` times that, in steps, within ``--min-iters`` and
``--max-iters``; the baseline's is the shortest of the others'. ``--budget-s`` (counted
from the launcher's start) stops starting rounds that would not finish in it.

Per condition (``repl_report.py``): the median step with its 95 % CI and the ratio to the
baseline of the adjacent rounds (all steps; steps during the load; for nb-repl the steps
between durable and k-safe); the cost per checkpoint (the save call plus the extra wall
time of the first ``--skip-first`` steps over the baseline, as drain_probe reports it); the
extra time of every step while the load ran; times to durable and to k-safe; and the
overhead at the disk-bound interval: checkpoints as often as the condition's load allows
without queueing (nb: the time to durable; nb-repl: the time to k-safe, since replication
reads each file back from the same disk and sends it after the save is durable).

Outputs in ``--out``: repl.json (every step of every segment, every load's record, the
partner's, the summary), repl.md (the tables), repl.log.

H200 (one GPU; see benches/replicas/README.md for the carried wheel):
    python3 benches/replicas/repl_overhead.py --state 5g --budget-s 220 --out $OUT/replovh
CPU smoke test (tiny model, 2 rounds, well under a minute):
    python3 benches/replicas/repl_overhead.py --device cpu --tiny --out /tmp/replovh
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
for _d in (os.path.join(_HERE, "..", "common"), os.path.join(_HERE, "..", "train"), _HERE):
    if _d not in sys.path:
        sys.path.insert(0, _d)
import drain_probe  # noqa: E402
import repl_report  # noqa: E402
from drain_loads import NoLoad, ShmLoad  # noqa: E402
from peers import elapsed, free_port, fs_type_of, log, now, set_log_file  # noqa: E402
from train_model import GiB, MiB, med  # noqa: E402

CONDITIONS = ["baseline", "nb", "nb-repl"]
#: replicas of each checkpoint condition's Checkpointer (opened in this order on both ranks)
REPLICAS = {"nb": 0, "nb-repl": 1}
NODES = ("m0", "m1")
#: the partner's record of one save: ok, its call's seconds, save to durable, save to
#: k-safe (-1: none), k_safe (0/1), its call's start (perf_counter: one clock per machine)
PARTNER_FIELDS = ["ok", "call_s", "durable_s", "ksafe_s", "k_safe", "t0"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", default="cuda", choices=["cuda", "cpu"], help="the trainer's device (the partner is always on the CPU)")
    a("--tiny", action="store_true", help="smoke test: tiny model, tiny staging, 6 steps per segment, 2 rounds")
    a("--state", default="5g", choices=sorted(drain_probe.STATES), help="model size (5g: 5.01 GiB of state, 8g: 8.18 GiB)")
    a("--batch", type=int, default=None, help="batch size (default: calibrated to --step-ms on CUDA)")
    a("--step-ms", type=float, default=137.0, help="target step length for the batch calibration")
    a("--conditions", default=",".join(CONDITIONS), help="comma list of " + ",".join(CONDITIONS) + " (baseline always runs)")
    a("--rounds", type=int, default=20, help="at most this many rounds (the budget usually stops earlier)")
    a("--budget-s", type=float, default=220.0, help="no round starts that would end (with the closing) past this many seconds from the launcher's start")
    a("--seg-factor", type=float, default=1.25, help="a condition's segment / its warm-up load's duration (save to durable; to k-safe)")
    a("--iters", type=int, default=None, help="steps per segment, every condition (default: from --seg-factor)")
    a("--min-iters", type=int, default=20)
    a("--max-iters", type=int, default=600)
    a("--skip-first", type=int, default=None, help="steps left out of the step statistics at each segment's start: the cost per checkpoint's steps (default 2; tiny 1)")
    a("--sync", default="stream", choices=["stream", "device"], help="after each step wait for the trainer's stream (default) or the whole device")
    a("--snapshot", action="store_true", help="the trainer's saves take a device snapshot (save(..., snapshot='device'))")
    a("--replica-bandwidth", default="default", help="replica_bandwidth of nb-repl: 'default' (the library's, 1 GiB/s), 'none' (unbounded) or bytes/s")
    a("--timeout", type=float, default=300.0, help="seconds any collective waits (the default group's timeout and replica_timeout)")
    a("--dir", default="/var/tmp/replovh", help="parent of the run's checkpoint roots (made and removed by the run; local disk)")
    a("--out", default=None, help="results directory (default $OUT/replovh, else ./replovh-out)")
    a("--seed", type=int, default=1234)
    a("--reanalyze", default=None, help="only analyse this repl.json again (writes repl.md and the summary into --out)")
    a("--role", default="launch", choices=["launch", "trainer", "partner"], help=argparse.SUPPRESS)
    a("--port", type=int, default=0, help=argparse.SUPPRESS)
    a("--run-dir", default=None, help=argparse.SUPPRESS)
    a("--launch-t0", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.state = "tiny"
        args.rounds = min(args.rounds, 2)
        args.iters = args.iters or 6
    if args.skip_first is None:
        args.skip_first = 1 if args.tiny else 2
    want = [c.strip() for c in args.conditions.split(",") if c.strip()]
    bad = [c for c in want if c not in CONDITIONS]
    if bad:
        p.error(f"unknown conditions {bad}; known: {CONDITIONS}")
    args.conds = ["baseline"] + [c for c in CONDITIONS[1:] if c in want]
    args.out = args.out or (os.path.join(os.environ["OUT"], "replovh") if os.environ.get("OUT") else "./replovh-out")
    return args


def replica_bandwidth(arg):
    """``--replica-bandwidth`` as ``shmckpt.Replicas`` keywords (``default``: none)."""
    if arg == "default":
        return {}
    return {"bandwidth": None if arg == "none" else float(arg)}


def staging_for(nbytes, tiny):
    """(staging capacity, chunk size) of every Checkpointer of the run (drain_probe's)."""
    chunk = 1 * MiB if tiny else 8 * MiB
    return (nbytes + chunk - 1) // chunk * chunk + (8 * chunk if tiny else 256 * MiB), chunk


def open_checkpointers(args, nbytes, rank):
    """This rank's Checkpointer of every checkpoint condition, in CONDITIONS order (collective:
    each constructor ends in a barrier; replicas=1 also gathers the nodes)."""
    import shmckpt

    cap, chunk = staging_for(nbytes, args.tiny)
    cks = {}
    for name in [c for c in args.conds if c in REPLICAS]:
        kw = dict(keep_in_memory=True, keep_last=1, tuning=shmckpt.Tuning(staging_capacity=cap, chunk_size=chunk))
        if REPLICAS[name]:
            kw["replicas"] = shmckpt.Replicas(
                k=REPLICAS[name], node=NODES[rank], timeout=args.timeout, **replica_bandwidth(args.replica_bandwidth)
            )
        t = now()
        cks[name] = shmckpt.Checkpointer(os.path.join(args.run_dir, name), **kw)
        log(f"  rank {rank} {name}: Checkpointer open in {now() - t:.2f}s (staging {cap / GiB:.2f} GiB)")
    return cks


def room_problem(args, nbytes):
    """Why /dev/shm or the disk cannot hold the run (None if they can): per rank one
    staging arena per condition (kept in memory), with nb-repl two replicas per rank while
    the newer one arrives; on disk one step per root, two in the root being saved."""
    ncks = len([c for c in args.conds if c in REPLICAS])
    cap, _ = staging_for(nbytes, args.tiny)
    shm = 2 * ncks * cap + (4 * nbytes if "nb-repl" in args.conds else 0)
    disk = 2 * (ncks + 1) * nbytes
    margin = 0 if args.tiny else GiB
    for what, path, need in (("/dev/shm", "/dev/shm", shm), ("the checkpoint disk", args.run_dir, disk)):
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        if free < need + margin:
            return f"{what} ({path}) has {free / GiB:.1f} GiB free, the run needs {(need + margin) / GiB:.1f} GiB"
    return None


# ----------------------------------------------------------------------------
# the trainer's loads
# ----------------------------------------------------------------------------
class PeerSave(ShmLoad):
    """One checkpoint condition's load on the trainer: the command to the partner (before
    the save's clock starts), the trainer's non-blocking save (its call's time is the
    stall), ``done()`` polled after every step, and with replicas a thread waiting in
    ``wait_replicated()`` (k-safe noted when it returns). ``finish()`` (after the segment)
    waits for durable and k-safe and receives the partner's record."""

    def __init__(self, ck, state, steps, index, link, replicated, snapshot):
        super().__init__(ck, state, steps, blocking=False, snapshot="device" if snapshot else None)
        self.index, self.link, self.replicated = index, link, replicated

    def start(self):
        self.step = next(self.steps)
        self.link.command(self.index, self.step)
        self.t0 = now()
        self.h = self.ck.save(self.step, self.state, **self.kw)
        self.stall = now() - self.t0
        self.polled = None
        self.ksafe_abs, self.rep, self.err, self.watch = None, None, None, None
        if self.replicated:
            self.watch = threading.Thread(target=self._watch, name="bench-ksafe", daemon=True)
            self.watch.start()

    def _watch(self):
        try:
            self.rep = self.h.wait_replicated()
        except Exception as e:  # reported by finish(); the segment fails
            self.err = f"{type(e).__name__}: {e}"
        self.ksafe_abs = now()

    def finish(self):
        try:
            rec = super().finish()
            if self.watch is not None:
                self.watch.join()
        finally:
            peer = self.link.record()  # lockstep: the partner sends it whatever happened here
        rec.update(step=self.step, durable_s=rec["committed_abs"] - self.t0, partner=peer)
        rec["partner"]["start_lag_s"] = peer["t0"] - self.t0
        if self.replicated:
            if self.err is not None:
                raise RuntimeError(f"step {self.step}: wait_replicated: {self.err}")
            rec["ksafe_s"] = self.ksafe_abs - self.t0
            # The load ends at k-safe (wait_replicated() returned), not when a step's
            # poll of done() (durable) happened to see the commit, which can come later.
            rec["end_abs"] = max(rec["committed_abs"], self.ksafe_abs)
            rec["replication"] = {k: self.rep.get(k) for k in ("k_safe", "holders", "seconds", "bytes_sent", "transfer_seconds", "bandwidth", "problems", "phases")}
        rec["end_s"] = rec["end_abs"] - self.t0
        if not peer["ok"]:
            raise RuntimeError(f"step {self.step}: the partner's save failed (see its log)")
        return rec


class Link:
    """The trainer's side of the command channel (the default group)."""

    def __init__(self, dist, torch):
        self.dist, self.torch = dist, torch

    def command(self, index, step):
        self.dist.send(self.torch.tensor([index, step], dtype=self.torch.int64), dst=1)

    def record(self):
        t = self.torch.zeros(len(PARTNER_FIELDS), dtype=self.torch.float64)
        self.dist.recv(t, src=1)
        r = dict(zip(PARTNER_FIELDS, t.tolist()))
        r["ok"], r["k_safe"] = bool(r["ok"]), bool(r["k_safe"])
        if r["ksafe_s"] < 0:
            r["ksafe_s"] = None
        return r


# ----------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------
def segment_iters(args, warm_s, step_s):
    """Steps per segment of each condition: --iters, else --seg-factor x its warm-up load's
    seconds in steps, within [--min-iters, --max-iters]; the baseline's: the shortest."""
    if args.iters:
        return {c: args.iters for c in args.conds}
    it = {c: max(args.min_iters, min(args.max_iters, int(round(args.seg_factor * warm_s[c] / step_s)))) for c in warm_s}
    it["baseline"] = min(it.values()) if it else args.min_iters
    return {c: it[c] for c in args.conds}


class ReplRun(drain_probe.Run):
    """drain_probe's run (its model setup and results layout) with the partner's loads."""

    def __init__(self, args, dist, torch):
        super().__init__(args, args.out)
        self.run_dir = args.run_dir
        self.deadline = (args.launch_t0 or self.t_start) + args.budget_s
        self.dist, self.link = dist, Link(dist, torch)
        self.warm = {}

    def setup_loads(self, conds):
        """Open the checkpointers (guarded, registered with CUDA), one warm-up save each
        (its load's duration sizes the segments)."""
        import shmckpt

        self.m["versions"]["shmckpt"] = getattr(shmckpt, "__version__", "?") + f" ({shmckpt.__file__})"
        self.cks.update(open_checkpointers(self.args, self.m["state_bytes"], 0))
        # what the run puts in /dev/shm (removed by the launcher): kept arenas, replicas
        self.m["shm"] = {n: {"kept": ck.shm_name, "replica_tag": shmckpt._shmckpt.replica_tag(ck.root)} for n, ck in self.cks.items()}
        steps = iter(range(1, 1 << 30))
        self.loads = {"baseline": NoLoad()}
        for name, ck in self.cks.items():
            if self.cuda:
                ck.prepare_cuda()
            ck.wait_staging_ready()
            ck.guard(self.tr.opt)
            self.loads[name] = PeerSave(ck, self.state, steps, conds.index(name), self.link, REPLICAS[name] > 0, self.args.snapshot)
        for name in self.cks:
            ld = self.loads[name]
            self.tr.sync()
            ld.start()
            rec = ld.finish()
            self.warm[name] = rec["end_s"]
            self.m.setdefault("warmup", {})[name] = rec
            log(f"  {name}: warm-up save durable after {rec['durable_s']:.2f}s" + (f", k-safe after {rec['ksafe_s']:.2f}s" if "ksafe_s" in rec else ""))

    def reserve_s(self):
        """Seconds kept for the closing (checkpointers, arenas, the roots' files: deleting
        GiBs on a discard-mounted disk takes seconds)."""
        return 5.0 + 2.0 * self.m["state_bytes"] / GiB

    def rounds(self, conds, iters, events):
        """Every condition once per round (rotated, reversed every other round) while a
        whole round still fits the budget; the outputs are written after each round."""
        args, res = self.args, self.results
        others = conds[1:]
        round_est = sum(iters[c] * self.step_s + 0.5 for c in conds)
        times = []
        for rnd in range(args.rounds):
            left = self.deadline - now() - self.reserve_s()
            if rnd > 0 and round_est > left:
                res["skipped"].append(f"rounds {rnd}..{args.rounds - 1} (budget: a round takes ~{round_est:.0f}s, {max(0.0, left):.0f}s left)")
                break
            k = rnd % len(others) if others else 0
            seq = ["baseline"] + others[k:] + others[:k]
            if rnd % 2:
                seq = seq[::-1]
            t_round = now()
            for c in seq:
                seg = drain_probe.run_segment(self.tr, c, self.loads[c], iters[c], rnd, events)
                res["segments"].append(seg)
                if not seg["ok"]:
                    res["failed"][c] = seg["error"]
                    raise RuntimeError(f"round {rnd} {c}: {seg['error']}")  # the partner's lockstep is lost
                ld = seg["load"]
                w = [r[1] for r in seg["steps"][args.skip_first :]]
                msg = f"  round {rnd} {c:8s} {iters[c]:4d} steps, median {med(w):8.2f} ms"
                if ld:
                    msg += f", call {ld['stall_s'] * 1e3:.1f} ms, durable {ld['durable_s']:.2f}s"
                    msg += f", k-safe {ld['ksafe_s']:.2f}s" if "ksafe_s" in ld else ""
                    msg += f" (partner {ld['partner']['durable_s']:.2f}s" + (f" / {ld['partner']['ksafe_s']:.2f}s)" if ld["partner"]["ksafe_s"] else ")")
                log(msg)
            times.append(now() - t_round)
            round_est = max(times)
            self.m["rounds_done"] = len(times)
            log(f"round {rnd} done in {times[-1]:.1f}s (+{now() - self.t_start:.0f}s; deadline in {self.deadline - now():.0f}s)")
            write_outputs(res, self.out_dir)

    def close(self):
        for name, ck in self.cks.items():
            t = now()
            try:
                ck.close()
            except Exception as e:
                log(f"  {name}: close: {e!r}")
            self.m.setdefault("close_s", {})[name] = now() - t


def trainer_main(args):
    import numpy as np
    import torch
    import torch.distributed as dist

    if args.tiny:
        torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    set_log_file(open(os.path.join(args.out, "repl.log"), "a"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=2, timeout=datetime.timedelta(seconds=args.timeout))
    run = ReplRun(args, dist, torch)
    m = run.m
    m.update(
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        argv=sys.argv[1:],
        device=args.device,
        skip_first=args.skip_first,
        sync=args.sync,
        snapshot=args.snapshot,
        replica_bandwidth=args.replica_bandwidth,
        host=platform.node(),
        cpus=os.cpu_count(),
        kernel=platform.release(),
        ckpt_fs=fs_type_of(args.run_dir),
        versions={"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "numpy": np.__version__},
        conditions=args.conds,
    )
    nbytes = torch.zeros(1, dtype=torch.int64)
    try:
        if run.cuda and not torch.cuda.is_available():
            raise SystemExit("CUDA is not available; use --device cpu --tiny for the smoke test")
        run.setup_model()
        why = room_problem(args, m["state_bytes"])
        if why:
            raise SystemExit(why)
    except BaseException:
        dist.broadcast(nbytes, src=0)  # 0: the partner stops before it opens anything
        raise
    nbytes[0] = (m["state_bytes"] + 3) // 4 * 4
    dist.broadcast(nbytes, src=0)
    try:
        run.setup_loads(args.conds)
        iters = m["seg_iters"] = segment_iters(args, run.warm, run.step_s)
        events = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)] if run.cuda else None
        log(f"segments (steps): {iters}, ~{sum(iters.values()) * run.step_s:.0f}s a round; deadline in {run.deadline - now():.0f}s")
        run.rounds(args.conds, iters, events)
    except BaseException as e:
        abandon(run, e, lambda: dist.isend(torch.tensor([-1, 0], dtype=torch.int64), dst=1))
    run.link.command(-1, 0)
    run.close()
    dist.barrier()
    dist.destroy_process_group()
    m["wall_s"] = now() - run.t_start
    write_outputs(run.results, args.out)
    log(f"done in {m['wall_s']:.0f}s ({elapsed():.0f}s since import); {os.path.join(args.out, 'repl.md')}")
    return 0


def abandon(run, exc, stop_partner):
    """A failure once the checkpointers are open: record it, tell the partner to stop
    without waiting (it may be inside a collective), and leave at once (exit status 1):
    closing a replicating Checkpointer waits for a replication that the failed peer may
    never finish (up to the group's timeout). The launcher removes the files and arenas."""
    run.results["failed"]["run"] = f"{type(exc).__name__}: {exc}"
    log(f"FAILED: {run.results['failed']['run']}\n{traceback.format_exc()}")
    try:
        write_outputs(run.results, run.out_dir)
    except Exception as e2:
        log(f"(outputs not written: {e2!r})")
    try:
        stop_partner()
        time.sleep(1.0)
    finally:
        sys.stdout.flush()
        os._exit(1)


# ----------------------------------------------------------------------------
# the partner
# ----------------------------------------------------------------------------
def partner_main(args):
    import torch
    import torch.distributed as dist

    from replica_bench import make_state

    torch.set_num_threads(1 if args.tiny else 4)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=1, world_size=2, timeout=datetime.timedelta(seconds=args.timeout))
    nbytes = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(nbytes, src=0)
    if int(nbytes[0]) == 0:
        dist.destroy_process_group()
        return 0
    names, cmd = args.conds, torch.zeros(2, dtype=torch.int64)
    try:
        state = make_state(1, int(nbytes[0]))
        cks = open_checkpointers(args, int(nbytes[0]), 1)
        for ck in cks.values():
            ck.wait_staging_ready()
        while True:
            dist.recv(cmd, src=0)
            index, step = int(cmd[0]), int(cmd[1])
            if index < 0:
                break
            name = names[index]
            rec = dict.fromkeys(PARTNER_FIELDS, 0.0)
            rec["ksafe_s"] = -1.0
            t0 = rec["t0"] = now()
            try:
                h = cks[name].save(step, state, blocking=False)
                rec["call_s"] = now() - t0
                h.wait()
                rec["durable_s"] = now() - t0
                if REPLICAS[name]:
                    r = h.wait_replicated()
                    rec["ksafe_s"], rec["k_safe"] = now() - t0, float(bool(r["k_safe"]))
                rec["ok"] = 1.0
            except Exception as e:  # reported to the trainer (ok 0); the run stops there
                log(f"partner: step {step} ({name}): {type(e).__name__}: {e}")
            dist.send(torch.tensor([rec[k] for k in PARTNER_FIELDS], dtype=torch.float64), dst=0)
    except BaseException as e:  # the trainer died or failed: leave at once (see abandon)
        log(f"partner: FAILED: {type(e).__name__}: {e}")
        sys.stdout.flush()
        os._exit(1)
    for ck in cks.values():
        ck.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------
# the launcher
# ----------------------------------------------------------------------------
def remove_run(run_dir):
    """Remove the run's roots, and the kept arenas and replicas of them in /dev/shm
    (exact names: ``peers_bench.remove_shm_of``)."""
    from peers_bench import remove_shm_of

    for name in REPLICAS:
        remove_shm_of(os.path.join(run_dir, name))
    shutil.rmtree(run_dir, ignore_errors=True)


def launch(args, argv):
    t0 = now()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.dir, exist_ok=True)
    run_dir = os.path.join(os.path.abspath(args.dir), f"run-{os.getpid()}")
    os.makedirs(run_dir)
    base = [sys.executable, os.path.abspath(__file__)] + list(argv) + ["--port", str(free_port()), "--run-dir", run_dir, "--launch-t0", repr(t0)]
    procs = []
    try:
        procs = [subprocess.Popen(base + ["--role", role]) for role in ("trainer", "partner")]
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now()
            if failed_at is not None and now() - failed_at > 30:
                for p in procs:
                    if p.poll() is None:
                        p.kill()  # its peer died: it would wait for the group's timeout
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        remove_run(run_dir)
    codes = [p.returncode for p in procs]
    print(f"repl_overhead: {now() - t0:.0f} s from the launcher's start to the roots removed (--budget-s {args.budget_s:.0f})", flush=True)
    if any(codes):
        print(f"repl_overhead: a rank failed: exit codes (trainer, partner) {codes}", file=sys.stderr)
        return 1
    return 0


def write_outputs(results, out_dir):
    """repl.json (everything) and repl.md (the tables, printed at the end of a run)."""
    return drain_probe.write_outputs(results, out_dir, report=repl_report, name="repl")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.reanalyze:
        os.makedirs(args.out, exist_ok=True)
        with open(args.reanalyze) as f:
            return write_outputs(json.load(f), args.out)
    if args.role == "trainer":
        return trainer_main(args)
    if args.role == "partner":
        return partner_main(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
