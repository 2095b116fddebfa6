#!/usr/bin/env python3
"""Goodput under injected failures (issue 38, item 3): how much of the wall time a training
job keeps as progress when its trainer is killed at random, for several checkpoint systems.

goodput = (steps of progress x failure-free step time) / wall time

A supervisor (this script, like torchrun's elastic agent) launches the trainer
(``goodput_trainer.py``: a deterministic loop over a synthetic state of ``--size`` bytes,
steps of ``--step-ms``, a checkpoint every ``--every`` steps through the system under test,
a resume from the system's latest checkpoint at every start, checked bit for bit), SIGKILLs
its process group after exponential random running times of mean ``MTBF / --time-scale``
and restarts it at once, until the run's budget is spent; then it stops the trainer with
SIGTERM (it finishes its step and closes the system). One run per (system, MTBF); every
system sees the same sequence of failure times for a given MTBF (one seed). A baseline run
without checkpoints and failures measures the failure-free step time first.

``--restart warm`` (default ``cold``: a new process per failure, as torchrun's agent does):
the supervisor keeps one spare trainer started ahead (``goodput_trainer.py --spare``: its
interpreter, imports, CUDA context and optimizer warm-up done, blocked reading stdin); at a
kill it waits for the killed group's leader to exit, sends the spare ``go <life>`` (it goes
on from the system's open) and starts the next spare at once. The first life of a run is a
cold start; the baseline has no spare; every system gets the same launcher. On CUDA the
baseline trainer reads the device's free memory without and with a ready spare beside it.

The failure clock runs while the trainer trains: it starts at the end of each life's first
step, so every kill interrupts training and every restart is measured whole (a real job
also fails during restarts; at a real MTBF of minutes against restarts of seconds that is
rare, and the model below is first order in 1 / MTBF anyway).

Reported per system and MTBF: the goodput measured at the scaled MTBF, and the model-based
goodput ``1 - overhead - (E[lost] + E[restart]) / MTBF`` at the scaled and at the real MTBF,
from the components measured over the system's runs (goodput_report.py says how each is
measured): per restart the process start, imports, CUDA init, open and load; per kill the
steps lost; per save the call, the stall and the time to durable.

H200 (one call, ~8 minutes; every system available there):
    python3 benches/goodput/goodput.py --preset h200 --out $OUT/goodput.json --plot $OUT/goodput.png
CPU smoke test (seconds per system, most of it importing torch; add --restart warm for the
spare):
    PYTHONPATH=python python3 benches/goodput/goodput.py --preset cpu-tiny --out /tmp/goodput.json
"""

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import goodput_report  # noqa: E402

TRAINER = os.path.join(_HERE, "goodput_trainer.py")
ALL_SYSTEMS = ["shm", "shm-tiered", "torch", "dcp", "nvrx"]

PRESETS = {
    # One H200: 4 GiB of fp32 GPU tensors, 186 ms steps, a checkpoint every 30 steps (5.6 s);
    # real MTBFs of 30 and 5 minutes injected 60 x faster (30 s and 5 s of running time);
    # the whole call within --budget-s (the runs share what the baseline leaves).
    "h200": dict(device="cuda", size="4GiB", tensors=8, step_ms=186.0, every=30, mtbf="30m,5m", time_scale=60.0,
                 budget_s=450.0, run_s=None, min_kills=0, min_resumes=0, baseline_steps=40, life_timeout_s=180.0, dir="/var/tmp/goodput"),
    # CI on 2 cores: 1 MiB of CPU tensors, 20 ms steps, a checkpoint every 5 steps; one MTBF
    # (30 min scaled 1800 x: 1 s), each run 1.5 s of running and at least one kill and one
    # resume from a checkpoint (a kill before the first save restarts from scratch).
    "cpu-tiny": dict(device="cpu", size="1MiB", tensors=4, step_ms=20.0, every=5, mtbf="30m", time_scale=1800.0,
                     budget_s=None, run_s=1.5, min_kills=1, min_resumes=1, baseline_steps=15, life_timeout_s=120.0, dir=None),
}


def parse_size(s):
    s = str(s).strip()
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return int(float(s[: -len(u)]) * units[u])
    return int(s)


def parse_duration(s):
    """'30m', '5m', '1h', '90s' or plain seconds."""
    s = str(s).strip()
    mult = {"h": 3600.0, "m": 60.0, "s": 1.0}
    if s and s[-1] in mult:
        return float(s[:-1]) * mult[s[-1]]
    return float(s)


def log(msg):
    print(f"[goodput {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", flush=True)


class Tail:
    """The new complete JSON lines of an append-only file."""

    def __init__(self, path):
        self.path, self.pos, self.buf = path, 0, b""

    def read(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(x) for x in lines if x.strip()]


def killpg(p, sig):
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


class Spare:
    """A trainer started ahead of a failure (``--restart warm``): the life's command with
    ``--spare``, in its own process group, stdin a pipe (``go <life>``), spare-ready read
    from a pipe of its own (one JSON line: its times and host memory)."""

    def __init__(self, cmd, logf):
        r, w = os.pipe()
        self.spawn_t = time.monotonic()
        try:
            self.p = subprocess.Popen(cmd + ["--spare", "--ready-fd", str(w)], stdout=logf, stderr=subprocess.STDOUT,
                                      stdin=subprocess.PIPE, pass_fds=(w,), start_new_session=True)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        os.set_blocking(r, False)
        self.rfd, self.buf, self.ready, self.go_t, self.life = r, b"", None, None, None

    def poll_ready(self):
        """The spare-ready line once it came (a dict), else None."""
        while self.ready is None and self.rfd is not None:
            try:
                data = os.read(self.rfd, 4096)
            except BlockingIOError:
                break
            if data:
                self.buf += data
                if b"\n" in self.buf:
                    self.ready = json.loads(self.buf.split(b"\n", 1)[0])
            if not data or self.ready is not None:  # EOF (exited) or read
                os.close(self.rfd)
                self.rfd = None
        return self.ready

    def go(self, life):
        """Sends ``go <life>`` (the spare proceeds at once, or once it is ready); returns
        whether it was ready when sent."""
        ready = self.poll_ready() is not None
        self.go_t, self.life = time.monotonic(), life
        self.p.stdin.write(f"go {life}\n".encode())
        self.p.stdin.flush()
        self.p.stdin.close()
        return ready

    def record(self):
        """What the run records of it: spawned, ready (its line), sent go, the life it became."""
        self.poll_ready()
        if self.rfd is not None:
            os.close(self.rfd)
            self.rfd = None
        return {"spawn_t": self.spawn_t, "ready": self.ready, "go_t": self.go_t, "life": self.life, "pid": self.p.pid}

    def kill(self):
        """SIGKILL to its process group, reaped, its pipes closed."""
        killpg(self.p, signal.SIGKILL)
        self.p.wait()
        if self.p.stdin is not None and not self.p.stdin.closed:
            try:
                self.p.stdin.close()
            except BrokenPipeError:
                pass
        if self.rfd is not None:
            os.close(self.rfd)
            self.rfd = None


class Supervisor:
    def __init__(self, a, work):
        self.a, self.work = a, work
        self.calib = os.path.join(work, "calib.json")

    def cmd(self, system, root, events, life, steps=0, probe=False, meter=False):
        a = self.a
        c = [sys.executable, TRAINER, "--system", system, "--root", root, "--events", events, "--life", str(life),
             "--device", a.device, "--size-bytes", str(a.size_bytes), "--tensors", str(a.tensors), "--step-ms", str(a.step_ms),
             "--every", str(a.every), "--calib", self.calib]
        if steps:
            c += ["--steps", str(steps)]
        if probe:
            c.append("--probe")
        if meter:
            c.append("--meter")
        return c

    def spawn(self, cmd, logf, stdin=subprocess.DEVNULL):
        t = time.monotonic()
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=stdin, start_new_session=True)
        return p, t

    def baseline(self):
        """No checkpoint, no failure: the failure-free step time, the calibration of the
        step's busy part, and which systems this environment can run."""
        root = os.path.join(self.work, "baseline")
        events = os.path.join(self.work, "events-baseline.jsonl")
        logp = os.path.join(self.work, "trainer-baseline.log")
        meter = self.a.restart == "warm" and self.a.device == "cuda"
        gpu = None
        with open(logp, "ab") as lf:
            cmd = self.cmd("none", root, events, 0, steps=self.a.baseline_steps, probe=True, meter=meter)
            p, _ = self.spawn(cmd, lf, stdin=subprocess.PIPE if meter else subprocess.DEVNULL)
            try:
                if meter:
                    gpu = self.spare_memory(p, root, events, lf)
                rc = p.wait(timeout=self.a.life_timeout_s + 60)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            except RuntimeError as e:
                rc = str(e)
            finally:
                if p.poll() is None:
                    killpg(p, signal.SIGKILL)
                    p.wait()
                if p.stdin is not None and not p.stdin.closed:
                    p.stdin.close()
        evs = Tail(events).read()
        shutil.rmtree(root, ignore_errors=True)
        if rc != 0:
            raise SystemExit(f"baseline trainer failed ({rc}): {tail_of(logp)}")
        steps = [e for e in evs if e["e"] == "s"]
        dts = [e["dt"] for e in steps[3:]] or [e["dt"] for e in steps]
        probe = next(e for e in evs if e["e"] == "probe")
        cal = next((e for e in evs if e["e"] == "calib"), None)
        return {"t0_s": sum(dts) / len(dts), "t0_median_s": sorted(dts)[len(dts) // 2], "steps": len(steps), "probe": probe, "calib": cal,
                "spare_gpu": gpu}

    def spare_memory(self, p, root, events, lf):
        """The device memory a ready spare holds, counted by the driver: the baseline
        trainer ``p`` (its state on the GPU, its steps done) reads the device's free memory
        (``mem_get_info``: every process) with no spare alive, then again once a spare
        (of the system ``none``: the systems' imports allocate nothing on the device) is
        ready beside it. The spare is killed and reaped before this returns."""
        tail, mems = Tail(events), []
        deadline = time.monotonic() + self.a.life_timeout_s + 60

        def wait_for(done, what):
            while not done():
                if p.poll() is not None:
                    raise RuntimeError(f"exited with status {p.returncode} {what}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out {what}")
                mems.extend(e for e in tail.read() if e["e"] == "mem")
                time.sleep(0.01)

        wait_for(lambda: len(mems) >= 1, "before its memory reading without a spare")
        spare = Spare(self.cmd("none", root, events, -1), lf)
        try:
            wait_for(lambda: spare.poll_ready() is not None or spare.p.poll() is not None, "while a spare started")
            if spare.ready is None:
                raise RuntimeError(f"its spare exited with status {spare.p.returncode} before it was ready")
            p.stdin.write(b"spare ready\n")
            p.stdin.flush()
            wait_for(lambda: len(mems) >= 2, "before its memory reading with a spare")
        finally:
            spare.kill()
        without, with_ = mems[0], mems[1]
        return {"free_without_spare": without["free"], "free_with_spare": with_["free"], "total": without["total"],
                "bytes": without["free"] - with_["free"], "spare_ready": spare.ready}

    def run(self, system, mtbf_real, mtbf_idx, run_s):
        """One run: lives of the trainer, killed at exponential running times, until
        ``run_s`` seconds after the first step and ``--min-kills`` kills. ``--restart
        warm``: a spare is started with the first life and after every go; at a kill it is
        sent go and becomes the next life."""
        a = self.a
        warm = a.restart == "warm"
        mtbf = mtbf_real / a.time_scale
        tag = f"{system}-{int(mtbf_real)}"
        root = os.path.join(self.work, tag)
        shutil.rmtree(root, ignore_errors=True)
        events = os.path.join(self.work, f"events-{tag}.jsonl")
        if os.path.exists(events):
            os.remove(events)
        logp = os.path.join(self.work, f"trainer-{tag}.log")
        rng = random.Random(a.seed * 1000 + mtbf_idx)  # the same failure times for every system
        tail = Tail(events)
        evs, lives, spares = [], [], []
        rec = {"system": system, "restart": a.restart, "mtbf_real_s": mtbf_real, "mtbf_scaled_s": mtbf, "run_s": run_s,
               "lives": lives, "events": evs}
        t_start = next_kill = None
        kills = resumes = 0
        lf = open(logp, "ab")
        shm_before = shm_entries()
        t_begin = time.monotonic()

        def new_life():
            p, t = self.spawn(self.cmd(system, root, events, len(lives)), lf)
            lives.append({"life": len(lives), "spawn_t": t, "pid": p.pid, "kill_t": None, "_p": p, "_first": None})

        def new_spare():
            spares.append(Spare(self.cmd(system, root, events, -1), lf))

        def spare_life():
            """The spare becomes the next life (sent go), and a new spare starts at once."""
            sp = spares[-1]
            try:
                ready = sp.go(len(lives))
            except BrokenPipeError:
                raise RuntimeError(f"the spare exited with status {sp.p.wait()} before go: {tail_of(logp)}") from None
            lives.append({"life": len(lives), "spawn_t": sp.spawn_t, "go_t": sp.go_t, "spare": True, "ready_at_go": ready,
                          "pid": sp.p.pid, "kill_t": None, "_p": sp.p, "_first": None})
            new_spare()

        new_life()
        if warm:
            new_spare()
        try:
            while True:
                for e in tail.read():
                    evs.append(e)
                    if e["e"] == "s" and lives[e["life"]]["_first"] is None:
                        lives[e["life"]]["_first"] = e["t"]
                    if e["e"] == "resume" and not e["ok"]:
                        raise RuntimeError(f"life {e['life']}: resume of step {e['k']} is not bit-exact: {e['why']}")
                    if e["e"] == "resume" and not e["fresh"]:
                        resumes += 1
                    if e["e"] == "error":
                        raise RuntimeError(f"life {e['life']}: trainer error in {e['where']}: {e['tb'].strip().splitlines()[-1]}")
                cur = lives[-1]
                p = cur["_p"]
                now = time.monotonic()
                if p.poll() is not None:
                    raise RuntimeError(f"life {cur['life']} exited with status {p.returncode}: {tail_of(logp)}")
                if warm and spares[-1].p.poll() is not None:
                    raise RuntimeError(f"the spare exited with status {spares[-1].p.returncode}: {tail_of(logp)}")
                if cur["_first"] is None:
                    if now - cur.get("go_t", cur["spawn_t"]) > a.life_timeout_s:
                        raise RuntimeError(f"life {cur['life']} took no step in {a.life_timeout_s:g} s: {tail_of(logp)}")
                    time.sleep(0.005)
                    continue
                if t_start is None:
                    t_start = cur["_first"]
                if next_kill is None:
                    next_kill = cur["_first"] + rng.expovariate(1.0 / mtbf)
                over = now >= t_start + run_s
                enough = kills >= a.min_kills and resumes >= a.min_resumes
                if over and (enough or now >= t_start + run_s + a.life_timeout_s):
                    break
                if now >= next_kill:
                    cur["kill_t"] = time.monotonic()
                    killpg(p, signal.SIGKILL)
                    p.wait()  # detection: the group's leader has exited
                    kills += 1
                    next_kill = None
                    if warm:
                        spare_life()
                    else:
                        new_life()
                    continue
                time.sleep(0.005)
            if warm:
                spares[-1].kill()  # the run's last spare: never used
            self.stop(cur, rec, tail, evs, logp)
        except RuntimeError as e:
            rec["error"] = str(e)
            log(f"  {tag}: FAILED: {e}")
            for lv in lives:
                killpg(lv["_p"], signal.SIGKILL)
                lv["_p"].wait()
            evs.extend(tail.read())
        finally:
            # no process outlives its run, whatever ended it
            for sp in spares:
                if sp.life is None:
                    sp.kill()
            for lv in lives:
                if lv["_p"].poll() is None:
                    killpg(lv["_p"], signal.SIGKILL)
                    lv["_p"].wait()
            lf.close()
        rec["seconds"] = time.monotonic() - t_begin
        rec["kills"] = kills
        rec["resumes"] = resumes
        for lv in lives:
            lv["rc"] = lv.pop("_p").returncode
            lv.pop("_first")
        if warm:
            rec["spares"] = [sp.record() for sp in spares]
            rec["spares_not_ready"] = sum(not lv["ready_at_go"] for lv in lives if lv.get("spare"))
        rec["shm_left"], rec["shm_kept"] = cleanup_shm(evs)
        # recorded, not removed: on a shared machine other jobs' segments appear here too
        rec["shm_new"] = sorted(shm_entries() - shm_before)
        shutil.rmtree(root, ignore_errors=True)
        return rec

    def stop(self, cur, rec, tail, evs, logp):
        """The end of the run: SIGTERM, the trainer ends its step and closes the system."""
        a = self.a
        cur["stop_t"] = time.monotonic()
        try:
            os.kill(cur["_p"].pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # it exited just now: its status says how, below
        try:
            cur["_p"].wait(timeout=max(60.0, a.life_timeout_s))
        except subprocess.TimeoutExpired:
            rec["close_timeout"] = True
        killpg(cur["_p"], signal.SIGKILL)  # whatever the trainer left (workers)
        cur["_p"].wait()
        evs.extend(tail.read())
        stop = next((e for e in evs if e["e"] == "stop" and e["life"] == cur["life"]), None)
        if stop is not None and not stop["ok"]:
            raise RuntimeError(f"life {cur['life']}: the state after step {stop['k']} is wrong: {stop['why']}")
        if cur["_p"].returncode != 0 and not rec.get("close_timeout"):
            raise RuntimeError(f"the last life exited with status {cur['_p'].returncode} after SIGTERM: {tail_of(logp)}")


def cleanup_shm(events):
    """Remove the shmckpt segments the run's lives reported that are still in /dev/shm (a
    staging segment of a killed life is recovered and removed by the next open; the last
    life closes its own; a kept arena of flash restore, ``shmckpt.keep-*``, outlives every
    life by design). Returns (the staging segments that were left: a leak, the kept arenas
    removed)."""
    left, kept = [], []
    for e in events:
        name = (e.get("info") or {}).get("shm_name") if e["e"] == "resume" else None
        if name and os.path.exists(os.path.join("/dev/shm", name)):
            (kept if name.startswith("shmckpt.keep-") else left).append(name)
            try:
                os.remove(os.path.join("/dev/shm", name))
            except OSError:
                pass
    return sorted(set(left)), sorted(set(kept))


def shm_entries():
    try:
        return {x for x in os.listdir("/dev/shm") if x.startswith("shmckpt")}
    except OSError:
        return set()


def tail_of(path, n=1500):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma-separated, of {ALL_SYSTEMS} (unavailable ones are skipped with the reason)")
    ap.add_argument("--mtbf", help="real MTBFs, comma-separated (30m, 5m, 1h, seconds)")
    ap.add_argument("--time-scale", type=float, help="real MTBF / injected MTBF")
    ap.add_argument("--size", help="state bytes (4GiB, 1MiB)")
    ap.add_argument("--tensors", type=int)
    ap.add_argument("--step-ms", type=float, help="failure-free step time to emulate (e.g. 57 or 186)")
    ap.add_argument("--every", type=int, help="checkpoint every N steps (shm-tiered: every step)")
    ap.add_argument("--device", choices=["cuda", "cpu"])
    ap.add_argument("--budget-s", type=float, help="wall seconds for the whole call: the runs share what the baseline leaves")
    ap.add_argument("--run-s", type=float, help="running seconds per (system, MTBF) run (instead of --budget-s)")
    ap.add_argument("--min-kills", type=int, help="a run goes on until this many kills")
    ap.add_argument("--min-resumes", type=int, help="... and this many resumes from a checkpoint")
    ap.add_argument("--baseline-steps", type=int)
    ap.add_argument("--life-timeout-s", type=float)
    ap.add_argument("--restart", choices=["cold", "warm"], default="cold",
                    help="cold: a new trainer process per failure (torchrun's agent); warm: a spare started ahead is sent go")
    ap.add_argument("--seed", type=int, default=38)
    ap.add_argument("--dir", help="where checkpoints are written (a run-<pid> directory in it, removed at the end)")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--plot", help="PNG of the goodputs (needs matplotlib)")
    a = ap.parse_args()
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.size_bytes = parse_size(a.size)
    mtbfs = [parse_duration(x) for x in a.mtbf.split(",") if x.strip()]
    t_call = time.monotonic()
    base = a.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=base)
    sup = Supervisor(a, work)
    log(f"preset {a.preset}: {a.size_bytes / 2**30:.3f} GiB in {a.tensors} tensors on {a.device}, {a.step_ms:g} ms steps, "
        f"every {a.every}, MTBF {mtbfs} s real / {a.time_scale:g}, restart {a.restart}; work dir {work}")
    result = {"meta": {}, "runs": [], "skipped": {}}
    try:
        bl = sup.baseline()
        probe = bl["probe"]
        wanted = [s.strip() for s in a.systems.split(",") if s.strip()]
        systems = []
        for s in wanted:
            why = probe["systems"].get(s, f"unknown system (known: {ALL_SYSTEMS})")
            if why is None:
                systems.append(s)
            else:
                result["skipped"][s] = why
                log(f"skipping {s}: {why}")
        result["meta"] = {
            "preset": a.preset, "device": a.device, "size_bytes": a.size_bytes, "tensors": a.tensors, "step_ms": a.step_ms,
            "every": a.every, "every_of": {"shm-tiered": 1}, "time_scale": a.time_scale, "mtbf_real_s": mtbfs,
            "mtbf_scaled_s": [m / a.time_scale for m in mtbfs], "seed": a.seed, "systems": systems, "t0_s": bl["t0_s"],
            "t0_median_s": bl["t0_median_s"], "baseline_steps": bl["steps"], "calib": bl["calib"], "torch": probe["torch"],
            "python": probe["python"], "gpu": probe["gpu"], "dir": work, "min_kills": a.min_kills, "min_resumes": a.min_resumes,
            "host": platform.node(), "cpus": os.cpu_count(), "argv": sys.argv[1:], "budget_s": a.budget_s, "run_s": a.run_s,
            "restart": a.restart,
        }
        log(f"baseline: T0 {bl['t0_s'] * 1e3:.2f} ms (median {bl['t0_median_s'] * 1e3:.2f}) over {bl['steps']} steps; "
            f"calibration {bl['calib']}; systems {systems}")
        if bl["spare_gpu"] is not None:
            g = result["meta"]["spare_gpu"] = bl["spare_gpu"]
            log(f"a ready spare holds {g['bytes'] / 2**20:.0f} MiB of device memory (the driver's count: free "
                f"{g['free_without_spare'] / 2**30:.2f} GiB without it, {g['free_with_spare'] / 2**30:.2f} GiB with it, of {g['total'] / 2**30:.2f})")
        plan = []
        for j, m in enumerate(mtbfs):
            order = systems if j % 2 == 0 else systems[::-1]
            plan += [(s, m, j) for s in order]
        overhead_est = 10.0 if a.device == "cuda" else 6.0
        for n, (s, m, j) in enumerate(plan):
            if a.run_s is not None:
                run_s = a.run_s
            else:
                left = a.budget_s - (time.monotonic() - t_call)
                run_s = max(5.0, left / (len(plan) - n) - overhead_est)
            log(f"run {n + 1}/{len(plan)}: {s}, MTBF {m / 60:g} min real = {m / a.time_scale:.3g} s injected, {run_s:.1f} s of running")
            rec = sup.run(s, m, j, run_s)
            result["runs"].append(rec)
            if not rec.get("error"):
                overhead_est = max(overhead_est * 0.5, rec["seconds"] - run_s)
            spare = f", the spare not ready at {rec['spares_not_ready']} of them" if a.restart == "warm" else ""
            log(f"  {s}: {rec['kills']} kills{spare}, {rec['resumes']} resumes from a checkpoint, {rec['seconds']:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["meta"]["wall_s"] = time.monotonic() - t_call
    goodput_report.summarize(result)
    text = goodput_report.table(result)
    print(text, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    md = os.path.splitext(a.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(text + "\n")
    log(f"wrote {a.out} and {md}")
    if a.plot:
        why = goodput_report.plot(result, a.plot)
        log(why if why else f"wrote {a.plot}")
    failed = [r for r in result["runs"] if r.get("error")] + [
        v for s in result["summary"].values() for r in s["runs"] for v in r["violations"]
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
