"""Part of train.py (the training-loop checkpoint benchmark; see its docstring and
README.md): measurement helpers: host memory sampling (process-tree RSS, /dev/shm, host
used), device memory snapshots, the raw disk limit and the pinned D2H reference copy."""

import collections
import concurrent.futures
import gc
import mmap
import os
import statistics
import threading
import time

from peers import now


# ----------------------------------------------------------------------------
# host / device memory
# ----------------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _children_map():
    kids = collections.defaultdict(list)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                s = f.read()
            ppid = int(s[s.rindex(b")") + 2 :].split()[1])
            kids[ppid].append(int(d))
        except Exception:
            pass
    return kids


def proc_tree(root):
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def rss_of(pids):
    tot = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                tot += int(f.read().split()[1]) * _PAGE
        except Exception:
            pass
    return tot


def host_used():
    vals = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                vals[k] = int(v.split()[0]) * 1024
        return vals["MemTotal"] - vals["MemAvailable"]
    except Exception:
        return None


def shm_used(path="/dev/shm"):
    try:
        st = os.statvfs(path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize
    except Exception:
        return None


class MemSampler:
    """Every `interval` s: summed RSS of this process and its descendants (the
    tree is re-listed every `relist` s), /dev/shm used, host used (MemTotal -
    MemAvailable).  mark() starts a window; window() returns its peaks and the
    values at mark() time."""

    def __init__(self, interval=0.1, relist=2.0):
        self.interval = interval
        self.relist = relist
        self.pid = os.getpid()
        self.pids = [self.pid]
        self.last_relist = 0.0
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        self.cur = self.sample()
        self.mark()
        self.th = threading.Thread(target=self._run, name="mem-sampler", daemon=True)

    def sample(self):
        t = time.monotonic()
        if t - self.last_relist > self.relist:
            try:
                self.pids = proc_tree(self.pid)
            except Exception:
                pass
            self.last_relist = t
        return {"rss_tree": rss_of(self.pids), "shm": shm_used(), "host_used": host_used(), "procs": len(self.pids)}

    def _run(self):
        while not self.stop_ev.wait(self.interval):
            s = self.sample()
            with self.lock:
                self.cur = s
                for k, v in s.items():
                    if v is not None and (self.peak.get(k) is None or v > self.peak[k]):
                        self.peak[k] = v

    def start(self):
        self.th.start()
        return self

    def mark(self):
        self.last_relist = 0.0
        s = self.sample()
        with self.lock:
            self.base = dict(s)
            self.peak = dict(s)

    def window(self):
        s = self.sample()
        with self.lock:
            for k, v in s.items():
                if v is not None and (self.peak.get(k) is None or v > self.peak[k]):
                    self.peak[k] = v
            out = {}
            for k in ("rss_tree", "shm", "host_used"):
                b, p = self.base.get(k), self.peak.get(k)
                out[f"{k}_start"] = b
                out[f"{k}_peak"] = p
                out[f"{k}_peak_delta"] = (p - b) if (p is not None and b is not None) else None
                out[f"{k}_end"] = s.get(k)
            out["max_procs"] = self.peak.get("procs")
        return out

    def stop(self):
        self.stop_ev.set()


def gpu_snapshot(cuda):
    if not cuda:
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "device_free": free,
        "device_used": total - free,
    }


# ----------------------------------------------------------------------------
# raw disk limit
# ----------------------------------------------------------------------------
def _open_direct(path):
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644), True
    except OSError:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), False


def raw_write(path, nbytes, inflight, chunk):
    """Writes nbytes (rounded up to 4 KiB) into a new file with O_DIRECT from a
    page-aligned mmap buffer, then fsync.  inflight == 1: one stream of
    sequential os.pwrite calls of `chunk` bytes; inflight > 1: a pool of
    `inflight` threads, each with one os.pwrite of `chunk` bytes at its own
    offset in flight (os.pwrite releases the GIL).  Falls back to buffered +
    fsync if O_DIRECT is refused (recorded)."""
    total = (nbytes + 4095) // 4096 * 4096
    chunk = min(chunk, total)
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(min(chunk, 1 << 20)) * (chunk // min(chunk, 1 << 20)) + b"\0" * (chunk % min(chunk, 1 << 20)))
    mv = memoryview(buf)
    fd, direct = _open_direct(path)
    offs = list(range(0, total, chunk))

    def one(off):
        n = min(chunk, total - off)
        if n % 4096 and direct:
            n = (n + 4095) // 4096 * 4096
        w = os.pwrite(fd, mv[:n], off)
        if w != n:
            raise OSError(f"short write at {off}: {w} of {n}")

    try:
        try:
            one(0)
        except OSError:
            if not direct:
                raise
            os.close(fd)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            direct = False
        os.ftruncate(fd, 0)
        t0 = now()
        if inflight <= 1:
            for off in offs:
                one(off)
        else:
            with concurrent.futures.ThreadPoolExecutor(inflight) as ex:
                list(ex.map(one, offs))
        tw = now() - t0
        os.fsync(fd)
        secs = now() - t0
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        mv.release()
        buf.close()
    return {"bytes": total, "inflight": inflight, "chunk": chunk, "seconds": secs, "write_s_before_fsync": tw, "gbps": total / secs / 1e9, "o_direct": direct}


def d2h_ref(state, repeats=3):
    """One pinned copy of the state: torch.empty(N, uint8, pin_memory=True),
    copy_(non_blocking=True) of every tensor's bytes into its slice, then
    torch.cuda.synchronize(); warmed once, median of `repeats`. The buffer is
    freed and torch's cached pinned blocks released afterwards."""
    import torch

    tensors = [t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8) for t in state.values()]
    n = sum(t.numel() for t in tensors)
    t0 = now()
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    alloc_s = now() - t0
    runs = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t = now()
        o = 0
        for x in tensors:
            dst[o : o + x.numel()].copy_(x, non_blocking=True)
            o += x.numel()
        torch.cuda.synchronize()
        runs.append(now() - t)
    del dst
    gc.collect()
    try:
        torch._C._host_emptyCache()
    except Exception:
        pass
    sec = statistics.median(runs[1:])
    return {"bytes": n, "pinned_alloc_s": alloc_s, "warm_s": runs[0], "runs_s": runs[1:], "seconds": sec, "gbps": n / sec / 1e9}
