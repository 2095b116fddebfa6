"""Part of drain_probe.py (issue 24: what slows training steps while a save drains): the
background conditions ("loads") and the system counters read around every segment.

A load's ``start()`` runs right before a segment's first step, ``poll()`` after every
step, ``finish()`` after the last step (untimed): it waits for the load to end and returns
its record, with ``end_abs`` (``time.perf_counter()``, the monotonic clock every process of
the machine shares) when the load ended. The ``rawdisk`` load's writer is this file run as
a child process:

    python3 drain_loads.py serve-raw PATH INFLIGHT CHUNK_BYTES

which prints ``ready``, then for each ``go N`` line on its input writes N bytes with
``train_measure.raw_write`` and prints one JSON record.
"""

import json
import os
import subprocess
import sys
import threading
import time
import zlib

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":
    sys.path.insert(0, os.path.join(_HERE, "..", "common"))
    sys.path.insert(0, _HERE)
from peers import now  # noqa: E402
from train_measure import raw_write  # noqa: E402
from train_model import MiB, med  # noqa: E402

CHUNK = 8 * MiB  # the engine's default chunk: the CRC load's piece
BLOCK = 64 * MiB  # the memory-bandwidth load's copy


# ----------------------------------------------------------------------------
# ----------------------------------------------------------------------------
# system counters
# ----------------------------------------------------------------------------
def read_psi():
    """{'<res>_<some|full>_us': total stall µs} from /proc/pressure (empty if absent)."""
    out = {}
    for res in ("cpu", "io", "memory"):
        try:
            with open(f"/proc/pressure/{res}") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts:
                kv = dict(x.split("=", 1) for x in parts[1:] if "=" in x)
                if "total" in kv:
                    out[f"{res}_{parts[0]}_us"] = int(kv["total"])
    return out


def read_cpu_ticks():
    """All CPUs' time by state (USER_HZ ticks), the first line of /proc/stat."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return {}
    names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]
    return dict(zip(names, (int(x) for x in parts[1:9])))


def snapshot():
    from gil_probe import thread_cpu

    return {"t": now(), "psi": read_psi(), "ticks": read_cpu_ticks(), "threads": thread_cpu()}


def delta(a, b):
    def d(x, y):
        return {k: y[k] - x[k] for k in y if k in x}

    th = {k: round(v, 3) for k, v in d(a["threads"], b["threads"]).items() if v > 0.001}
    return {"seconds": b["t"] - a["t"], "psi_us": d(a["psi"], b["psi"]), "cpu_ticks": d(a["ticks"], b["ticks"]), "threads_cpu_s": th}


# ----------------------------------------------------------------------------
# loads: start() right before a segment's first step, poll() after every step,
# finish() after the last (untimed) returns the record; end_abs = when the load ended
# ----------------------------------------------------------------------------
class NoLoad:
    def start(self):
        pass

    def poll(self):
        pass

    def finish(self):
        return {}


class ShmLoad(NoLoad):
    """A save (blocking by default; its stall, the call's time, is recorded), then its
    writers drain while training runs; h.done() is polled after every step as a training
    loop polls. `blocking=False` (with the Checkpointer's guard on the optimizer) overlaps
    the copy with the first steps; `snapshot` is passed to save()."""

    def __init__(self, ck, state, steps, blocking=True, snapshot=None):
        self.ck, self.state, self.steps = ck, state, steps
        self.kw = {} if blocking else {"blocking": False}
        if snapshot is not None:
            self.kw["snapshot"] = snapshot

    def start(self):
        self.t0 = now()
        self.h = self.ck.save(next(self.steps), self.state, **self.kw)
        self.stall = now() - self.t0
        self.polled = None

    def poll(self):
        if self.polled is None and self.h.done():
            self.polled = now()

    def finish(self):
        staged = self.h.wait_staged() or {}
        rep = self.h.wait()
        # A rank whose file was not the step's last reports no commit time (its report's
        # dir is None): its part of the save ended when its own file was durable.
        done_s = rep["committed"] if rep["committed"] is not None else rep["durable"]
        committed = self.t0 + done_s
        return {
            "stall_s": self.stall,
            # the end of the drain: done() first seen true (after the commit, the
            # retirement of the older step: one step's resolution), else the commit
            "end_abs": max(committed, self.polled or 0.0),
            "committed_abs": committed,
            "poll_done_abs": self.polled,
            "bytes": rep["bytes"],
            "gbps": rep["bytes"] / done_s / 1e9 if done_s else None,
            "report": {k: rep.get(k) for k in ("staging", "durable", "committed", "backend", "direct_io", "retired")},
            # the device snapshot's size, and whether its copies went in one driver call
            "snapshot": {k: staged.get(k) for k in ("snapshot_bytes", "snapshot_batched")},
        }


class RawChild(NoLoad):
    """The rawdisk writer: a child process (this file, serve-raw) that writes on "go"."""

    def __init__(self, path, nbytes, inflight, chunk):
        cmd = [sys.executable, os.path.abspath(__file__), "serve-raw", path, str(inflight), str(chunk)]
        self.nbytes = nbytes
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"rawdisk child did not start: {line!r}")

    def start(self):
        self.proc.stdin.write(f"go {self.nbytes}\n")
        self.proc.stdin.flush()

    def finish(self):
        line = self.proc.stdout.readline()
        r = json.loads(line)
        if "error" in r:
            raise RuntimeError("rawdisk child: " + r["error"])
        r["end_abs"] = r.pop("t_end")
        return r

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def serve_raw(path, inflight, chunk):
    """The child role: 'ready', then for each 'go N' line one raw_write of N bytes and one
    JSON line (its record, with t_end on the shared monotonic clock, after the unlink)."""
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            break
        t0 = now()
        try:
            r = raw_write(path, int(parts[1]), inflight, chunk)
        except Exception as e:
            r = {"error": repr(e)}
        r.update(t_start=t0, t_end=now())
        print(json.dumps(r), flush=True)
    return 0


class ThreadLoad(NoLoad):
    """Runs self.work(i) on `n` named threads; end_abs = when the last one ended."""

    name, n = "load", 1

    def start(self):
        self.t0 = now()
        self.ends, self.rec = [], {}
        self.ths = [threading.Thread(target=self._run, args=(i,), name=f"probe-{self.name}", daemon=True) for i in range(self.n)]
        for t in self.ths:
            t.start()

    def _run(self, i):
        try:
            self.work(i)
        except Exception as e:  # recorded, the segment goes on
            self.rec["error"] = repr(e)
        self.ends.append(now())

    def finish(self):
        for t in self.ths:
            t.join()
        if "error" in self.rec:
            raise RuntimeError(f"{self.name} load: {self.rec['error']}")
        return dict(self.rec, end_abs=max(self.ends))


class CrcLoad(ThreadLoad):
    """zlib.crc32 of every 8 MiB piece of the buffer, piece i not before t0 + i x pace."""

    name = "crc"

    def __init__(self, buf, threads, duration):
        self.buf, self.n, self.duration = memoryview(buf), threads, duration

    def start(self):
        self.pieces = list(range(0, len(self.buf), CHUNK))
        self.pace = self.duration() / max(1, len(self.pieces))
        self.lock = threading.Lock()
        super().start()

    def work(self, i):
        crc, nb = 0, 0
        for j in range(i, len(self.pieces), self.n):
            wait = self.t0 + j * self.pace - now()
            if wait > 0:
                time.sleep(wait)
            piece = self.buf[self.pieces[j] : self.pieces[j] + CHUNK]
            crc = zlib.crc32(piece, crc)
            nb += len(piece)
        with self.lock:
            self.rec["bytes"] = self.rec.get("bytes", 0) + nb
            self.rec["pace_s"] = self.pace * len(self.pieces)

    def finish(self):
        r = super().finish()
        r["gbps"] = r["bytes"] / (r["end_abs"] - self.t0) / 1e9
        return r


class MembwLoad(ThreadLoad):
    """np.copyto of 64 MiB blocks from the buffer's first half to its second, for the
    drain's duration, each thread its own blocks."""

    name = "membw"

    def __init__(self, arr, threads, duration):
        half = len(arr) // 2 // BLOCK * BLOCK or len(arr) // 2
        self.src, self.dst, self.n, self.duration = arr[:half], arr[half : 2 * half], threads, duration

    def start(self):
        self.until = now() + self.duration()
        self.lock = threading.Lock()
        super().start()

    def work(self, i):
        import numpy as np

        blk = min(BLOCK, len(self.src))
        offs = list(range(0, len(self.src) - blk + 1, blk))
        k, nb = i, 0
        while True:  # one block at least: a thread started after the deadline still loads
            o = offs[k % len(offs)]
            np.copyto(self.dst[o : o + blk], self.src[o : o + blk])
            nb += blk
            k += self.n
            if now() >= self.until:
                break
        with self.lock:
            self.rec["bytes"] = self.rec.get("bytes", 0) + nb

    def finish(self):
        r = super().finish()
        r["gbps"] = r["bytes"] / (r["end_abs"] - self.t0) / 1e9
        return r


class GilLoad(ThreadLoad):
    """One thread: every 50 ms, 1 ms of pure-Python work (holding the GIL), for the drain's
    duration (at least two periods); records how late each wake-up was."""

    name = "gil"

    def __init__(self, duration, period=0.05, work_s=0.001):
        self.duration, self.period, self.work_s = duration, period, work_s

    def work(self, i):
        until = self.t0 + max(self.duration(), 2 * self.period)
        late, nxt, x = [], self.t0, 0
        while True:
            nxt += self.period
            if nxt >= until:
                break
            w = nxt - now()
            if w > 0:
                time.sleep(w)
            t = now()
            late.append(t - nxt)
            while now() < t + self.work_s:
                x += 1
        late.sort()
        self.rec.update(wakes=len(late), late_ms_median=med(late) * 1e3 if late else None, late_ms_p99=late[int(0.99 * (len(late) - 1))] * 1e3 if late else None)


class RawThreadLoad(ThreadLoad):
    """The rawdisk writes from a thread of this process (raw_write's own thread pool)."""

    name = "rawdisk"

    def __init__(self, path, nbytes, inflight, chunk):
        self.path, self.nbytes, self.inflight, self.chunk = path, nbytes, inflight, chunk

    def work(self, i):
        self.rec.update(raw_write(self.path, self.nbytes, self.inflight, self.chunk))


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "serve-raw":
        sys.exit("usage: drain_loads.py serve-raw PATH INFLIGHT CHUNK_BYTES")
    sys.exit(serve_raw(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
