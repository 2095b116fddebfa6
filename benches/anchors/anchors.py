#!/usr/bin/env python3
"""Head-to-head checkpoint benchmark ("anchors") for shmckpt.

Saves the same GPU state to the same disk with
  torch        torch.save (synchronous) + os.fsync of the file
  dcp          torch.distributed.checkpoint.async_save, PROCESS checkpointer,
               DefaultStager(StagingOptions(pinned, shared, async, non_blocking))
  nvrx         NVRx TorchAsyncCheckpoint (persistent worker) + os.fsync of the file
  nvrx-fswa    NVRx FileSystemWriterAsync + AsyncCallsQueue (persistent worker),
               with use_cpu_shm_for_gpu_tensors when the installed NVRx has it
  shmckpt-shm  `shmckpt bench --mode shm`  (separate process, its own GPU tensors)
  shmckpt-ipc  `shmckpt bench --mode ipc`
and measures the two physical limits of the same bytes on the same machine:
the raw O_DIRECT sequential write + fsync, and the plain pinned D2H copy.
See README.md next to this file for the meaning of every number.

The script spawns processes (DCP's writer process, NVRx's worker, a
multiprocessing Manager): everything that runs is under the __main__ guard, and
the module top level only defines things, because spawned children re-import
this file as __mp_main__.
"""

import argparse
import datetime
import gc
import importlib.util
import inspect
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from functools import partial

# --device cpu smoke test only: NVRx calls torch.cuda.synchronize() on the
# trainer side *and* inside its spawned worker; with no GPU that raises.  The
# worker re-imports this module (spawn start method), so patching here, keyed
# on an environment variable that main() sets, reaches the worker too.
if os.environ.get("ANCHORS_CPU_SMOKE") == "1":
    try:
        import torch as _t

        _t.cuda.synchronize = lambda *a, **k: None
    except Exception:  # pragma: no cover
        pass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from peers import (  # noqa: E402  (benches/common/peers.py, shared by the drivers)
    elapsed,
    free_port,
    fs_type_of,
    fsync_path,
    log,
    now,
    nvrx_close,
    pkg_version,
    raise_nofile,
    set_log_file,
)

GiB = 1 << 30
MiB = 1 << 20

# ----------------------------------------------------------------------------
# logging
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# deterministic content generator (shared with shmckpt's `bench --source ...`)
# ----------------------------------------------------------------------------
M64 = (1 << 64) - 1
SEED_BASE = 0x5348_4D43_4B50_5400  # "SHMCKPT\0"
SPLITMIX_KNOWN = {0: 0xE220A8397B1DCDAF, 1: 0x910A2DEC89025CC1}


def splitmix64_int(x):
    """Reference splitmix64 on Python ints (mod 2^64)."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def seed_word(k, seed=0):
    """seed_word(k) = (0x5348_4D43_4B50_5400 ^ (k << 32)) mod 2^64, seed 0 only."""
    if seed != 0:
        raise NotImplementedError("only seed 0 is specified")
    return (SEED_BASE ^ (k << 32)) & M64


def splitmix64_np(x):
    import numpy as np

    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def expected_bytes(k, nbytes):
    """Bytes of tensor k (0-based, layout order): little-endian u64 words
    w_j = splitmix64(seed_word(k) + j), j = 0, 1, ..., truncated to nbytes.
    Returns a numpy uint8 array of length nbytes."""
    import numpy as np

    nwords = (nbytes + 7) // 8
    with np.errstate(over="ignore"):
        x = np.arange(nwords, dtype=np.uint64) + np.uint64(seed_word(k))
        w = splitmix64_np(x)
    return w.astype("<u8", copy=False).view(np.uint8)[:nbytes]


def _expected_bytes_int(k, nbytes):
    out = bytearray()
    j = 0
    while len(out) < nbytes:
        out += splitmix64_int((seed_word(k) + j) & M64).to_bytes(8, "little")
        j += 1
    return bytes(out[:nbytes])


def selftest_generator():
    """Checks the generator against the known constants and a pure-int
    reference. Returns a dict; 'ok' is False on any mismatch."""
    import numpy as np

    res = {"ok": True, "checks": []}

    def check(name, got, want):
        ok = got == want
        res["checks"].append({"name": name, "ok": ok, "got": str(got), "want": str(want)})
        if not ok:
            res["ok"] = False

    for x, want in SPLITMIX_KNOWN.items():
        check(f"splitmix64_int({x})", hex(splitmix64_int(x)), hex(want))
        got = int(splitmix64_np(np.array([x], dtype=np.uint64))[0])
        check(f"splitmix64_np({x})", hex(got), hex(want))
    # wrap-around of x + golden ratio and of seed_word + j
    for x in (M64, M64 - 5, 1 << 63, 0x123456789ABCDEF0):
        got = int(splitmix64_np(np.array([x], dtype=np.uint64))[0])
        check(f"splitmix64_np(0x{x:x}) == int", hex(got), hex(splitmix64_int(x)))
    for k in (0, 1, 7, 999, 0xFFFFFFFF):
        for n in (0, 1, 7, 8, 9, 64, 1001):
            check(
                f"expected_bytes({k},{n}) == int ref",
                expected_bytes(k, n).tobytes().hex(),
                _expected_bytes_int(k, n).hex(),
            )
    check("seed_word(0)", hex(seed_word(0)), hex(0x5348_4D43_4B50_5400))
    check("seed_word(1)", hex(seed_word(1)), hex(0x5348_4D43_4B50_5400 ^ (1 << 32)))
    return res


# ----------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------
MIXED_DTYPES = ["BF16", "F32", "F16", "BF16", "I64", "U8", "F32", "BF16"]
ELEM_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def mixed_layout(n, total_bytes):
    """Tensor i: dtype MIXED_DTYPES[i % 8]; weight w_i = 1 + (i*2654435761) % 97;
    elements = floor(total_bytes * w_i / sum(w) / elem_size) (at least 1);
    shape [elements // 1024, 1024] when elements is a multiple of 1024 and
    >= 2048, else [elements]; name layers.{i}.weight."""
    w = [1 + (i * 2654435761) % 97 for i in range(n)]
    sw = sum(w)
    out = []
    for i in range(n):
        dt = MIXED_DTYPES[i % 8]
        es = ELEM_SIZE[dt]
        elems = max(1, (total_bytes * w[i]) // (sw * es))
        shape = [elems // 1024, 1024] if (elems >= 2048 and elems % 1024 == 0) else [elems]
        out.append({"name": f"layers.{i}.weight", "dtype": dt, "shape": shape})
    return out


def make_layout(state, scale=1.0):
    if state == "8g":
        rows = max(1, int(round(8192 * scale)))
        return [{"name": f"layers.{i}.weight", "dtype": "BF16", "shape": [rows, 8192]} for i in range(64)]
    if state == "16g":
        return mixed_layout(1000, int(16 * GiB * scale))
    if state == "small":
        return mixed_layout(16, int(256 * MiB * scale))
    raise ValueError(f"unknown state {state!r}")


def layout_nbytes(entry):
    return math.prod(entry["shape"]) * ELEM_SIZE[entry["dtype"]]


def torch_dtype(name):
    import torch

    return {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F64": torch.float64,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }[name]


def make_state(layout, device, seed=1234):
    """Random content: torch.randint on uint8, viewed as the dtype. Returns
    (state_dict, raw_uint8_tensors)."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed)
    sd, raws = {}, []
    for e in layout:
        n = layout_nbytes(e)
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)
        sd[e["name"]] = raw.view(torch_dtype(e["dtype"])).view(e["shape"])
        raws.append(raw)
    if device == "cuda":
        torch.cuda.synchronize()
    return sd, raws


def mutate_in_place(raws, device):
    """Steady state: same tensors, every byte changed in place."""
    import torch

    for r in raws:
        r.add_(1)
    if device == "cuda":
        torch.cuda.synchronize()


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


# ----------------------------------------------------------------------------
# physical references
# ----------------------------------------------------------------------------
def raw_write_ref(path, nbytes, chunk=64 * MiB):
    """Sequential write of nbytes (rounded up to 4 KiB) with O_DIRECT from a
    page-aligned buffer in 64 MiB writes, then fsync. Falls back to buffered
    writes + fsync if the filesystem refuses O_DIRECT (reported)."""
    import numpy as np

    total = (nbytes + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, chunk)
    buf.write(np.random.default_rng(7).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    mv = memoryview(buf)
    direct = True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        direct = False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = now()
        remaining = total
        first = True
        while remaining > 0:
            n = min(chunk, remaining)
            try:
                w = os.write(fd, mv[:n])
            except OSError:
                if first and direct:  # EINVAL: O_DIRECT not supported here
                    os.close(fd)
                    direct = False
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    t0 = now()
                    remaining = total
                    continue
                raise
            first = False
            if w <= 0:
                raise OSError("short write")
            remaining -= w
        t_write = now() - t0
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
    return {
        "bytes": total,
        "seconds": secs,
        "write_seconds_before_fsync": t_write,
        "gbps": gbps(total, secs),
        "o_direct": direct,
    }


def d2h_ref(raws, nbytes, repeats=3):
    """Plain pinned D2H copy of the same bytes: one pinned uint8 buffer
    (torch.empty(pin_memory=True)), copy_(non_blocking=True) of every tensor
    into its slice, torch.cuda.synchronize(); warm once, median of `repeats`."""
    import torch

    t0 = now()
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    alloc_s = now() - t0
    offs = []
    o = 0
    for r in raws:
        offs.append(o)
        o += r.numel()

    def once():
        torch.cuda.synchronize()
        t = now()
        for r, off in zip(raws, offs):
            dst[off : off + r.numel()].copy_(r, non_blocking=True)
        torch.cuda.synchronize()
        return now() - t

    warm = once()
    runs = [once() for _ in range(repeats)]
    med = statistics.median(runs)
    dst = None  # noqa: F841 (frees the pinned buffer; `once` holds the cell)
    gc.collect()
    try:
        torch._C._host_emptyCache()
    except Exception:
        pass
    return {
        "bytes": nbytes,
        "pinned_alloc_seconds": alloc_s,
        "warm_seconds": warm,
        "runs_seconds": runs,
        "seconds": med,
        "gbps": gbps(nbytes, med),
    }


# ----------------------------------------------------------------------------
# systems (each returns a dict; stall_s / durable_s are lists, one per save)
# ----------------------------------------------------------------------------
class Ctx:
    pass


def _save_dirs(ctx, sysname):
    base = os.path.join(ctx.ckpt_dir, sysname)
    rmtree(base)
    os.makedirs(base, exist_ok=True)
    return base


def _after_save(ctx, r, save_dir):
    alloc, apparent, files = disk_usage_of(save_dir)
    r["disk_bytes"].append(alloc)
    r["apparent_bytes"].append(apparent)
    r["files"].append(files)
    rmtree(save_dir)


def _compare_to_state(ctx, loaded):
    import torch

    bad = []
    for k, v in ctx.sd.items():
        got = loaded.get(k)
        if got is None:
            bad.append(f"{k}: missing")
            continue
        a = got.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        b = v.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        if got.dtype != v.dtype or list(got.shape) != list(v.shape) or not torch.equal(a, b):
            bad.append(f"{k}: differs")
    return {"ok": not bad, "tensors": len(ctx.sd), "mismatched": bad[:10], "mismatched_count": len(bad)}


def verify_torch_file(ctx, path):
    import torch

    return _compare_to_state(ctx, torch.load(path, map_location="cpu", mmap=True, weights_only=True))


def verify_dcp_dir(ctx, d):
    import torch
    import torch.distributed.checkpoint as dcp

    target = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in ctx.sd.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(d))
    return _compare_to_state(ctx, target)


def _maybe_verify(ctx, r, i, fn, path):
    """--verify: compare the last save with the state (not timed; inflates the
    memory peaks of the system, so it is off for real measurements)."""
    if not ctx.verify or i != ctx.saves - 1:
        return
    try:
        v = fn(ctx, path)
    except Exception as e:
        v = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    r["verify"] = v
    log(f"    verify save #{i + 1}: {'ok' if v.get('ok') else 'MISMATCH ' + str(v)}")


def sys_torch(ctx, r):
    import torch

    base = _save_dirs(ctx, "torch")
    r.update(stall_s=[], durable_s=[], fsync_s=[], disk_bytes=[], apparent_bytes=[], files=[])
    r["api"] = "torch.save(state_dict, path); fd=os.open(path, O_RDONLY); os.fsync(fd)"
    for i in range(ctx.saves):
        if i:
            mutate_in_place(ctx.raws, ctx.device)
        d = os.path.join(base, f"save{i + 1}")
        os.makedirs(d)
        path = os.path.join(d, "model.pt")
        t0 = now()
        torch.save(ctx.sd, path)
        t_save = now() - t0
        fsync_path(path)
        t_dur = now() - t0
        r["stall_s"].append(t_save)
        r["durable_s"].append(t_dur)
        r["fsync_s"].append(t_dur - t_save)
        log(f"    torch save #{i + 1}: stall {t_save:.3f}s durable {t_dur:.3f}s")
        _maybe_verify(ctx, r, i, verify_torch_file, path)
        _after_save(ctx, r, d)
    r["gpu_after"] = gpu_mem(ctx)
    rmtree(base)


def _dcp_shutdown():
    """Stops DCP's checkpoint daemon process (private API, best effort) so its
    memory is not carried into the next system."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape

        p = getattr(ape, "_CHECKPOINT_PROCESS", None)
        if p is not None:
            try:
                p._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
                p._save_process.join(timeout=30)
            finally:
                if p._save_process.is_alive():
                    p._save_process.terminate()
                    p._save_process.join(timeout=10)
            ape._CHECKPOINT_PROCESS = None
            return True
    except Exception as e:
        log(f"    dcp shutdown: {e!r}")
    return False


def _result(fut, timeout, what):
    import concurrent.futures

    try:
        return fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{what} not complete after {timeout}s") from None


def sys_dcp(ctx, r):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    base = _save_dirs(ctx, "dcp")
    cuda = ctx.cuda
    opts = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=True,
        use_async_staging=cuda,
        use_non_blocking_copy=cuda,
    )
    r.update(stall_s=[], durable_s=[], return_s=[], staged_s=[], disk_bytes=[], apparent_bytes=[], files=[])
    r["staging_options"] = {k: getattr(opts, k) for k in ("use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy")}
    r["writer"] = {"class": "FileSystemWriter", "thread_count": ctx.threads, "sync_files": True}
    r["api"] = (
        "dcp.async_save(sd, storage_writer=FileSystemWriter(dir, thread_count=T, sync_files=True), "
        "async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=DefaultStager(StagingOptions(...))) "
        "-> AsyncSaveResponse; .staging_completion.result(); .upload_completion.result()"
    )
    r["notes"].append(
        "a new DefaultStager per save: torch 2.11 DefaultStager._stage() calls StateDictStager.close(), which clears "
        "its deepcopy dispatch table, so a 2nd stage() on the same stager raises KeyError(<class 'type'>); the "
        "staging cache is cleared after every stage anyway, so every save allocates + pins new shared memory"
    )
    r["notes"].append("stall = until staging completes (safe to mutate weights); return_s = until async_save returns")
    r["notes"].append("DCP fsyncs each data file and .metadata itself (sync_files=True); no extra fsync added")
    try:
        for i in range(ctx.saves):
            if i:
                mutate_in_place(ctx.raws, ctx.device)
            d = os.path.join(base, f"save{i + 1}")
            writer = dcp.FileSystemWriter(d, thread_count=ctx.threads, sync_files=True, overwrite=True)
            stager = DefaultStager(opts)
            t0 = now()
            resp = dcp.async_save(
                ctx.sd,
                storage_writer=writer,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=stager,
            )
            t_ret = now() - t0
            ctx.dcp_pending = resp.upload_completion if hasattr(resp, "upload_completion") else resp
            if hasattr(resp, "staging_completion"):
                _result(resp.staging_completion, ctx.timeout, "DCP staging")
                t_staged = now() - t0
                upload = resp.upload_completion
            else:
                t_staged = t_ret
                upload = resp
            _result(upload, ctx.timeout, "DCP upload")
            t_dur = now() - t0
            ctx.dcp_pending = None
            stager.close()
            del resp, upload, stager, writer
            r["return_s"].append(t_ret)
            r["staged_s"].append(t_staged)
            r["stall_s"].append(max(t_ret, t_staged))
            r["durable_s"].append(t_dur)
            log(f"    dcp save #{i + 1}: returned {t_ret:.3f}s staged {t_staged:.3f}s durable {t_dur:.3f}s")
            _maybe_verify(ctx, r, i, verify_dcp_dir, d)
            _after_save(ctx, r, d)
        r["gpu_after"] = gpu_mem(ctx)
    finally:
        _dcp_shutdown()
        r["gpu_after_close"] = gpu_mem(ctx)
        rmtree(base)


def _nvrx_wait(queue, timeout, poll=0.01):
    """Finalizes by polling maybe_finalize_async_calls(blocking=False) every
    10 ms (the library's blocking=True path sleeps 100 ms between polls), with
    a timeout and a check that the persistent worker is still alive."""
    deadline = time.monotonic() + timeout
    while True:
        queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        if queue.get_num_unfinalized_calls() == 0:
            return
        caller = getattr(queue, "persistent_caller", None)
        proc = getattr(caller, "process", None)
        if proc is not None and not proc.is_alive():
            raise RuntimeError(f"NVRx persistent worker died (exitcode {proc.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"NVRx save not finalized after {timeout}s")
        time.sleep(poll)


def sys_nvrx(ctx, r):
    from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint

    base = _save_dirs(ctx, "nvrx")
    r.update(stall_s=[], durable_s=[], finalize_s=[], fsync_s=[], disk_bytes=[], apparent_bytes=[], files=[])
    r["api"] = (
        "ck = TorchAsyncCheckpoint(persistent_queue=True); ck.async_save(sd, path); "
        "poll ck._async_calls_queue.maybe_finalize_async_calls(blocking=False, no_dist=True); os.fsync(path); "
        "at the end ck.finalize_async_save(blocking=True, no_dist=True, terminate=True)"
    )
    r["notes"].append("worker runs torch.save without fsync; durable includes our os.fsync of the file")
    ck = TorchAsyncCheckpoint(persistent_queue=True)
    try:
        for i in range(ctx.saves):
            if i:
                mutate_in_place(ctx.raws, ctx.device)
            d = os.path.join(base, f"save{i + 1}")
            os.makedirs(d)
            path = os.path.join(d, "model.pt")
            t0 = now()
            ck.async_save(ctx.sd, path)
            t_stall = now() - t0
            _nvrx_wait(ck._async_calls_queue, ctx.timeout)
            t_fin = now() - t0
            fsync_path(path)
            t_dur = now() - t0
            r["stall_s"].append(t_stall)
            r["finalize_s"].append(t_fin)
            r["fsync_s"].append(t_dur - t_fin)
            r["durable_s"].append(t_dur)
            log(f"    nvrx save #{i + 1}: stall {t_stall:.3f}s finalized {t_fin:.3f}s durable {t_dur:.3f}s")
            _maybe_verify(ctx, r, i, verify_torch_file, path)
            _after_save(ctx, r, d)
        r["gpu_after"] = gpu_mem(ctx)
    finally:
        try:
            nvrx_close(
                ck._async_calls_queue,
                lambda: ck.finalize_async_save(blocking=True, no_dist=True, terminate=True),
            )
        except Exception as e:
            log(f"    nvrx terminate: {e!r}")
        r["gpu_after_close"] = gpu_mem(ctx)
        rmtree(base)


def sys_nvrx_fswa(ctx, r):
    from torch.distributed.checkpoint import DefaultSavePlanner

    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
        CheckpointMetadataCache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    base = _save_dirs(ctx, "nvrx-fswa")
    r.update(stall_s=[], durable_s=[], disk_bytes=[], apparent_bytes=[], files=[])
    writer_params = inspect.signature(FileSystemWriterAsync.__init__).parameters
    queue_params = inspect.signature(AsyncCallsQueue.__init__).parameters
    writer_kw = {"thread_count": ctx.threads}
    queue_kw = {"persistent": True}
    if "use_cpu_shm_for_gpu_tensors" in writer_params:
        writer_kw["use_cpu_shm_for_gpu_tensors"] = True
        if "cpu_shm_mode" in queue_params:
            queue_kw["cpu_shm_mode"] = True
        r["notes"].append("use_cpu_shm_for_gpu_tensors=True (D2H into CPU shared memory on the trainer side)")
    else:
        r["notes"].append(
            "installed NVRx has no use_cpu_shm_for_gpu_tensors (added in NVRx 0.6.0; PyPI has 0.4.1): "
            "GPU tensors go to the worker as CUDA IPC handles and the worker does the D2H while the trainer waits"
        )
    r["writer_kwargs"] = {k: v for k, v in writer_kw.items()}
    r["queue_kwargs"] = dict(queue_kw)
    r["api"] = (
        f"q = AsyncCallsQueue(**{queue_kw}); cache = CheckpointMetadataCache(); per save: "
        f"w = FileSystemWriterAsync(dir, **{writer_kw}); "
        "ret = save_state_dict_async_plan(sd, w, None, 0, planner=DefaultSavePlanner(), enable_cache=True, metadata_cache=cache); "
        "save_fn, preload_fn, args = w.get_save_function_and_args(); "
        "q.schedule_async_request(AsyncRequest(save_fn, args, [partial(save_state_dict_async_finalize, *ret)], preload_fn=preload_fn)); "
        "poll q.maybe_finalize_async_calls(blocking=False, no_dist=True); at the end q.close()"
    )
    r["notes"].append("writer processes fsync every data file, finalize writes .metadata with fsync; no extra fsync added")
    q = AsyncCallsQueue(**queue_kw)
    # a private plan/metadata cache per state: the module-global one that
    # init_checkpoint_metadata_cache() sets up keeps the previous state's plan
    # marked "validated" and would reuse it for a different tensor set
    md_cache = CheckpointMetadataCache()
    r["notes"].append("enable_cache=True (as Megatron's --ckpt-assume-constant-structure): save #2 reuses the save plan and global metadata")
    try:
        for i in range(ctx.saves):
            if i:
                mutate_in_place(ctx.raws, ctx.device)
            d = os.path.join(base, f"save{i + 1}")
            t0 = now()
            writer = FileSystemWriterAsync(d, **writer_kw)
            ret = save_state_dict_async_plan(
                ctx.sd, writer, None, 0, planner=DefaultSavePlanner(), enable_cache=True, metadata_cache=md_cache
            )
            save_fn, preload_fn, save_args = writer.get_save_function_and_args()
            req = AsyncRequest(save_fn, save_args, [partial(save_state_dict_async_finalize, *ret)], preload_fn=preload_fn)
            q.schedule_async_request(req)
            t_stall = now() - t0
            _nvrx_wait(q, ctx.timeout)
            t_dur = now() - t0
            del req, ret, writer, save_fn, preload_fn, save_args
            r["stall_s"].append(t_stall)
            r["durable_s"].append(t_dur)
            log(f"    nvrx-fswa save #{i + 1}: stall {t_stall:.3f}s durable {t_dur:.3f}s")
            _maybe_verify(ctx, r, i, verify_dcp_dir, d)
            _after_save(ctx, r, d)
        r["gpu_after"] = gpu_mem(ctx)
    finally:
        try:
            nvrx_close(q, q.close)
        except Exception as e:
            log(f"    nvrx-fswa close: {e!r}")
        try:  # 0.6.0 keeps class-level shm/identifier caches
            if hasattr(FileSystemWriterAsync, "cleanup_tensor_caches"):
                FileSystemWriterAsync.cleanup_tensor_caches()
        except Exception:
            pass
        r["gpu_after_close"] = gpu_mem(ctx)
        rmtree(base)


SHMCKPT_KEYS = [
    "bytes",
    "tensors",
    "stall_s",
    "stall_first_s",
    "stall_steady_s",
    "durable_s",
    "durable_first_s",
    "persist_gbps",
    "reference_write_gbps",
    "ratio",
    "d2h_gbps",
    "stall_ratio",
    "register_s",
    "gpu_mem_used_after_bytes",
    "peak_rss_bytes",
]


def parse_json_stdout(text):
    text = (text or "").strip()
    if not text:
        raise ValueError("empty stdout")
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            return obj
    except Exception:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
                if isinstance(obj, dict):
                    return obj
            except Exception:
                continue
    raise ValueError(f"no JSON object on stdout: {text[-300:]!r}")


def run_shmckpt(ctx, args_tail, timeout):
    if not ctx.shmckpt_bin or not os.path.isfile(ctx.shmckpt_bin):
        raise FileNotFoundError(f"shmckpt binary not found: {ctx.shmckpt_bin}")
    cmd = [ctx.shmckpt_bin] + args_tail
    log(f"    $ {' '.join(cmd)}")
    t0 = now()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    wall = now() - t0
    err_tail = "\n".join((p.stderr or "").splitlines()[-15:])
    if err_tail:
        for line in err_tail.splitlines():
            log(f"    | {line}")
    if p.returncode != 0:
        raise RuntimeError(f"shmckpt exited {p.returncode}: {err_tail[-800:]}")
    return parse_json_stdout(p.stdout), wall, cmd


def sys_shmckpt(ctx, r, mode):
    base = os.path.join(ctx.ckpt_dir, f"shmckpt-{mode}")
    rmtree(base)
    os.makedirs(base, exist_ok=True)
    try:
        j, wall, cmd = run_shmckpt(
            ctx,
            ["bench", "--source", ctx.shmckpt_source, "--mode", mode, "--layout", ctx.layout_path,
             "--dir", base, "--repeat", str(ctx.saves), "--json"],
            ctx.timeout,
        )
        alloc, apparent, files = disk_usage_of(base)
    finally:
        rmtree(base)
    out = {k: j.get(k) for k in SHMCKPT_KEYS}
    r["shmckpt_json"] = j
    r["shmckpt"] = out
    r["command"] = cmd
    r["process_wall_s"] = wall
    stall2 = out.get("stall_steady_s") if out.get("stall_steady_s") is not None else out.get("stall_s")
    r["stall_s"] = [out.get("stall_first_s"), stall2]
    r["durable_s"] = [out.get("durable_first_s"), out.get("durable_s")]
    r["disk_bytes_left_after_run"] = alloc
    r["apparent_bytes_left_after_run"] = apparent
    r["gpu_after"] = gpu_mem(ctx)
    r["gpu_after_reported_by_shmckpt_bytes"] = out.get("gpu_mem_used_after_bytes")
    r["notes"].append(
        "separate process with its own GPU copy of the layout (--source %s); #1 = *_first_s, "
        "#2 = stall_steady_s (else stall_s) / durable_s as printed by the binary" % ctx.shmckpt_source
    )
    if j.get("bytes") is not None and j.get("bytes") != ctx.nbytes:
        r["notes"].append(f"shmckpt reports bytes={j.get('bytes')} but the layout has {ctx.nbytes}")


SYSTEMS = {
    "torch": sys_torch,
    "dcp": sys_dcp,
    "nvrx": sys_nvrx,
    "nvrx-fswa": sys_nvrx_fswa,
    "shmckpt-shm": partial(sys_shmckpt, mode="shm"),
    "shmckpt-ipc": partial(sys_shmckpt, mode="ipc"),
}
DEFAULT_SYSTEMS = "torch,dcp,nvrx,nvrx-fswa,shmckpt-shm,shmckpt-ipc"
# rough seconds per GiB per save on the target machine, for the time budget only
# (shmckpt bench also runs its own raw reference write next to every save)
EST_S_PER_GIB = {"torch": 2.2, "dcp": 2.0, "nvrx": 1.7, "nvrx-fswa": 1.7, "shmckpt-shm": 1.3, "shmckpt-ipc": 1.3}
EST_FIXED_S = {"torch": 1, "dcp": 8, "nvrx": 6, "nvrx-fswa": 10, "shmckpt-shm": 5, "shmckpt-ipc": 5}


def measure_system(ctx, name):
    r = {"system": name, "ok": False, "error": None, "notes": []}
    host_cleanup(ctx)
    r["gpu_before"] = gpu_mem(ctx)
    sampler = TreeMemSampler(interval=ctx.mem_interval).start()
    t0 = now()
    counter = EmptyCacheCounter() if ctx.cuda else None
    try:
        if counter:
            with counter:
                SYSTEMS[name](ctx, r)
        else:
            SYSTEMS[name](ctx, r)
        r["ok"] = True
    except BaseException as e:  # keep going whatever happens
        if isinstance(e, KeyboardInterrupt):
            raise
        r["error"] = f"{type(e).__name__}: {e}"
        r["traceback"] = traceback.format_exc()
        log(f"    {name} FAILED: {r['error']}")
        for line in r["traceback"].rstrip().splitlines()[-8:]:
            log(f"    ! {line}")
    finally:
        r["wall_s"] = now() - t0
        r["memory"] = sampler.stop()
        if counter:
            r["empty_cache_calls_in_trainer"] = counter.count
    if r.get("gpu_before") and r.get("gpu_after"):
        r["gpu_used_delta_after_bytes"] = r["gpu_after"]["device_used_bytes"] - r["gpu_before"]["device_used_bytes"]
    host_cleanup(ctx)
    return r


# ----------------------------------------------------------------------------
# interchange check
# ----------------------------------------------------------------------------
def verify_safetensors(path, layout, device):
    """Loads `path` with safetensors.torch.load_file and compares every tensor,
    byte for byte, with expected_bytes(k, nbytes) (k = index in layout)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    loaded = load_file(path, device=device)
    per = []
    for k, e in enumerate(layout):
        name = e["name"]
        nb = layout_nbytes(e)
        item = {"k": k, "name": name, "bytes": nb, "ok": False}
        t = loaded.get(name)
        if t is None:
            item["error"] = "missing"
            per.append(item)
            continue
        item["dtype"] = str(t.dtype)
        item["shape"] = list(t.shape)
        problems = []
        if t.dtype != torch_dtype(e["dtype"]):
            problems.append(f"dtype {t.dtype} != {e['dtype']}")
        if list(t.shape) != list(e["shape"]):
            problems.append(f"shape {list(t.shape)} != {e['shape']}")
        got = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        want = expected_bytes(k, nb)
        if got.size != want.size:
            problems.append(f"{got.size} bytes != {want.size}")
        else:
            diff = np.flatnonzero(got != want)
            if diff.size:
                problems.append(f"{diff.size} bytes differ, first at {int(diff[0])}")
                if diff.size == 1 and int(diff[0]) == 0:
                    # diagnostic only: a bench that stamps byte 0 of every tensor per save
                    item["only_byte0_differs"] = True
                    item["byte0_got"] = int(got[0])
                    item["byte0_generator"] = int(want[0])
        if problems:
            item["error"] = "; ".join(problems)
        else:
            item["ok"] = True
        per.append(item)
    extra = sorted(set(loaded) - {e["name"] for e in layout})
    passed = sum(1 for p in per if p["ok"])
    return {
        "file": path,
        "tensors": len(layout),
        "passed": passed,
        "failed": len(layout) - passed,
        "failed_only_at_byte0": sum(1 for p in per if p.get("only_byte0_differs")),
        "extra_tensors_in_file": extra,
        "ok": passed == len(layout) and not extra,
        "per_tensor": per,
    }


def interchange_check(ctx):
    r = {"ok": False, "error": None}
    layout = make_layout("small", ctx.scale)
    lpath = os.path.join(ctx.out_dir, "layout-small.json")
    with open(lpath, "w") as f:
        json.dump(layout, f)
    d = os.path.join(ctx.ckpt_dir, "interchange")
    rmtree(d)
    os.makedirs(d, exist_ok=True)
    try:
        j, wall, cmd = run_shmckpt(
            ctx,
            ["bench", "--source", ctx.shmckpt_source, "--layout", lpath, "--dir", d, "--repeat", "1", "--keep", "--json"],
            ctx.timeout,
        )
        r["command"] = cmd
        r["shmckpt_json"] = j
        kept = j.get("kept_dir")
        if not kept:
            raise RuntimeError("shmckpt JSON has no kept_dir")
        path = os.path.join(kept, "rank-00000-of-00001.safetensors")
        v = verify_safetensors(path, layout, ctx.device)
        r.update(v)
        log(
            f"  interchange: {v['passed']}/{v['tensors']} tensors byte-exact, extra={v['extra_tensors_in_file']}"
            + (f", {v['failed_only_at_byte0']} differ only in byte 0" if v["failed_only_at_byte0"] else "")
        )
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
        r["traceback"] = traceback.format_exc()
        log(f"  interchange FAILED: {r['error']}")
    finally:
        rmtree(d)
    return r


def selftest_interchange_synthetic(tmpdir, device):
    """Writes a safetensors file with the expected content (safetensors.torch
    .save_file), checks the verifier passes it, corrupts one byte, checks the
    verifier catches it. Proves the verifier, not shmckpt."""
    import torch
    from safetensors.torch import save_file

    layout = make_layout("small", 1.0 / 256)  # 1 MiB, mixed dtypes
    tensors = {}
    for k, e in enumerate(layout):
        b = torch.from_numpy(expected_bytes(k, layout_nbytes(e)).copy())
        tensors[e["name"]] = b.view(torch_dtype(e["dtype"])).view(e["shape"])
    os.makedirs(tmpdir, exist_ok=True)
    p = os.path.join(tmpdir, "rank-00000-of-00001.safetensors")
    save_file(tensors, p)
    good = verify_safetensors(p, layout, device)
    name = layout[3]["name"]
    t = tensors[name].reshape(-1).view(torch.uint8)
    t[5] ^= 0xFF
    save_file(tensors, p)
    bad = verify_safetensors(p, layout, device)
    rmtree(tmpdir)
    return {
        "good_file_passed": good["passed"],
        "good_file_ok": good["ok"],
        "corrupted_file_failed": bad["failed"],
        "corrupted_detected": (not bad["ok"]) and bad["failed"] == 1,
        "ok": good["ok"] and (not bad["ok"]) and bad["failed"] == 1,
    }


# ----------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------
def _f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def _gib(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def _idx(lst, i):
    if not isinstance(lst, list) or len(lst) <= i:
        return None
    return lst[i]


def table_rows(results):
    rows = []
    for sname, st in results.get("states", {}).items():
        raw_s = st.get("raw_write", {}).get("median_seconds")
        d2h_s = (st.get("d2h") or {}).get("seconds")
        raw = st.get("raw_write", {})
        rows.append([
            "raw O_DIRECT write (ref)", sname, "-", "-",
            _f((raw.get("before") or {}).get("seconds")), _f((raw.get("after") or {}).get("seconds")),
            "1.00" if raw_s else "-", "-", "-", "-", "-", "-",
            f"median {_f(raw_s)} s = {_f(raw.get('median_gbps'))} GB/s (before, after)",
        ])
        if st.get("d2h"):
            rows.append([
                "pinned D2H copy (ref)", sname, _f(d2h_s, 3), "-", "-", "-", "-", "1.00", "-", "-", "-", "-",
                f"{_f(st['d2h'].get('gbps'))} GB/s; pinned alloc {_f(st['d2h'].get('pinned_alloc_seconds'))} s",
            ])
        for name, r in st.get("systems", {}).items():
            if not r.get("ok"):
                rows.append([name, sname, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", f"FAILED: {(r.get('error') or '')[:160]}"])
                continue
            s1, s2 = _idx(r.get("stall_s"), 0), _idx(r.get("stall_s"), 1)
            d1, d2 = _idx(r.get("durable_s"), 0), _idx(r.get("durable_s"), 1)
            mem = r.get("memory", {})
            if name.startswith("shmckpt"):
                gpu = r.get("gpu_after_reported_by_shmckpt_bytes")
                gpu_s = "-" if gpu is None else f"{gpu / MiB:.0f} MiB (bin)"
            else:
                gd = r.get("gpu_used_delta_after_bytes")
                gpu_s = "-" if gd is None else f"{gd / MiB:+.0f} MiB"
            disk = _idx(r.get("disk_bytes"), 1)
            if disk is None and r.get("disk_bytes_left_after_run"):
                disk = r.get("disk_bytes_left_after_run")
            note = ""
            if name == "dcp" and r.get("return_s"):
                note = "returns in " + ", ".join(_f(x, 3) for x in r["return_s"]) + " s"
            rows.append([
                name, sname, _f(s1, 3), _f(s2, 3), _f(d1), _f(d2),
                _f(d2 / raw_s if (d2 and raw_s) else None),
                _f(s2 / d2h_s if (s2 is not None and d2h_s) else None),
                f"{_gib(mem.get('peak_rss_tree_bytes'))} ({_gib(mem.get('peak_rss_tree_delta_bytes'))})"
                if mem.get("peak_rss_tree_bytes") is not None else "-",
                _gib(mem.get("peak_host_used_delta_bytes")),
                gpu_s, _gib(disk), note,
            ])
    if results.get("interchange"):
        ic = results["interchange"]
        if ic.get("error"):
            txt = f"FAILED: {ic['error'][:160]}"
        else:
            txt = f"{ic.get('passed')}/{ic.get('tensors')} tensors byte-exact" + ("" if ic.get("ok") else " (MISMATCH)")
            if ic.get("failed_only_at_byte0"):
                txt += f"; {ic['failed_only_at_byte0']} differ only in byte 0"
        rows.append(["interchange (shmckpt -> safetensors)", "small", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", txt])
    return rows


HEADER = [
    "system", "state", "stall #1 s", "stall #2 s", "durable #1 s", "durable #2 s",
    "durable#2 / raw write", "stall#2 / D2H", "peak RSS tree GiB (Δ)", "peak host used Δ GiB", "GPU mem after",
    "on disk GiB", "notes",
]


def render_text(rows):
    widths = [len(h) for h in HEADER]
    for row in rows:
        for i, c in enumerate(row[:-1]):
            widths[i] = max(widths[i], len(str(c)))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(HEADER))]
    lines.append("  ".join("-" * widths[i] for i in range(len(HEADER))))
    for row in rows:
        lines.append("  ".join(str(c).ljust(widths[i]) for i, c in enumerate(row)))
    return "\n".join(lines)


def render_md(results, rows):
    m = results.get("meta", {})
    v = m.get("versions", {})
    out = ["# Checkpoint anchors", ""]
    out.append(
        f"Run {m.get('started')} on {m.get('gpu') or 'no GPU'} ({m.get('host')}), ckpt dir `{m.get('ckpt_dir')}` "
        f"({(m.get('ckpt_fs') or {}).get('fstype')}), device `{m.get('device')}`, scale {m.get('scale')}, "
        f"writer threads {m.get('threads')}."
    )
    out.append("")
    out.append(
        "Versions: "
        + ", ".join(f"{k} {v.get(k)}" for k in ("python", "torch", "cuda", "safetensors", "numpy", "nvidia-resiliency-ext", "shmckpt"))
    )
    out.append("")
    out.append("| " + " | ".join(HEADER) + " |")
    out.append("|" + "|".join("---" for _ in HEADER) + "|")
    for row in rows:
        out.append("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |")
    out.append("")
    out.append(
        "Stall = time the trainer is blocked until it may mutate the weights again (DCP: until staging completes). "
        "Durable = until the data is fsynced (torch / nvrx: plus our os.fsync of the file). #1 = first save "
        "(includes process start-up, allocation, pinning), #2 = second save of the same tensors modified in place. "
        "Ratios use save #2 and the median raw O_DIRECT write / median pinned D2H of the same bytes. "
        "Peak RSS tree sums RSS over the process tree (shared pages counted once per process; in parentheses the "
        "rise over the tree's RSS just before the system started); peak host used Δ is the rise of MemTotal-MemAvailable (counts shared memory and pinned pages once). GPU mem after = change of "
        "device-wide used memory after the last finalize (shmckpt: the binary's gpu_mem_used_after_bytes)."
    )
    states = results.get("states", {})
    if states:
        out += ["", "States: " + "; ".join(
            f"{s}: {st.get('tensors')} tensors, {st.get('bytes', 0) / GiB:.3f} GiB ({', '.join(st.get('dtypes', []))})"
            for s, st in states.items()) + "."]
    notes, seen = [], set()
    for sname, st in states.items():
        for name, r in st.get("systems", {}).items():
            for n in r.get("notes") or []:
                if (name, n) not in seen:
                    seen.add((name, n))
                    notes.append(f"- **{name}**: {n}")
            if r.get("error"):
                notes.append(f"- **{name} / {sname} FAILED**: `{r['error'][:400]}`")
            if r.get("verify") is not None:
                notes.append(f"- **{name} / {sname}** content check of the last save: {'ok' if r['verify'].get('ok') else r['verify']}")
    if notes:
        out += ["", "Notes:", ""] + notes
    nv = m.get("nvrx_empty_cache_refs")
    out += ["", f"`torch.cuda.empty_cache` in the installed NVRx package: {nv if nv else 'no occurrence'}"]
    return "\n".join(out) + "\n"


def write_results(ctx, results):
    try:
        p = os.path.join(ctx.out_dir, "results.json")
        with open(p + ".tmp", "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(p + ".tmp", p)
        rows = table_rows(results)
        with open(os.path.join(ctx.out_dir, "results.md"), "w") as f:
            f.write(render_md(results, rows))
    except Exception as e:
        log(f"writing results failed: {e!r}")


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--state", default="all", help="comma list of small,8g,16g, or all (= 8g,16g + interchange), or none")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help="comma list of " + ",".join(SYSTEMS))
    p.add_argument("--interchange", action="store_true", help="run the shmckpt -> safetensors interchange check")
    p.add_argument("--selftest", action="store_true", help="also run the synthetic-file verifier self-test")
    p.add_argument("--shmckpt", default="target/release/shmckpt", help="path of the shmckpt binary")
    p.add_argument("--shmckpt-source", default=None, help="--source for shmckpt bench (default: cuda; host with --device cpu)")
    p.add_argument("--dir", default="/tmp/anchors-ckpt", help="checkpoint directory (must be on the real disk)")
    p.add_argument("--out", default=None, help="results directory (default $OUT, else ./anchors-out)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu = smoke test only (tiny sizes, no pinning)")
    p.add_argument("--scale", type=float, default=None, help="state size multiplier (default 1; 1/1024 with --device cpu)")
    p.add_argument("--saves", type=int, default=2, help="saves per system (>= 2; #1 and #2 are reported)")
    p.add_argument("--threads", type=int, default=4, help="writer thread_count for DCP FileSystemWriter and NVRx FileSystemWriterAsync")
    p.add_argument("--timeout", type=float, default=300, help="per-save / per-subprocess timeout, seconds")
    p.add_argument("--budget-s", type=float, default=540, help="skip systems whose estimated time would end the run after this many seconds")
    p.add_argument("--no-raw-after", action="store_true", help="skip the second raw-write reference")
    p.add_argument("--mem-interval", type=float, default=0.05, help="host memory sampling interval, seconds")
    p.add_argument("--verify", action="store_true", help="check the last save of torch/dcp/nvrx/nvrx-fswa against the state (slow; inflates their memory peaks)")
    p.add_argument("--verbose", action="store_true", help="library INFO logs")
    a = p.parse_args(argv)
    if a.saves < 2:
        p.error("--saves must be >= 2")
    return a


def main(argv=None):
    args = parse_args(argv)
    out_dir = args.out or os.environ.get("OUT") or "./anchors-out"
    os.makedirs(out_dir, exist_ok=True)
    set_log_file(open(os.path.join(out_dir, "anchors.log"), "a"))
    cuda = args.device == "cuda"
    if not cuda:
        os.environ["ANCHORS_CPU_SMOKE"] = "1"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

    import logging

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(processName)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )

    log(f"anchors start: argv={sys.argv[1:]} out={out_dir}")
    results = {"meta": {"started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:]}, "states": {}}
    meta = results["meta"]
    meta["nofile"] = raise_nofile()

    st = selftest_generator()
    results["generator_selftest"] = st
    log(f"generator self-test: {'ok' if st['ok'] else 'FAILED'} ({len(st['checks'])} checks)")
    if not st["ok"]:
        for c in st["checks"]:
            if not c["ok"]:
                log(f"  mismatch: {c}")

    import numpy as np
    import psutil
    import torch
    import torch.distributed as dist

    if not cuda:
        torch.cuda.synchronize = lambda *a, **k: None  # smoke test only, see top of file
    elif not torch.cuda.is_available():
        log("CUDA is not available; use --device cpu for a smoke test")
        return 2

    ctx = Ctx()
    ctx.device = args.device
    ctx.cuda = cuda
    ctx.scale = args.scale if args.scale is not None else (1.0 if cuda else 1.0 / 1024)
    ctx.saves = args.saves
    ctx.threads = args.threads
    ctx.timeout = args.timeout
    ctx.mem_interval = args.mem_interval
    ctx.verify = args.verify
    ctx.out_dir = out_dir
    ctx.ckpt_dir = os.path.abspath(args.dir)
    os.makedirs(ctx.ckpt_dir, exist_ok=True)
    ctx.shmckpt_bin = os.path.abspath(args.shmckpt) if args.shmckpt else None
    ctx.shmckpt_source = args.shmckpt_source or ("cuda" if cuda else "host")

    # versions / environment
    shm_ver = None
    if ctx.shmckpt_bin and os.path.isfile(ctx.shmckpt_bin):
        try:
            pv = subprocess.run([ctx.shmckpt_bin, "--version"], capture_output=True, text=True, timeout=30)
            shm_ver = (pv.stdout or pv.stderr).strip() or f"exit {pv.returncode}"
        except Exception as e:
            shm_ver = f"error: {e!r}"
    else:
        shm_ver = f"missing: {ctx.shmckpt_bin}"
    try:
        import safetensors

        st_ver = safetensors.__version__
    except Exception:
        st_ver = None
    meta["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "safetensors": st_ver,
        "numpy": np.__version__,
        "psutil": psutil.__version__,
        "nvidia-resiliency-ext": pkg_version("nvidia-resiliency-ext", "nvidia_resiliency_ext"),
        "shmckpt": shm_ver,
    }
    meta["nvrx_empty_cache_refs"] = grep_package("nvidia_resiliency_ext", "empty_cache")
    meta["host"] = platform.node()
    meta["kernel"] = platform.release()
    meta["cpus"] = os.cpu_count()
    meta["ram_bytes"] = psutil.virtual_memory().total
    meta["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    meta["device"] = ctx.device
    meta["scale"] = ctx.scale
    meta["threads"] = ctx.threads
    meta["saves"] = ctx.saves
    meta["ckpt_dir"] = ctx.ckpt_dir
    meta["ckpt_fs"] = fs_type_of(ctx.ckpt_dir)
    meta["ckpt_free_bytes_at_start"] = shutil.disk_usage(ctx.ckpt_dir).free
    meta["shmckpt_bin"] = ctx.shmckpt_bin
    log(f"versions: {meta['versions']}")
    log(f"ckpt dir {ctx.ckpt_dir}: {meta['ckpt_fs']} free {meta['ckpt_free_bytes_at_start'] / GiB:.1f} GiB; nofile {meta['nofile']}")
    if (meta["ckpt_fs"] or {}).get("fstype") in ("tmpfs", "ramfs", "overlay"):
        log(f"WARNING: {ctx.ckpt_dir} is on {meta['ckpt_fs']['fstype']}, not a real disk")
    if meta["nvrx_empty_cache_refs"] is not None:
        log(f"torch.cuda.empty_cache in NVRx package: {len(meta['nvrx_empty_cache_refs'])} occurrence(s)")
    write_results(ctx, results)

    # states & systems
    states = []
    want_interchange = args.interchange
    for s in [x.strip() for x in args.state.split(",") if x.strip()]:
        if s == "all":
            states += ["8g", "16g"]
            want_interchange = True
        elif s in ("small", "8g", "16g"):
            states.append(s)
        elif s == "none":
            pass
        else:
            log(f"unknown state {s!r}")
            return 2
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    for s in systems:
        if s not in SYSTEMS:
            log(f"unknown system {s!r}; known: {','.join(SYSTEMS)}")
            return 2
    meta["states"] = states
    meta["systems"] = systems
    meta["interchange"] = want_interchange

    if args.selftest:
        try:
            results["verifier_selftest"] = selftest_interchange_synthetic(os.path.join(ctx.ckpt_dir, "selftest"), ctx.device)
            log(f"verifier self-test: {results['verifier_selftest']}")
        except Exception as e:
            results["verifier_selftest"] = {"ok": False, "error": repr(e), "traceback": traceback.format_exc()}
            log(f"verifier self-test FAILED: {e!r}")
        write_results(ctx, results)

    # single-rank process group (DCP and NVRx need one; gloo = CPU backend that DCP async_save requires)
    need_pg = any(s in ("dcp", "nvrx", "nvrx-fswa") for s in systems) and states
    if need_pg and not dist.is_initialized():
        port = free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        meta["process_group"] = f"gloo tcp://127.0.0.1:{port} world_size=1"
        log(f"process group: {meta['process_group']}")
    if cuda:
        torch.cuda.set_device(0)
        torch.cuda.init()

    if want_interchange:
        log("== interchange check (shmckpt bench --keep -> safetensors.torch.load_file)")
        results["interchange"] = interchange_check(ctx)
        write_results(ctx, results)

    for sname in states:
        log(f"== state {sname}")
        layout = make_layout(sname, ctx.scale)
        ctx.layout_path = os.path.abspath(os.path.join(out_dir, f"layout-{sname}.json"))
        with open(ctx.layout_path, "w") as f:
            json.dump(layout, f)
        ctx.nbytes = sum(layout_nbytes(e) for e in layout)
        st_res = {
            "tensors": len(layout),
            "bytes": ctx.nbytes,
            "layout_file": ctx.layout_path,
            "dtypes": sorted({e["dtype"] for e in layout}),
            "two_d_tensors": sum(1 for e in layout if len(e["shape"]) == 2),
            "systems": {},
        }
        results["states"][sname] = st_res
        log(f"  {len(layout)} tensors, {ctx.nbytes / GiB:.3f} GiB, dtypes {st_res['dtypes']}")
        free = shutil.disk_usage(ctx.ckpt_dir).free
        if free < 1.3 * ctx.nbytes:
            log(f"  WARNING: only {free / GiB:.1f} GiB free in {ctx.ckpt_dir}")
        t = now()
        ctx.sd, ctx.raws = make_state(layout, ctx.device)
        st_res["create_s"] = now() - t
        log(f"  state created on {ctx.device} in {st_res['create_s']:.2f}s")
        raw_path = os.path.join(ctx.ckpt_dir, "raw-write.bin")
        raw = {"before": None, "after": None}
        st_res["raw_write"] = raw
        try:
            raw["before"] = raw_write_ref(raw_path, ctx.nbytes)
            log(f"  raw write (before): {raw['before']['seconds']:.3f}s {raw['before']['gbps']:.2f} GB/s o_direct={raw['before']['o_direct']}")
        except Exception as e:
            raw["before_error"] = repr(e)
            log(f"  raw write (before) FAILED: {e!r}")
        if cuda:
            try:
                st_res["d2h"] = d2h_ref(ctx.raws, ctx.nbytes)
                log(f"  pinned D2H: {st_res['d2h']['seconds']:.3f}s {st_res['d2h']['gbps']:.1f} GB/s (pinned alloc {st_res['d2h']['pinned_alloc_seconds']:.2f}s)")
            except Exception as e:
                st_res["d2h"] = None
                st_res["d2h_error"] = repr(e)
                log(f"  pinned D2H FAILED: {e!r}")
        else:
            st_res["d2h"] = None
        write_results(ctx, results)

        for name in systems:
            spent = elapsed()
            est = EST_FIXED_S[name] + EST_S_PER_GIB[name] * ctx.saves * ctx.nbytes / GiB
            if spent + est > args.budget_s:
                log(f"  -- {name}: SKIPPED (elapsed {spent:.0f}s + estimated {est:.0f}s > budget {args.budget_s:.0f}s)")
                st_res["systems"][name] = {"system": name, "ok": False, "error": f"skipped: time budget (estimated {est:.0f}s)", "notes": []}
                write_results(ctx, results)
                continue
            log(f"  -- {name} (estimated {est:.0f}s)")
            r = measure_system(ctx, name)
            st_res["systems"][name] = r
            if r["ok"]:
                mem = r.get("memory", {})
                log(
                    f"  -- {name}: stall {r.get('stall_s')} durable {r.get('durable_s')} "
                    f"peak RSS tree {(mem.get('peak_rss_tree_bytes') or 0) / GiB:.2f} GiB, "
                    f"host used +{(mem.get('peak_host_used_delta_bytes') or 0) / GiB:.2f} GiB, wall {r['wall_s']:.1f}s"
                )
            write_results(ctx, results)

        if not args.no_raw_after:
            try:
                raw["after"] = raw_write_ref(raw_path, ctx.nbytes)
                log(f"  raw write (after): {raw['after']['seconds']:.3f}s {raw['after']['gbps']:.2f} GB/s")
            except Exception as e:
                raw["after_error"] = repr(e)
                log(f"  raw write (after) FAILED: {e!r}")
        secs = [x["seconds"] for x in (raw.get("before"), raw.get("after")) if x]
        raw["median_seconds"] = median_or_none(secs)
        raw["median_gbps"] = gbps((raw.get("before") or raw.get("after") or {}).get("bytes"), raw["median_seconds"])
        del ctx.sd, ctx.raws
        host_cleanup(ctx)
        write_results(ctx, results)

    # leftovers of a failed system (e.g. a DCP save that finished writing after
    # its timeout) must not stay on the disk
    if "dcp" in systems:
        pending = getattr(ctx, "dcp_pending", None)
        if pending is not None:
            log("DCP: waiting up to 120 s for a save that timed out, before cleaning up")
            try:
                pending.result(timeout=120)
            except Exception:
                pass
        _dcp_shutdown()
    for leftover in list(SYSTEMS) + ["interchange", "selftest", "raw-write.bin"]:
        p = os.path.join(ctx.ckpt_dir, leftover)
        if os.path.isdir(p):
            rmtree(p)
        elif os.path.exists(p):
            os.unlink(p)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    meta["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    meta["total_s"] = elapsed()
    write_results(ctx, results)
    rows = table_rows(results)
    print("", flush=True)
    print(render_text(rows), flush=True)
    print("", flush=True)
    log(f"results: {os.path.join(out_dir, 'results.json')} and results.md ({meta['total_s']:.0f}s total)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
