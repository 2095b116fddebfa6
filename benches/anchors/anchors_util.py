"""anchors: host memory sampling of the process tree and small helpers
(disk usage, rates, package grep, empty_cache counter, GPU memory, cleanup)."""

import gc
import importlib.util
import os
import shutil
import statistics
import threading


# ----------------------------------------------------------------------------
# host memory of the process tree
# ----------------------------------------------------------------------------
def _read_pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except Exception:
        return None
    return None


class TreeMemSampler:
    """Samples, every `interval` s, the summed RSS of this process and all its
    descendants; every `pss_every`-th sample it also re-lists the process tree
    and reads the summed PSS (smaps_rollup: shared pages split between the
    processes mapping them) and the host-wide used memory (MemTotal -
    MemAvailable: shared memory and pinned pages count, reclaimable page cache
    does not)."""

    def __init__(self, interval=0.05, pss_every=5):
        import psutil

        self.psutil = psutil
        self.interval = interval
        self.pss_every = pss_every
        self.root = psutil.Process()
        self.stop_ev = threading.Event()
        self.thread = None
        self.samples = 0
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_used = 0
        self.max_procs = 0
        self._proc_cache = None
        self.base_rss, self.base_pss, self.base_used = self._snapshot(full=True)

    def _procs(self, refresh):
        # the process list is rebuilt only on "full" samples (every pss_every
        # samples): walking /proc every 50 ms would steal GIL time from the
        # thread being measured
        if refresh or self._proc_cache is None:
            try:
                self._proc_cache = [self.root] + self.root.children(recursive=True)
            except Exception:
                self._proc_cache = [self.root]
        return self._proc_cache

    def _snapshot(self, full):
        procs = self._procs(full)
        self.max_procs = max(self.max_procs, len(procs))
        rss = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
            except Exception:
                pass
        pss = used = None
        if full:
            vals = [_read_pss(p.pid) for p in procs]
            if any(v is not None for v in vals):
                pss = sum(v for v in vals if v is not None)
            vm = self.psutil.virtual_memory()
            used = vm.total - vm.available
        return rss, pss, used

    def _run(self):
        while not self.stop_ev.is_set():
            full = self.samples % self.pss_every == 0
            rss, pss, used = self._snapshot(full)
            self.samples += 1
            self.peak_rss = max(self.peak_rss, rss)
            if pss is not None:
                self.peak_pss = max(self.peak_pss, pss)
            if used is not None:
                self.peak_used = max(self.peak_used, used)
            self.stop_ev.wait(self.interval)

    def start(self):
        self.thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)
        self.thread.start()
        return self

    def stop(self):
        self.stop_ev.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        rss, pss, used = self._snapshot(full=True)
        self.peak_rss = max(self.peak_rss, rss)
        if pss is not None:
            self.peak_pss = max(self.peak_pss, pss)
        if used is not None:
            self.peak_used = max(self.peak_used, used)
        return {
            "samples": self.samples,
            "max_procs_in_tree": self.max_procs,
            "baseline_rss_tree_bytes": self.base_rss,
            "peak_rss_tree_bytes": self.peak_rss,
            "peak_rss_tree_delta_bytes": self.peak_rss - self.base_rss,
            "baseline_pss_tree_bytes": self.base_pss,
            "peak_pss_tree_bytes": self.peak_pss or None,
            "peak_pss_tree_delta_bytes": (self.peak_pss - self.base_pss) if (self.peak_pss and self.base_pss) else None,
            "baseline_host_used_bytes": self.base_used,
            "peak_host_used_delta_bytes": (self.peak_used - self.base_used) if self.base_used else None,
        }


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def disk_usage_of(path):
    """(allocated bytes (st_blocks*512), apparent bytes, files) under path."""
    alloc = apparent = files = 0
    if not os.path.exists(path):
        return 0, 0, 0
    for root, _dirs, fnames in os.walk(path):
        for fn in fnames:
            try:
                st = os.lstat(os.path.join(root, fn))
            except OSError:
                continue
            alloc += st.st_blocks * 512
            apparent += st.st_size
            files += 1
    return alloc, apparent, files


def rmtree(path):
    shutil.rmtree(path, ignore_errors=True)


def gbps(nbytes, secs):
    if not secs or secs <= 0 or nbytes is None:
        return None
    return nbytes / secs / 1e9


def median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def grep_package(modname, needle):
    """file:line of every occurrence of `needle` in an installed package."""
    try:
        spec = importlib.util.find_spec(modname)
    except Exception:
        spec = None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or [])
    hits = []
    for root in roots:
        for d, _dirs, files in os.walk(root):
            for fn in files:
                if not fn.endswith(".py"):
                    continue
                p = os.path.join(d, fn)
                try:
                    with open(p, encoding="utf-8", errors="replace") as f:
                        for i, line in enumerate(f, 1):
                            if needle in line:
                                hits.append(f"{os.path.relpath(p, os.path.dirname(root))}:{i}: {line.strip()}")
                except Exception:
                    pass
    return hits


class EmptyCacheCounter:
    """Counts torch.cuda.empty_cache() calls made in this (the trainer) process
    while active. Calls inside the libraries' spawned workers are not seen."""

    def __init__(self):
        import torch

        self.torch = torch
        self.count = 0
        self.orig = None

    def __enter__(self):
        self.orig = self.torch.cuda.empty_cache

        def counted(*a, **k):
            self.count += 1
            return self.orig(*a, **k)

        self.torch.cuda.empty_cache = counted
        return self

    def __exit__(self, *exc):
        self.torch.cuda.empty_cache = self.orig
        return False


def gpu_mem(ctx):
    if not ctx.cuda:
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_bytes": torch.cuda.memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(),
        "device_free_bytes": free,
        "device_total_bytes": total,
        "device_used_bytes": total - free,
    }


def host_cleanup(ctx):
    """Between systems (outside every measurement): drop Python garbage, give
    back pinned blocks kept by torch's caching host allocator and unused CUDA
    cache blocks, so no system inherits another's buffers."""
    gc.collect()
    if ctx.cuda:
        import torch

        torch.cuda.synchronize()
        try:
            torch._C._host_emptyCache()
        except Exception:
            pass
        torch.cuda.empty_cache()
