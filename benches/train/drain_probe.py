#!/usr/bin/env python3
"""What slows training steps while a save drains (issue 24, item 1): a diagnostic
benchmark, ONE run, every condition alternated in the same process.

At short steps (50-60 ms) on the H200, every shmckpt variant, the blocking save included,
showed segments whose median step was 5-17 % slower than the baseline's while the writers
drained a save (GiBs of staging written with io_uring O_DIRECT, CRC-32C per tensor). This
script trains train.py's model (``train_model.Trainer``) and times every step (host wall
time with ``torch.cuda.synchronize()`` per step, plus the device time between two CUDA
events around the step, the host time until the step was queued, the thread's CPU time and
its context switches) in segments of equal length, one per condition, round after round
(order rotated and reversed every other round), each condition's load active during its
own segment only:

* ``baseline``: nothing in the background;
* ``shm``: a blocking ``Checkpointer.save`` right before the segment's first step, then
  training while its writers drain it (defaults: 2 writers, O_DIRECT);
* ``shm-w1``: the same with ``writer_threads=1``; ``shm-buffered``: ``direct_io=False``;
* ``shm-nb``: a non-blocking save under its Checkpointer's guard (the copy overlaps the
  first steps: the stream-ordered hold at ``opt.step``); ``shm-snap``: the same with
  ``snapshot="device"``; ``shm-snap1``: the same with the snapshot's device-to-device copies
  queued one per tensor (``SHMCKPT_BATCH_COPIES=0``), not in one ``cuMemcpyBatchAsync``;
* ``rawdisk``: another process writes the state's bytes to a file in the same directory
  with O_DIRECT from a page-aligned buffer (``train_measure.raw_write``: 16 x 8 MiB in
  flight, fsync, then the file is deleted), no shmckpt;
* ``rawdisk-thread``: the same writes from threads of the trainer's process (the engine's
  writers are threads of the trainer's process too);
* ``crc``: ``--load-threads`` threads of this process checksum the state's bytes
  (``zlib.crc32``, which releases the GIL, over 8 MiB pieces of a host buffer of that
  size), paced to spread over the drain's duration as the writers' CRC-32C is;
* ``membw``: ``--load-threads`` threads copy 64 MiB blocks between the two halves of that
  buffer (``np.copyto``, GIL released) for the drain's duration, as fast as they can;
* ``gil``: one Python thread wakes every 50 ms and runs 1 ms of pure-Python work.

The "drain's duration" is the median, so far, of the ``shm`` saves' time to committed.
Per segment it also records the ``/proc/pressure/{cpu,io,memory}`` deltas, the
``/proc/stat`` CPU time by state and this process's threads' CPU time by name. Once, in two
extra segments outside the statistics, ``nvidia-smi --query-gpu=timestamp,clocks.sm,
clocks.mem,power.draw,temperature.gpu -lms 100`` runs during a baseline and during a
``shm`` drain (clocks, power or thermal limits). The analysis (drain_report.py) gives per
condition: the median step with its 95 % CI, p90, the ratio to the baseline of the
adjacent rounds with a bootstrap CI over segments, the same split into the steps during
the load and after it, and the GPU-time and launch-time ratios (host-side vs device-side).

Outputs in ``--out``: drain.json (every step of every segment, the summary), drain.md
(tables), drain.log, nvidia-smi-*.csv.

H200 (one call, about 5 minutes; ``--budget-s`` bounds the rounds):
    python3 benches/train/drain_probe.py --out $OUT/drain
CPU smoke test (tiny model, 2 rounds, a few seconds):
    python3 benches/train/drain_probe.py --device cpu --tiny --out /tmp/drain
"""

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
import traceback
import zlib

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "common"))
sys.path.insert(0, _HERE)
import drain_report  # noqa: E402
from drain_loads import CrcLoad, GilLoad, MembwLoad, NoLoad, RawChild, RawThreadLoad, ShmLoad, delta, snapshot  # noqa: E402
from peers import elapsed, fs_type_of, log, now, set_log_file  # noqa: E402
from train_measure import shm_used  # noqa: E402
from train_model import GiB, MiB, SIZES, Trainer, med, state_nbytes, time_steps  # noqa: E402

CONDITIONS = ["baseline", "shm", "shm-w1", "shm-buffered", "shm-nb", "shm-snap", "shm-snap1", "rawdisk", "rawdisk-thread", "crc", "membw", "gil"]
SHM_VARIANTS = {"shm": {}, "shm-w1": {"writer_threads": 1}, "shm-buffered": {"direct_io": False}, "shm-nb": {}, "shm-snap": {}, "shm-snap1": {}}
#: Environment set while a variant's Checkpointer is made (read by the engine then):
#: ``shm-snap1`` queues the snapshot's copies one per tensor, not in one batch.
SHM_ENV = {"shm-snap1": {"SHMCKPT_BATCH_COPIES": "0"}}
#: How each variant saves (default: blocking); the non-blocking ones are guarded (their
#: own Checkpointer's guard on the optimizer: the copy overlaps the segment's first steps).
SAVE_MODES = {"shm-nb": {"blocking": False}, "shm-snap": {"blocking": False, "snapshot": "device"}, "shm-snap1": {"blocking": False, "snapshot": "device"}}
#: The default model: d 1536, 14 layers, 0.449 B parameters, 5.01 GiB of fp32 weights +
#: AdamW moments (the issue's 5.07 GiB runs); its batch is calibrated to --step-ms.
STATES = dict(SIZES, **{"5g": dict(d=1536, layers=14, heads=12, vocab=32768, seq=1024, batch=6)})
SMI_QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", default="cuda", choices=["cuda", "cpu"])
    a("--tiny", action="store_true", help="smoke test: tiny model, tiny staging, short segments, 2 rounds")
    a("--state", default="5g", choices=sorted(STATES), help="model size (train_model.SIZES plus 5g)")
    a("--batch", type=int, default=None, help="batch size (default: calibrated to --step-ms on CUDA)")
    a("--step-ms", type=float, default=55.0, help="target step length for the batch calibration")
    a("--conditions", default=",".join(CONDITIONS), help="comma list of " + ",".join(CONDITIONS) + " (baseline always runs)")
    a("--rounds", type=int, default=20, help="at most this many rounds (the budget usually stops earlier)")
    a("--budget-s", type=float, default=285.0, help="no round (nor the nvidia-smi segments) starts that would end past this many seconds of the run")
    a("--seg-factor", type=float, default=1.5, help="segment length / drain time of one shm save")
    a("--iters", type=int, default=None, help="steps per segment (default: from --seg-factor)")
    a("--min-iters", type=int, default=20)
    a("--max-iters", type=int, default=400)
    a("--skip-first", type=int, default=None, help="steps left out at each segment's start (default 2; tiny 1)")
    a("--load-threads", type=int, default=2, help="threads of the crc and membw loads (the engine's default writer count)")
    a("--raw-inflight", type=int, default=16)
    a("--raw-chunk-mib", type=int, default=8)
    a("--no-smi", action="store_true", help="skip the nvidia-smi capture")
    a("--sync", default="stream", choices=["stream", "device"], help="after each step wait for the trainer's stream (as loss.item() does; default) or for the whole device (torch.cuda.synchronize(): also for a checkpointer's background copies)")
    a("--guard", action="store_true", help="install the shm Checkpointer's guard on the optimizer (every segment runs its hook, as in train.py)")
    a("--dir", default="/var/tmp/drainprobe", help="parent of the run's own checkpoint directory (made and removed by the run)")
    a("--out", default=None, help="results directory (default $OUT/drain, else ./drain-out)")
    a("--shmckpt-path", default=None, help="directory prepended to sys.path before `import shmckpt`")
    a("--seed", type=int, default=1234)
    a("--reanalyze", default=None, help="only analyse this drain.json again (writes drain.md and the summary into --out)")
    args = p.parse_args(argv)
    if args.tiny:
        args.state = "tiny"
        args.rounds = min(args.rounds, 2)
        args.iters = args.iters or 5
    if args.skip_first is None:
        args.skip_first = 1 if args.tiny else 2
    return args


# ----------------------------------------------------------------------------
# segments
# ----------------------------------------------------------------------------
def run_segment(tr, cond, load, n_iters, rnd, events):
    """n_iters timed steps with `load` started right before the first; one row per step
    (drain_report.STEP_FIELDS): start (ms from the first step's start), wall, GPU (events),
    launch (host time until the step was queued), thread CPU, context switches."""
    ru, who = resource.getrusage, resource.RUSAGE_THREAD
    tr.sync()
    gc.collect()
    seg = {"round": rnd, "cond": cond, "n": n_iters, "ok": False}
    try:
        load.start()
        s0 = snapshot()
        seg["t_first_wall"] = time.time()
        t_first = now()
        rows = []
        for _ in range(n_iters):
            c0, r0 = time.thread_time(), ru(who)
            t0 = now()
            if events:
                events[0].record()
            tr.fwd_bwd()
            tr.step()
            tl = now()
            if events:
                events[1].record()
            tr.sync()
            t1 = now()
            c1, r1 = time.thread_time(), ru(who)
            g = events[0].elapsed_time(events[1]) if events else None
            rows.append([round((t0 - t_first) * 1e3, 3), round((t1 - t0) * 1e3, 4), None if g is None else round(g, 4), round((tl - t0) * 1e3, 4), round((c1 - c0) * 1e3, 4), r1.ru_nivcsw - r0.ru_nivcsw, r1.ru_nvcsw - r0.ru_nvcsw])
            load.poll()
        seg["sys"] = delta(s0, snapshot())
        rec = load.finish()
        seg["wait_after_s"] = now() - t_first - seg["sys"]["seconds"]
        for k in ("end_abs", "committed_abs", "poll_done_abs"):
            v = rec.pop(k, None)
            if v is not None:
                rec[k.replace("_abs", "_ms")] = round((v - t_first) * 1e3, 3)
        seg.update(load=rec, steps=rows, ok=True)
    except Exception as e:
        seg["error"] = f"{type(e).__name__}: {e}"
        seg["traceback"] = traceback.format_exc()
        log(f"  {cond}: FAILED {seg['error']}")
    return seg


def smi_capture(tr, name, load, n_iters, out_dir, events):
    """One extra segment with nvidia-smi sampling every 100 ms; its samples split at the
    load's end (the timestamps are the machine's local wall clock)."""
    path = os.path.join(out_dir, f"nvidia-smi-{name}.csv")
    with open(path, "w") as f:
        p = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits", "-lms", "100"], stdout=f, stderr=subprocess.STDOUT)
        time.sleep(0.5)
        wall0 = time.time()
        seg = run_segment(tr, f"smi:{name}", load, n_iters, -1, events)
        p.terminate()
        p.wait()
    seg["extra"] = "smi"
    end_ms = (seg.get("load") or {}).get("end_ms")
    fields = SMI_QUERY.split(",")[1:]
    vals = {k: [] for k in fields}
    during = {k: [] for k in fields}
    for line in open(path).read().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != len(fields) + 1:
            continue
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        rel_ms = (ts - seg.get("t_first_wall", wall0)) * 1e3
        for k, x in zip(fields, parts[1:]):
            try:
                v = float(x)
            except ValueError:  # "[N/A]", "[Not Supported]"
                continue
            vals[k].append(v)
            if end_ms is not None and 0 <= rel_ms < end_ms:
                during[k].append(v)

    def stat(xs):
        return {"median": med(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None

    walls = [r[1] for r in seg.get("steps", [])]
    cap = {"csv": os.path.basename(path), "samples": len(vals[fields[0]]), "step_median_ms": med(walls), "fields": {k: stat(v) for k, v in vals.items()}, "during_load": {k: stat(v) for k, v in during.items()}}
    return seg, cap


def open_checkpointers(args, want, state_bytes, run_dir, cuda, results, cks):
    """One Checkpointer per shm variant (own root, keep_last=1, staging = state + margin),
    registered with CUDA, put in `cks` as soon as made (a variant that cannot be opened is
    recorded in results["failed"] and left out)."""
    import shmckpt

    chunk = 1 * MiB if args.tiny else 8 * MiB
    cap = (state_bytes + chunk - 1) // chunk * chunk + (8 * chunk if args.tiny else 256 * MiB)
    for name in [v for v in SHM_VARIANTS if v in want]:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize < cap + (0 if args.tiny else GiB):
            results["failed"][name] = f"/dev/shm has {st.f_bavail * st.f_frsize / GiB:.1f} GiB free, needs {cap / GiB:.1f}"
            continue
        t = now()
        env = SHM_ENV.get(name, {})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            ck = shmckpt.Checkpointer(os.path.join(run_dir, name), keep_last=1, tuning=shmckpt.Tuning(staging_capacity=cap, chunk_size=chunk, **SHM_VARIANTS[name]))
        except Exception as e:
            results["failed"][name] = f"Checkpointer: {type(e).__name__}: {e}"
            log(f"  {name}: {results['failed'][name]}")
            continue
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        cks[name] = ck  # closed at the end whatever happens next
        opened = now() - t
        if cuda:
            ck.prepare_cuda()
        ck.wait_staging_ready()
        ready = now() - t
        results["meta"]["shmckpt_open"][name] = {"constructor_s": opened, "ready_s": ready, "staging_capacity": cap, "settings": SHM_VARIANTS[name]}
        log(f"  {name}: Checkpointer {SHM_VARIANTS[name] or 'defaults'} open in {opened:.2f}s, staging ready after {ready:.2f}s")


# ----------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------
class Run:
    """One run: the trainer, the state, the checkpointers and loads, the results."""

    def __init__(self, args, out_dir):
        self.args, self.out_dir = args, out_dir
        self.t_start = now()
        self.deadline = self.t_start + args.budget_s
        self.cuda = args.device == "cuda"
        self.results = {"meta": {}, "segments": [], "skipped": [], "failed": {}, "smi": {}}
        self.m = self.results["meta"]
        self.cks, self.raw_child, self.loads, self.drains = {}, None, {}, []
        self.run_dir = os.path.join(os.path.abspath(args.dir), f"run-{os.getpid()}")

    def drain_s(self):
        """The drain's duration: median time to committed of the shm saves so far."""
        return med(self.drains)

    def setup_model(self):
        """Build the trainer, warm it up, calibrate the batch (CUDA), time the step."""
        import torch

        args, m = self.args, self.m
        if self.cuda:
            torch.cuda.set_device(0)
            torch.backends.cuda.matmul.allow_tf32 = True
            m["gpu"] = torch.cuda.get_device_name(0)
        cfg = dict(STATES[args.state])
        t = now()
        self.tr = tr = Trainer(cfg, args.device, "auto", args.seed)  # tr.cfg is cfg
        tr.sync_mode = args.sync
        from sweep import calibrate

        time_steps(tr, 3)
        self.state = tr.build_state()
        if args.batch:
            cfg["batch"] = args.batch
        elif self.cuda:
            cal = calibrate(tr, [args.step_ms / 1e3], argparse.Namespace(batches=None, quick=False))
            cfg["batch"] = cal["chosen"][0]["batch"]
            m["calibration"] = cal
        time_steps(tr, 3)
        self.step_s = med(time_steps(tr, 10))
        m.update(model=dict(cfg), params=tr.params(), optimizer=tr.opt_mode, state_bytes=state_nbytes(self.state), tensors=len(self.state), step_s=self.step_s)
        log(f"model {cfg}: {m['params'] / 1e9:.3f} B params, state {m['state_bytes'] / GiB:.2f} GiB in {len(self.state)} tensors, step {self.step_s * 1e3:.1f} ms ({now() - t:.1f}s)")

    def setup_loads(self, conds):
        """Open the checkpointers (one warm-up save each: the drain estimate), start the
        rawdisk child, fill the host buffer of the crc and membw loads."""
        import numpy as np

        args, m, nbytes = self.args, self.m, self.m["state_bytes"]
        try:
            import shmckpt

            m["versions"]["shmckpt"] = getattr(shmckpt, "__version__", "?") + f" ({shmckpt.__file__})"
        except Exception as e:
            for v in SHM_VARIANTS:
                if v in conds:
                    self.results["failed"][v] = f"import shmckpt: {type(e).__name__}: {e}"
            log(f"shmckpt unavailable: {e!r}")
        else:
            open_checkpointers(args, conds, nbytes, self.run_dir, self.cuda, self.results, self.cks)
            if args.guard and "shm" in self.cks:
                self.cks["shm"].guard(self.tr.opt)  # its hook runs in every segment alike
            for name in SAVE_MODES:
                if name in self.cks:
                    self.cks[name].guard(self.tr.opt)
        steps = iter(range(1, 1 << 30))
        for name, ck in self.cks.items():  # warm-up: one untimed save each (first-file costs)
            self.tr.sync()
            t = now()
            rep = ck.save(next(steps), self.state).wait()
            log(f"  {name}: warm-up save {rep['bytes'] / GiB:.2f} GiB committed in {rep['committed']:.2f}s (call+wait {now() - t:.2f}s)")
            m.setdefault("warmup_committed_s", {})[name] = rep["committed"]
            if name == "shm":
                self.drains.append(rep["committed"])
        if not self.drains:  # no default shm variant: any warm-up, else 2 GB/s
            self.drains.append(next(iter(m.get("warmup_committed_s", {}).values()), nbytes / 2e9))
        self.loads = {"baseline": NoLoad()}
        for name, ck in self.cks.items():
            self.loads[name] = ShmLoad(ck, self.state, steps, **SAVE_MODES.get(name, {}))
        chunk = args.raw_chunk_mib * MiB
        if "rawdisk" in conds:
            try:
                self.raw_child = self.loads["rawdisk"] = RawChild(os.path.join(self.run_dir, "raw-child.bin"), nbytes, args.raw_inflight, chunk)
            except Exception as e:
                self.results["failed"]["rawdisk"] = repr(e)
        if "rawdisk-thread" in conds:
            self.loads["rawdisk-thread"] = RawThreadLoad(os.path.join(self.run_dir, "raw-thread.bin"), nbytes, args.raw_inflight, chunk)
        if "crc" in conds or "membw" in conds:
            t = now()
            buf = np.empty(nbytes, dtype=np.uint8)
            buf.fill(0x5A)  # touched: the loads never fault pages in
            log(f"  host load buffer {nbytes / GiB:.2f} GiB ready in {now() - t:.2f}s")
            self.loads["crc"] = CrcLoad(buf, args.load_threads, self.drain_s)
            self.loads["membw"] = MembwLoad(buf, args.load_threads, self.drain_s)
        self.loads["gil"] = GilLoad(self.drain_s)

    def rounds(self, conds, n_iters, events, reserve):
        """Every condition once per round (rotated, reversed every other round) while a
        whole round still fits the budget; the outputs are written after each round."""
        args, res = self.args, self.results
        others = [c for c in conds if c != "baseline"]
        round_est = len(conds) * (n_iters * self.step_s + 0.3) + self.drain_s()
        times = []
        for rnd in range(args.rounds):
            if rnd > 0 and now() + round_est + reserve > self.deadline:
                res["skipped"].append(f"rounds {rnd}..{args.rounds - 1} (budget: a round takes ~{round_est:.0f}s)")
                break
            k = rnd % len(others) if others else 0
            seq = ["baseline"] + others[k:] + others[:k]
            if rnd % 2:
                seq = seq[::-1]
            t_round = now()
            for c in seq:
                seg = run_segment(self.tr, c, self.loads[c], n_iters, rnd, events)
                res["segments"].append(seg)
                if not seg["ok"]:
                    res["failed"][c] = seg["error"]
                    continue
                ld = seg["load"]
                if c == "shm":
                    self.drains.append(ld["report"]["committed"])
                w = [r[1] for r in seg["steps"][args.skip_first :]]
                log(f"  round {rnd} {c:15s} median {med(w):8.2f} ms" + (f", load ended at {ld['end_ms'] / 1e3:.2f}s" if ld.get("end_ms") is not None else "") + (f", stall {ld['stall_s']:.3f}s" if "stall_s" in ld else ""))
            others = [c for c in others if c not in res["failed"]]
            times.append(now() - t_round)
            round_est = max(times)
            self.m["rounds_done"] = len(times)
            log(f"round {rnd} done in {times[-1]:.1f}s (+{now() - self.t_start:.0f}s of {args.budget_s:.0f}s)")
            write_outputs(res, self.out_dir)

    def smi(self, n_iters, events, reserve):
        """nvidia-smi during one extra baseline segment and one extra shm segment."""
        res = self.results
        res["smi"] = {"query": SMI_QUERY, "captures": {}}
        for c in ("baseline", "shm"):
            if now() + reserve / 2 > self.deadline + 5:
                res["skipped"].append(f"nvidia-smi {c} (budget)")
                continue
            seg, cap = smi_capture(self.tr, c, self.loads[c], n_iters, self.out_dir, events)
            res["segments"].append(seg)
            res["smi"]["captures"][c] = cap
            log(f"  nvidia-smi during {c}: {cap['samples']} samples, " + ", ".join(f"{k} {v['median']:.0f}" for k, v in cap["fields"].items() if v))

    def close(self):
        for name, ck in self.cks.items():
            t = now()
            try:
                ck.close()
            except Exception as e:
                log(f"  {name}: close: {e!r}")
            self.m.setdefault("close_s", {})[name] = now() - t
        if self.raw_child is not None:
            self.raw_child.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def main(argv=None):
    args = parse_args(argv)
    out_dir = args.out or (os.path.join(os.environ["OUT"], "drain") if os.environ.get("OUT") else "./drain-out")
    os.makedirs(out_dir, exist_ok=True)
    if args.reanalyze:
        with open(args.reanalyze) as f:
            return write_outputs(json.load(f), out_dir)
    want = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if [c for c in want if c not in CONDITIONS]:
        print(f"unknown conditions in {want}; known: {CONDITIONS}", file=sys.stderr)
        return 2
    set_log_file(open(os.path.join(out_dir, "drain.log"), "a"))
    run = Run(args, out_dir)
    log(f"drain_probe start argv={sys.argv[1:]} out={out_dir}")
    if args.shmckpt_path:
        sys.path.insert(0, os.path.abspath(args.shmckpt_path))
    import numpy as np
    import torch

    if args.tiny:
        torch.set_num_threads(1)  # the smoke test: no intra-op threads fighting for the CPUs
    if run.cuda and not torch.cuda.is_available():
        log("CUDA is not available; use --device cpu --tiny for the smoke test")
        return 2
    conds = ["baseline"] + [c for c in CONDITIONS if c in want and c != "baseline"]
    os.makedirs(run.run_dir)
    m = run.m
    m.update(
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        argv=sys.argv[1:],
        device=args.device,
        skip_first=args.skip_first,
        sync=args.sync,
        host=platform.node(),
        cpus=os.cpu_count(),
        affinity=len(os.sched_getaffinity(0)),
        kernel=platform.release(),
        ckpt_fs=fs_type_of(run.run_dir),
        shm_used_start=shm_used(),
        shmckpt_open={},
        load_threads=args.load_threads,
        raw={"inflight": args.raw_inflight, "chunk_mib": args.raw_chunk_mib},
        versions={"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "numpy": np.__version__, "zlib": zlib.ZLIB_RUNTIME_VERSION},
    )
    try:
        run.setup_model()
        run.setup_loads(conds)
        conds = m["conditions"] = [c for c in conds if c in run.loads]
        n_iters = m["seg_iters"] = args.iters or max(args.min_iters, min(args.max_iters, int(round(args.seg_factor * run.drain_s() / run.step_s))))
        events = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)] if run.cuda else None
        smi = shutil.which("nvidia-smi") if (run.cuda and not args.no_smi and "shm" in run.loads) else None
        reserve = 2 * (n_iters * run.step_s + run.drain_s()) + 2.0 if smi else 0.0
        log(f"segments of {n_iters} steps (~{n_iters * run.step_s:.1f}s; shm drain {run.drain_s():.2f}s); conditions {conds}; budget until +{args.budget_s:.0f}s")
        run.rounds(conds, n_iters, events, reserve)
        if smi:
            run.smi(n_iters, events, reserve)
        else:
            run.results["smi"] = {"why": "not on CUDA" if not run.cuda else ("--no-smi" if args.no_smi else ("no shm condition" if "shm" not in run.loads else "nvidia-smi not found"))}
    finally:
        run.close()
    m["wall_s"] = now() - run.t_start
    rc = write_outputs(run.results, out_dir)
    log(f"done in {m['wall_s']:.0f}s ({elapsed():.0f}s since import); {os.path.join(out_dir, 'drain.md')}")
    return rc


def write_outputs(results, out_dir, report=drain_report, name="drain"):
    """NAME.json (everything) and NAME.md (``report``'s tables, also printed at the end);
    ``report`` has ``summarize(results)`` and ``markdown(results)``."""
    report.summarize(results)
    tmp = os.path.join(out_dir, f"{name}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, default=repr)
    os.replace(tmp, os.path.join(out_dir, f"{name}.json"))
    md = report.markdown(results)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    if results["meta"].get("wall_s") is not None:
        print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
