#!/usr/bin/env python3
"""Training-loop checkpoint benchmark: throughput lost to checkpointing (issue 14).

Trains a GPT-style decoder in plain PyTorch on random tokens (one GPU, bf16
autocast, fp32 weights = master weights, AdamW) and checkpoints every K steps
through each system, interleaved round-robin in one run on the same disk:

  none        no checkpoint (the baseline)
  torch       torch.save + os.fsync, synchronous
  dcp         torch.distributed.checkpoint.async_save, PROCESS checkpointer,
              DefaultStager(StagingOptions(pinned, shared, async, non_blocking))
  nvrx        NVRx TorchAsyncCheckpoint(persistent_queue=True) (+ fsync of the file)
  nvrx-fswa   NVRx FileSystemWriterAsync + AsyncCallsQueue(persistent=True),
              the Megatron-LM path (NVRx 0.4.1: CUDA IPC handles to the worker)
  shm-block   shmckpt Checkpointer.save(step, state)            (returns once staged)
  shm-async   shmckpt Checkpointer.save(step, state, blocking=False) + guard(opt)

Phases: warm-up (measures the iteration time and picks K from the measured raw
disk limit), main rounds (every system, K where the disk keeps up), a fast
phase (K where the disk cannot keep up), and the colocated case (free weights
and optimizer state after a durable save, measure device memory that came back).
See README.md beside this file for every number's meaning and the device
commands.  Everything that runs is under the __main__ guard: DCP and NVRx spawn
processes that re-import this file.
"""

import argparse
import collections
import concurrent.futures
import csv
import datetime
import gc
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import traceback
from functools import partial

# --device cpu smoke test only: NVRx calls torch.cuda.synchronize() in the
# trainer and inside its spawned worker (which re-imports this module).
if os.environ.get("TRAINBENCH_CPU_SMOKE") == "1":
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
SYSTEMS = ["none", "torch", "dcp", "dcp-shm", "nvrx", "nvrx-fswa", "shm-block", "shm-async"]
CUDA_ONLY = {}  # every system runs on CPU in the smoke mode; filled if one cannot
COLOCATED_ORDER = ["none", "shm-async", "nvrx-fswa", "nvrx", "dcp", "dcp-shm", "shm-block", "torch"]

# model sizes: state = 12 bytes/param (fp32 weights, exp_avg, exp_avg_sq) + AdamW step scalars
SIZES = {
    "tiny": dict(d=64, layers=2, heads=2, vocab=512, seq=64, batch=2),
    "8g": dict(d=1536, layers=24, heads=12, vocab=32768, seq=1024, batch=4),
    "16g": dict(d=2048, layers=27, heads=16, vocab=32768, seq=1024, batch=4),
}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, int(math.ceil(q / 100.0 * len(xs))) - 1))
    return xs[k]


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------
def build_model(cfg, device, seed):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.tok = nn.Embedding(c["vocab"], c["d"])
            self.pos = nn.Embedding(c["seq"], c["d"])
            self.blocks = nn.ModuleList(Block(c["d"], c["heads"]) for _ in range(c["layers"]))
            self.lnf = nn.LayerNorm(c["d"])

        def forward(self, idx, tgt):
            T = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = self.lnf(x) @ self.tok.weight.t()  # tied head
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    torch.manual_seed(seed)
    with torch.device(device):
        m = GPT(cfg)
    return m


def build_optimizer(model, device, fused):
    import torch

    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    mode = fused
    if fused == "auto":
        mode = "fused" if device == "cuda" else "foreach"
    if mode == "fused":
        try:
            return torch.optim.AdamW(model.parameters(), fused=True, **kw), "fused"
        except Exception as e:
            log(f"fused AdamW unavailable ({e!r}); using foreach")
            mode = "foreach"
    return torch.optim.AdamW(model.parameters(), foreach=(mode == "foreach"), **kw), mode


def flat_state(model, opt):
    """The checkpointed state, the same dict for every system: references to
    the live tensors (no copies): model.<param name>, optim.<i>.<key>."""
    sd = {}
    idx = {}
    for i, (n, p) in enumerate(model.named_parameters()):
        sd[f"model.{n}"] = p.detach()
        idx[id(p)] = i
    for p, st in opt.state.items():
        i = idx[id(p)]
        for k, v in st.items():
            if hasattr(v, "detach"):
                sd[f"optim.{i}.{k}"] = v.detach()
    return sd


def state_nbytes(sd):
    return sum(t.numel() * t.element_size() for t in sd.values())


class Trainer:
    def __init__(self, cfg, device, fused, seed):
        import torch

        self.torch = torch
        self.cfg = cfg
        self.device = device
        self.model = build_model(cfg, device, seed)
        self.opt, self.opt_mode = build_optimizer(self.model, device, fused)
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed + 1)
        self.step_no = 0
        self.autocast = torch.autocast(device_type=device, dtype=torch.bfloat16)
        self.state = None

    def batch(self):
        c = self.cfg
        t = self.torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), device=self.device, generator=self.gen)
        return t[:, :-1], t[:, 1:]

    def fwd_bwd(self):
        x, y = self.batch()
        with self.autocast:
            loss = self.model(x, y)
        loss.backward()
        return loss

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def build_state(self):
        self.state = flat_state(self.model, self.opt)
        return self.state

    def params(self):
        return sum(p.numel() for p in self.model.parameters())


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


# ----------------------------------------------------------------------------
# systems
# ----------------------------------------------------------------------------


def dir_bytes(path):
    tot = 0
    for root, _d, files in os.walk(path):
        for fn in files:
            try:
                tot += os.lstat(os.path.join(root, fn)).st_blocks * 512
            except OSError:
                pass
    return tot


class Deleter:
    """Deletes old checkpoints in a background thread (keeps the trainer's
    thread out of unlink time)."""

    def __init__(self):
        self.ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deleter")
        self.futs = []

    def delete(self, path):
        self.futs.append(self.ex.submit(shutil.rmtree, path, True))

    def wait(self):
        for f in self.futs:
            f.result()
        self.futs = []


class System:
    """One checkpointing system inside the training loop.
    save(): called right after opt.step() of a checkpoint iteration (timed as part of it).
    before_step(): called before every opt.step() (DCP waits for staging there).
    poll(): called at the end of every iteration; records durability.
    drain(): waits until every save is durable (outside the timed iterations)."""

    name = "?"
    in_process_cuda_ok = True

    def __init__(self, ctx):
        self.ctx = ctx
        self.base = os.path.join(ctx.ckpt_dir, self.name)
        os.makedirs(self.base, exist_ok=True)
        self.pending = []  # records not yet durable
        self.done_dirs = collections.deque()
        self.n = 0
        self.notes = []
        self.api = ""

    def path_for(self, step):
        self.n += 1
        return os.path.join(self.base, f"step-{step:08d}")

    def mark_durable(self, rec, t=None):
        rec["durable_s"] = (t if t is not None else now()) - rec["t0"]
        rec["durable_at_global_iter"] = self.ctx.global_iter
        d = rec.get("dir")
        if d:
            self.done_dirs.append(d)
            while len(self.done_dirs) > self.ctx.keep_last:
                self.ctx.deleter.delete(self.done_dirs.popleft())

    def before_step(self):
        return 0.0

    def poll(self):
        pass

    def drain(self, timeout):
        pass

    def segment_end_cleanup(self):
        while self.done_dirs:
            self.ctx.deleter.delete(self.done_dirs.popleft())

    def release_refs(self):
        pass

    def close(self):
        pass


class SysNone(System):
    name = "none"

    def save(self, step, state, rec):
        raise RuntimeError("none does not checkpoint")


class SysTorch(System):
    name = "torch"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.api = "torch.save(state, path); os.fsync(os.open(path, O_RDONLY))  (both on the trainer thread)"

    def save(self, step, state, rec):
        import torch

        d = self.path_for(step)
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, "state.pt")
        rec["dir"] = d
        torch.save(state, p)
        rec["staged_s"] = now() - rec["t0"]
        fsync_path(p)
        self.mark_durable(rec)


#: Host-memory peaks below this are noise when the DCP path is compared with the native one.
MEM_FLOOR = 64 * MiB


def dcp_state(ctx, state):
    """The state the DCP systems hand to async_save. --dcp-state nested (default): as
    torchtitan and Megatron pass it, a few top-level entries, {"model": {...}, "optim":
    {...}}, which DCP flattens to the same names as the other systems' flat dict. flat: the
    other systems' dict of 1,312 top-level keys, for which DCP's async_save itself spends
    0.07-0.10 s a call (its logger wrapper and Stateful check run once per top-level key;
    docs/dcp.md). Built once per state, outside the timed call."""
    if ctx.args.dcp_state == "flat":
        return state
    cached = getattr(ctx, "_dcp_nested", None)
    if cached is not None and cached[0] is state:
        return cached[1]
    nested = {}
    for k, v in state.items():
        top, rest = k.split(".", 1)
        nested.setdefault(top, {})[rest] = v
    ctx._dcp_nested = (state, nested)
    return nested


def dcp_planner(ctx):
    """The save planner of the DCP systems: DCP's default, with its plan caching when
    --dcp-plan-caching on (the same for dcp and dcp-shm)."""
    if ctx.args.dcp_plan_caching != "on":
        return None
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return DefaultSavePlanner(enable_plan_caching=True)


class SysDCP(System):
    name = "dcp"

    def __init__(self, ctx):
        super().__init__(ctx)
        from torch.distributed.checkpoint.staging import StagingOptions

        cuda = ctx.cuda
        self.opts = StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=cuda, use_non_blocking_copy=cuda)
        self.staging = None  # (rec, future)
        self.last_upload = None
        self.api = (
            "dcp.async_save(state, storage_writer=FileSystemWriter(dir, thread_count=T, sync_files=True, overwrite=True), "
            "async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=DefaultStager(StagingOptions(pinned, shared, "
            "async, non_blocking))); before the next opt.step(): staging_completion.result(); before the next async_save: the "
            "previous upload_completion.result()"
        )
        self.notes.append("a new DefaultStager per save (torch 2.11: a second stage() on one DefaultStager raises KeyError(<class 'type'>)), closed on the trainer thread once its upload is done (stager_close_s)")
        if not cuda:
            self.notes.append("--device cpu: StagingOptions(pinned=False, shared=True, async=False, non_blocking=False)")
        self._note_dcp_call()

    def _note_dcp_call(self):
        """Notes of how both DCP systems call async_save (planner, state form)."""
        if self.ctx.args.dcp_plan_caching == "on":
            self.notes.append("planner=DefaultSavePlanner(enable_plan_caching=True) (--dcp-plan-caching on)")
        self.notes.append(f"state passed to async_save: --dcp-state {self.ctx.args.dcp_state}")

    def save(self, step, state, rec):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        sd = dcp_state(self.ctx, state)

        def call(d):
            writer = dcp.FileSystemWriter(d, thread_count=self.ctx.threads, sync_files=True, overwrite=True)
            stager = DefaultStager(self.opts)
            rec["_stager"] = stager  # closed once its upload is done (see _close_stager)
            return dcp.async_save(
                sd, storage_writer=writer, planner=dcp_planner(self.ctx), async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager
            )

        self._save_with(step, rec, call)

    @staticmethod
    def _close_stager(rec):
        """Close the save's DefaultStager once its upload is done (on the trainer thread,
        where a user's loop would do it): it frees the stager's pinned shared-memory copy
        of the state at a known point of this system's own segment, instead of whenever
        the garbage collector finds it, possibly inside another system's segment."""
        stager = rec.pop("_stager", None)
        if stager is not None:
            t = now()
            stager.close()
            rec["stager_close_s"] = now() - t

    def _save_with(self, step, rec, call):
        """Wait for the previous upload (backpressure), then `call(dir)` (an async_save)
        and track its staging and upload futures."""
        t = now()
        if self.last_upload is not None and not self.last_upload.done():
            self.last_upload.result(timeout=self.ctx.timeout)
        rec["waited_previous_s"] = now() - t
        self._poll_uploads()
        d = self.path_for(step)
        rec["dir"] = d
        resp = call(d)
        rec["return_s"] = now() - rec["t0"]
        if hasattr(resp, "staging_completion"):
            self.staging = (rec, resp.staging_completion)
            up = resp.upload_completion
        else:
            rec["staged_s"] = rec["return_s"]
            up = resp
        self.last_upload = up
        self.pending.append((rec, up))

    def before_step(self):
        if self.staging is None:
            return 0.0
        rec, fut = self.staging
        t = now()
        fut.result(timeout=self.ctx.timeout)
        w = now() - t
        rec["staged_s"] = now() - rec["t0"]
        rec["staging_wait_s"] = w
        self.staging = None
        return w

    def _poll_uploads(self):
        keep = []
        for rec, fut in self.pending:
            if fut.done():
                fut.result()
                self.mark_durable(rec)
                self._close_stager(rec)
            else:
                keep.append((rec, fut))
        self.pending = keep

    def poll(self):
        self._poll_uploads()

    def drain(self, timeout):
        self.before_step()
        for rec, fut in self.pending:
            fut.result(timeout=timeout)
            self.mark_durable(rec)
            self._close_stager(rec)
        self.pending = []

    def release_refs(self):
        self.staging = None
        self.last_upload = None

    def close(self):
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


class SysDCPShm(SysDCP):
    """DCP async_save with shmckpt as its stager and storage (issue 13): the same calls as
    `dcp`, with ShmckptWriter in place of FileSystemWriter + DefaultStager + a process."""

    name = "dcp-shm"

    def __init__(self, ctx):
        System.__init__(self, ctx)
        from shmckpt.dcp import ShmckptWriter  # noqa: F401  (fails early if missing)

        from shmckpt.dcp import prepare

        self.staging = None
        self.last_upload = None
        self.capacity = int(ctx.state_bytes + 256 * MiB)
        # The documented start-up call, outside the timed loop (as shm-block's Checkpointer
        # open and prepare_cuda): the writers' engine and its arena are made and registered
        # now, not in the first save.
        self.prepared = prepare(self.base, staging_capacity=self.capacity)
        self.api = (
            f"shmckpt.dcp.prepare(dir, staging_capacity={self.capacity}) at start-up; "
            f"dcp.async_save(state, storage_writer=ShmckptWriter(dir/step, staging_capacity={self.capacity})) "
            "(DCP's default THREAD checkpointer; ShmckptWriter is the AsyncStager: the call returns once staged); "
            "before the next async_save: the previous upload_completion.result()"
        )
        self.notes.append(
            "staging_capacity = state + 256 MiB (one arena per process, reused by every save; shmckpt.dcp.release() at close); "
            f"prepare at start-up, outside the timed loop: open {self.prepared['open_s']:.2f} s, "
            f"CUDA registration {self.prepared['cuda_registration_s'] or 0.0:.2f} s"
        )
        self._note_dcp_call()

    def save(self, step, state, rec):
        import torch.distributed.checkpoint as dcp
        from shmckpt.dcp import ShmckptWriter

        w = {}
        sd = dcp_state(self.ctx, state)

        def call(d):
            w["writer"] = ShmckptWriter(d, staging_capacity=self.capacity)
            return dcp.async_save(sd, storage_writer=w["writer"], planner=dcp_planner(self.ctx))

        self._save_with(step, rec, call)
        # Where the call's time went (DCP's own work is the rest of return_s).
        rec["stage_detail"] = dict(w["writer"].last_stage)

    def close(self):
        from shmckpt.dcp import release

        release()


class _NVRxBase(System):
    def _queue(self):
        raise NotImplementedError

    def _finalized(self, idx):
        pass

    def poll(self):
        # finalized calls come back in FIFO order; the returned indices are not
        # usable (NVRx 0.4.1 keeps the request's default call_idx on the trainer side)
        q = self._queue()
        for _ in q.maybe_finalize_async_calls(blocking=False, no_dist=True):
            self._finalized(self.fifo.popleft())

    def drain(self, timeout):
        deadline = time.monotonic() + timeout
        q = self._queue()
        while self.pending:
            self.poll()
            self._poll_fsyncs()
            if not self.pending:
                break
            proc = getattr(getattr(q, "persistent_caller", None), "process", None)
            if proc is not None and not proc.is_alive():
                raise RuntimeError(f"NVRx worker died (exitcode {proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: saves not durable after {timeout}s")
            time.sleep(0.005)

    def _poll_fsyncs(self):
        pass


class SysNVRx(_NVRxBase):
    name = "nvrx"

    def __init__(self, ctx):
        super().__init__(ctx)
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint

        self.ck = TorchAsyncCheckpoint(persistent_queue=True)
        self.fifo = collections.deque()
        self.fsync_ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nvrx-fsync")
        self.fsyncs = []
        self.api = (
            "ck = TorchAsyncCheckpoint(persistent_queue=True); ck.async_save(state, path); every iteration "
            "ck._async_calls_queue.maybe_finalize_async_calls(blocking=False, no_dist=True); on finalize os.fsync(path) in a "
            "helper thread (the worker's torch.save does not fsync)"
        )
        self.notes.append("durable = finalize seen by the per-iteration poll + fsync in a helper thread (resolution: one iteration)")

    def _queue(self):
        return self.ck._async_calls_queue

    def save(self, step, state, rec):
        d = self.path_for(step)
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, "state.pt")
        rec["dir"] = d
        q = self._queue()
        rec["queue_depth"] = q.get_num_unfinalized_calls() + len(self.fsyncs)
        self.ck.async_save(state, p)
        rec["staged_s"] = now() - rec["t0"]
        self.fifo.append((rec, p))
        self.pending.append(rec)

    def _finalized(self, item):
        rec, p = item
        rec["finalized_s"] = now() - rec["t0"]

        def fs():
            fsync_path(p)
            return now()

        self.fsyncs.append((rec, self.fsync_ex.submit(fs)))

    def _poll_fsyncs(self):
        keep = []
        for rec, f in self.fsyncs:
            if f.done():
                self.mark_durable(rec, f.result())
                self.pending.remove(rec)
            else:
                keep.append((rec, f))
        self.fsyncs = keep

    def poll(self):
        super().poll()
        self._poll_fsyncs()

    def close(self):
        nvrx_close(self._queue(), lambda: self.ck.finalize_async_save(blocking=True, no_dist=True, terminate=True))
        self.fsync_ex.shutdown(wait=True)


class SysNVRxFSWA(_NVRxBase):
    name = "nvrx-fswa"

    def __init__(self, ctx):
        super().__init__(ctx)
        import inspect

        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import CheckpointMetadataCache

        wp = inspect.signature(FileSystemWriterAsync.__init__).parameters
        qp = inspect.signature(AsyncCallsQueue.__init__).parameters
        self.writer_kw = {"thread_count": ctx.threads}
        queue_kw = {"persistent": True}
        if "use_cpu_shm_for_gpu_tensors" in wp:
            self.writer_kw["use_cpu_shm_for_gpu_tensors"] = True
            if "cpu_shm_mode" in qp:
                queue_kw["cpu_shm_mode"] = True
            self.notes.append("use_cpu_shm_for_gpu_tensors=True")
        else:
            self.notes.append("NVRx without use_cpu_shm_for_gpu_tensors (0.4.1): GPU tensors reach the worker as CUDA IPC handles; the worker does the D2H while the trainer waits in schedule_async_request")
        self.q = AsyncCallsQueue(**queue_kw)
        self.cache = CheckpointMetadataCache()
        self.fifo = collections.deque()
        self.api = (
            f"q = AsyncCallsQueue(**{queue_kw}); per save: w = FileSystemWriterAsync(dir, **{self.writer_kw}); "
            "ret = save_state_dict_async_plan(state, w, None, 0, planner=DefaultSavePlanner(), enable_cache=True, metadata_cache=cache); "
            "fn, preload_fn, args = w.get_save_function_and_args(); q.schedule_async_request(AsyncRequest(fn, args, "
            "[partial(save_state_dict_async_finalize, *ret)], preload_fn=preload_fn)); every iteration "
            "q.maybe_finalize_async_calls(blocking=False, no_dist=True)"
        )
        self.notes.append("durable = finalize (writes .metadata, fsync) seen by the per-iteration poll (resolution: one iteration)")

    def _queue(self):
        return self.q

    def save(self, step, state, rec):
        from torch.distributed.checkpoint import DefaultSavePlanner

        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_finalize, save_state_dict_async_plan

        d = self.path_for(step)
        rec["dir"] = d
        rec["queue_depth"] = self.q.get_num_unfinalized_calls()
        w = FileSystemWriterAsync(d, **self.writer_kw)
        ret = save_state_dict_async_plan(state, w, None, 0, planner=DefaultSavePlanner(), enable_cache=True, metadata_cache=self.cache)
        fn, preload_fn, args = w.get_save_function_and_args()
        self.q.schedule_async_request(AsyncRequest(fn, args, [partial(save_state_dict_async_finalize, *ret)], preload_fn=preload_fn))
        rec["staged_s"] = now() - rec["t0"]
        self.fifo.append(rec)
        self.pending.append(rec)

    def _finalized(self, rec):
        self.mark_durable(rec)
        self.pending.remove(rec)

    def close(self):
        nvrx_close(self.q, self.q.close)
        try:
            from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

            if hasattr(FileSystemWriterAsync, "cleanup_tensor_caches"):
                FileSystemWriterAsync.cleanup_tensor_caches()
        except Exception:
            pass


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except Exception:
        return repr(x)


class ShmShared:
    """One shmckpt Checkpointer shared by shm-block and shm-async (one set of
    staging buffers), with guard(opt) installed on the optimizer from the start
    of the run, so every system's segments run with the same opt.step()."""

    def __init__(self, ctx):
        import shmckpt  # noqa: F401  (lazy: an import error is recorded per row)

        self.mod = shmckpt
        self.root = os.path.join(ctx.ckpt_dir, "shmckpt")
        os.makedirs(self.root, exist_ok=True)
        # staging_capacity: the largest file a save can stage (default 2 GiB); the whole
        # state goes in one file per rank, so: state + 256 MiB for the header and alignment
        self.staging_capacity = ctx.args.shm_staging_bytes or (ctx.state_bytes + 256 * MiB)
        self.kwargs = {"keep_last": ctx.keep_last, "staging_capacity": int(self.staging_capacity)}
        t = now()
        self.ck = shmckpt.Checkpointer(self.root, **self.kwargs)
        self.open_s = now() - t
        self.guarded = None  # weakref: holding the optimizer would keep its tensors alive

    def guard(self, opt):
        import weakref

        if self.guarded is None or self.guarded() is not opt:
            self.ck.guard(opt)
            self.guarded = weakref.ref(opt)

    def close(self):
        self.ck.close()


class _Shm(System):
    blocking = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.shared = ctx.get_shm()
        self.api = (
            f"ckpt = shmckpt.Checkpointer(root, **{self.shared.kwargs}); ckpt.guard(opt) once; "
            + ("h = ckpt.save(step, state)" if self.blocking else "h = ckpt.save(step, state, blocking=False)")
            + "; every iteration h.done(); at the end h.wait()"
        )
        self.notes.append("one Checkpointer (root dir/shmckpt) shared by shm-block and shm-async; guard(opt) installed before the first timed iteration of every system")
        self.notes.append("durable = h.done() seen by the per-iteration poll (resolution: one iteration); keep_last handled by shmckpt")

    def save(self, step, state, rec):
        rec["queue_depth"] = len(self.pending)
        if self.blocking:
            h = self.shared.ck.save(step, state)
        else:
            h = self.shared.ck.save(step, state, blocking=False)
        rec["return_s"] = now() - rec["t0"]
        if self.blocking:
            rec["staged_s"] = rec["return_s"]
        self.pending.append((rec, h))

    def poll(self):
        keep = []
        for rec, h in self.pending:
            if "staged_s" not in rec and h.staged():
                rec["staged_s"] = now() - rec["t0"]  # resolution: one iteration
            if h.done():
                rep = h.wait()  # raises the save's error, if any
                self.mark_durable(rec)
                rec["report"] = _jsonable(rep)
            else:
                keep.append((rec, h))
        self.pending = keep

    def drain(self, timeout):
        for rec, h in self.pending:
            if not self.blocking and "staged_s" not in rec:
                h.wait_staged()
                rec["staged_s_at_drain"] = now() - rec["t0"]
            rep = h.wait()
            self.mark_durable(rec)
            rec["report"] = _jsonable(rep)
        self.pending = []

    def segment_end_cleanup(self):
        self.done_dirs.clear()  # shmckpt's keep_last owns its directories


class SysShmBlock(_Shm):
    name = "shm-block"
    blocking = True


class SysShmAsync(_Shm):
    name = "shm-async"
    blocking = False


SYSTEM_CLASSES = {
    "none": SysNone,
    "torch": SysTorch,
    "dcp": SysDCP,
    "dcp-shm": SysDCPShm,
    "nvrx": SysNVRx,
    "nvrx-fswa": SysNVRxFSWA,
    "shm-block": SysShmBlock,
    "shm-async": SysShmAsync,
}


# ----------------------------------------------------------------------------
# run context
# ----------------------------------------------------------------------------
class Ctx:
    def __init__(self, args, out_dir):
        self.args = args
        self.out_dir = out_dir
        self.device = args.device
        self.cuda = args.device == "cuda"
        self.ckpt_dir = os.path.abspath(args.dir)
        self.keep_last = args.keep_last
        self.threads = args.threads
        self.timeout = args.timeout
        self.deleter = Deleter()
        self.global_iter = 0
        self.systems = {}
        self.failed = {}
        self.shm = None
        self.shm_error = None
        self.iters = []  # per-iteration rows
        self.ckpts = []  # per-checkpoint records
        self.segments = []
        self.state_bytes = 0

    def low_host_memory(self):
        """True when host used (MemTotal - MemAvailable) + 2 x state + 8 GiB
        exceeds --host-mem-gib: one more save could get the whole run
        OOM-killed (e.g. NVRx queueing saves in shared memory).  Not based on
        MemAvailable alone: on the GPU machines memory can start small and grow
        as it is used (KINDS.md), so MemTotal/MemAvailable understate the limit."""
        used = host_used()
        if used is None:
            return False
        return used + 2 * self.state_bytes + 8 * GiB > self.args.host_mem_gib * GiB

    def get_shm(self):
        if self.shm is None:
            if self.shm_error is not None:
                raise RuntimeError(self.shm_error)
            try:
                self.shm = ShmShared(self)
            except Exception as e:
                self.shm_error = f"{type(e).__name__}: {e}"
                raise
        return self.shm

    def system(self, name):
        """Lazily builds a system; a failure is recorded and the system skipped from then on."""
        if name in self.failed:
            return None
        if name not in self.systems:
            try:
                t = now()
                self.systems[name] = SYSTEM_CLASSES[name](self)
                self.systems[name].setup_s = now() - t
            except Exception as e:
                self.failed[name] = {"error": f"setup: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                log(f"  {name}: setup FAILED: {e!r}")
                return None
        return self.systems[name]

    def fail(self, name, stage, e):
        self.failed[name] = {"error": f"{stage}: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        log(f"  {name}: FAILED in {stage}: {e!r}")
        s = self.systems.get(name)
        if s is not None:
            try:
                s.release_refs()
                s.close()
            except Exception as e2:
                log(f"  {name}: close after failure: {e2!r}")


# ----------------------------------------------------------------------------
# one segment: n iterations of one system
# ----------------------------------------------------------------------------
def run_segment(ctx, tr, sampler, name, phase, rnd, k, nckpt, lead):
    import torch

    sysobj = ctx.system(name) if name != "none" else SysNone(ctx)
    if sysobj is None:
        return None
    n_iters = lead + nckpt * k if nckpt else lead + max(1, ctx.base_ckpts) * k
    ck_iters = {lead - 1 + j * k for j in range(nckpt)} if name != "none" else set()
    seg = {"system": name, "phase": phase, "round": rnd, "k": k, "n_iters": n_iters, "checkpoints": len(ck_iters), "first_global_iter": ctx.global_iter, "ok": True}
    state = tr.state
    tr.sync()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    seg["gpu_start"] = gpu_snapshot(ctx.cuda)
    sampler.mark()
    t_seg = now()
    it_rows = []
    recs = []
    try:
        for i in range(n_iters):
            t0 = now()
            tr.fwd_bwd()
            t1 = now()
            wait = sysobj.before_step()
            t2 = now()
            tr.step()
            t3 = now()
            rec = None
            if i in ck_iters and ctx.low_host_memory():
                rec = {"system": name, "phase": phase, "round": rnd, "step": tr.step_no, "global_iter": ctx.global_iter, "seg_iter": i, "k": k, "skipped": "host used + 2 x state + 8 GiB > --host-mem-gib"}
                ctx.ckpts.append(rec)
                log(f"  {name}: checkpoint at step {tr.step_no} SKIPPED, host memory low")
                rec = None
            elif i in ck_iters:
                rec = {"system": name, "phase": phase, "round": rnd, "step": tr.step_no, "global_iter": ctx.global_iter, "seg_iter": i, "k": k, "t0": now()}
                rec["pending_at_call"] = len(sysobj.pending)
                rec["wall_at_call"] = elapsed()
                sysobj.save(tr.step_no, state, rec)
                rec["call_s"] = now() - rec["t0"]
                recs.append(rec)
                ctx.ckpts.append(rec)
            t4 = now()
            sysobj.poll()
            tr.sync()
            t5 = now()
            row = {
                "g": ctx.global_iter,
                "system": name,
                "phase": phase,
                "round": rnd,
                "i": i,
                "step": tr.step_no,
                "dt": t5 - t0,
                "fwd_bwd_cpu": t1 - t0,
                "pre_step_wait": wait,
                "opt_step_cpu": t3 - t2,
                "ckpt_call": (t4 - t3) if rec is not None else 0.0,
                "poll_sync": t5 - t4,
                "ckpt": 1 if rec is not None else 0,
            }
            it_rows.append(row)
            ctx.iters.append(row)
            ctx.global_iter += 1
        seg["iters_s"] = now() - t_seg
        t = now()
        sysobj.drain(ctx.timeout)
        tr.sync()
        seg["drain_s"] = now() - t
    except Exception as e:
        seg["ok"] = False
        seg["error"] = f"{type(e).__name__}: {e}"
        ctx.fail(name, f"{phase} round {rnd}", e)
    seg["wall_s"] = now() - t_seg
    seg["gpu_after_durable"] = gpu_snapshot(ctx.cuda)
    if ctx.cuda:
        seg["gpu_peak_reserved"] = torch.cuda.max_memory_reserved()
        seg["gpu_peak_allocated"] = torch.cuda.max_memory_allocated()
        a, b = seg["gpu_start"], seg["gpu_after_durable"]
        seg["gpu_device_used_held_after_durable"] = b["device_used"] - a["device_used"]
        seg["gpu_reserved_held_after_durable"] = b["reserved"] - a["reserved"]
    seg["host"] = sampler.window()
    seg["pending_after"] = len(getattr(sysobj, "pending", []))
    # Collect this segment's garbage now (outside the timed iterations), so that memory a
    # system left for the collector (staging buffers, futures) is never freed inside the
    # next system's segment.
    t = now()
    gc.collect()
    seg["gc_after_s"] = now() - t
    sysobj.segment_end_cleanup()
    t = now()
    ctx.deleter.wait()
    seg["delete_wait_s"] = now() - t
    dts = [r["dt"] for r in it_rows]
    seg["mean_iter_s"] = mean(dts)
    seg["median_iter_s"] = med(dts)
    seg["p99_iter_s"] = pct(dts, 99)
    seg["last_global_iter"] = ctx.global_iter - 1
    for rec in recs:
        rec.pop("t0", None)
    ctx.segments.append(seg)
    extra = ""
    if recs:
        extra = " call " + ",".join(f"{r.get('call_s', 0):.2f}" for r in recs) + " durable " + ",".join(f"{r['durable_s']:.2f}" if r.get("durable_s") is not None else "-" for r in recs)
    log(
        f"  [{phase} r{rnd}] {name:9s} {n_iters} it mean {seg['mean_iter_s'] * 1e3 if seg['mean_iter_s'] else 0:.1f} ms "
        f"p99 {(seg['p99_iter_s'] or 0) * 1e3:.1f} ms wall {seg['wall_s']:.1f}s drain {seg.get('drain_s', 0):.2f}s{extra}"
        + ("" if seg["ok"] else f" FAILED {seg['error']}")
    )
    return seg


# ----------------------------------------------------------------------------
# colocated case
# ----------------------------------------------------------------------------
def measure_free(tr_holder):
    """Drops the trainer in tr_holder["tr"] (weights, grads, optimizer state,
    the flat state dict), then reads mem_get_info without empty_cache, then
    after one (timed) empty_cache."""
    import torch

    out = {}
    tr = tr_holder["tr"]
    tr.sync()
    gc.collect()
    before = gpu_snapshot(True)
    out["before_free"] = before
    tr_holder["tr"] = None
    tr.state = None
    del tr
    gc.collect()
    torch.cuda.synchronize()
    time.sleep(0.2)
    gc.collect()
    a = gpu_snapshot(True)
    out["after_free"] = a
    out["freed_by_trainer_bytes"] = before["allocated"] - a["allocated"]
    out["device_returned_without_empty_cache_bytes"] = a["device_free"] - before["device_free"]
    t = now()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    out["empty_cache_s"] = now() - t
    b = gpu_snapshot(True)
    out["after_empty_cache"] = b
    out["device_returned_after_empty_cache_bytes"] = b["device_free"] - before["device_free"]
    # what torch's allocator gave up but the device did not get back (e.g. blocks kept alive by CUDA IPC)
    out["not_returned_bytes"] = (before["reserved"] - b["reserved"]) - out["device_returned_after_empty_cache_bytes"]
    # device memory in use that torch's allocator in this process does not account for (contexts of
    # every process on the GPU, IPC-retained blocks, other processes' allocations)
    out["device_used_not_torch_reserved_bytes"] = b["device_used"] - b["reserved"]
    return out


def colocated_trial(ctx, cfg, name, sampler, iters=3):
    """A fresh trainer (guarded by shmckpt only for the shm-* systems), `iters`
    steps, one save through `name`, wait until durable, then free weights,
    grads and optimizer state as an RL trainer does before generation, and
    measure the device memory that came back (measure_free)."""
    out = {"system": name, "ok": True}
    sysobj = None
    if name != "none":
        sysobj = ctx.system(name)
        if sysobj is None:
            return {"system": name, "ok": False, "error": ctx.failed.get(name, {}).get("error")}
    holder = {}
    try:
        t = now()
        holder["tr"] = tr = Trainer(cfg, ctx.device, ctx.args.fused, ctx.args.seed)
        if name.startswith("shm-"):
            ctx.shm.guard(tr.opt)
        for _ in range(iters):
            tr.fwd_bwd()
            if sysobj:
                sysobj.before_step()
            tr.step()
        tr.build_state()
        tr.sync()
        out["build_s"] = now() - t
        if sysobj is not None:
            rec = {"system": name, "phase": "colocated", "round": 0, "step": tr.step_no, "global_iter": ctx.global_iter, "t0": now()}
            sysobj.save(tr.step_no, tr.state, rec)
            rec["call_s"] = now() - rec["t0"]
            sysobj.before_step()
            sysobj.drain(ctx.timeout)
            rec.pop("t0", None)
            out["save"] = rec
            sysobj.release_refs()
            sysobj.segment_end_cleanup()
            ctx.deleter.wait()
        del tr
        out.update(measure_free(holder))
    except Exception as e:
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        holder.clear()
        if name != "none":
            ctx.fail(name, "colocated", e)
        gc.collect()
    out["host"] = sampler.window()
    return out


# ----------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------
def summarize(ctx, results):
    # baseline: the main phase's none segments (or, with --rounds 0, the fast phase's)
    base_phase = "main" if any(r["system"] == "none" and r["phase"] == "main" for r in ctx.iters) else "fast"
    base_rows = [r for r in ctx.iters if r["system"] == "none" and r["phase"] == base_phase]
    base_med = med([r["dt"] for r in base_rows])
    base_mean = mean([r["dt"] for r in base_rows])
    iters_by = collections.defaultdict(list)
    for r in ctx.iters:
        iters_by[(r["phase"], r["system"])].append(r)
    segs_by = collections.defaultdict(list)
    for s in ctx.segments:
        segs_by[(s["phase"], s["system"])].append(s)
    base_segs = [s for s in ctx.segments if s["system"] == "none" and s["phase"] == base_phase and s["ok"]]
    base_reserved = med([s.get("gpu_peak_reserved") for s in base_segs])
    base_alloc = med([s.get("gpu_peak_allocated") for s in base_segs])
    first_ckpt_iter = {}
    for c in ctx.ckpts:
        if not c.get("skipped"):
            first_ckpt_iter.setdefault(c["system"], c["global_iter"])
    summary = {}
    for phase in ("main", "fast"):
        rows_out = {}
        ph_base = [r["dt"] for r in iters_by.get((phase, "none"), [])]
        ph_base_mean = mean(ph_base) if ph_base else None
        for name in SYSTEMS:
            rows = iters_by.get((phase, name), [])
            segs = segs_by.get((phase, name), [])
            if not rows and name not in ctx.failed:
                continue
            r = {"system": name}
            if name in ctx.failed:
                r["error"] = ctx.failed[name]["error"]
            if rows:
                dts = [x["dt"] for x in rows]
                r["iters"] = len(dts)
                r["mean_iter_s"] = mean(dts)
                r["median_iter_s"] = med(dts)
                r["p99_iter_s"] = pct(dts, 99)
                if base_mean:
                    r["overhead_pct"] = 100.0 * (r["mean_iter_s"] / base_mean - 1.0)
                if phase != "main" and ph_base_mean:
                    r["overhead_vs_phase_none_pct"] = 100.0 * (r["mean_iter_s"] / ph_base_mean - 1.0)
                # per-segment overhead (vs the mean of all baseline segments): spread across rounds
                r["segment_overhead_pct"] = [100.0 * (s["mean_iter_s"] / base_mean - 1.0) for s in segs if s.get("mean_iter_s") and base_mean]
                r["segment_overhead_pct_median"] = med(r["segment_overhead_pct"])
                # steady state: rounds after the first (the first pays worker spawns, first pinned allocations)
                st_rows = [x for x in rows if x["round"] > 1]
                st_base = [x["dt"] for x in ctx.iters if x["system"] == "none" and x["phase"] == phase and x["round"] > 1]
                if st_rows and base_mean:
                    r["mean_iter_steady_s"] = mean([x["dt"] for x in st_rows])
                    r["overhead_steady_pct"] = 100.0 * (r["mean_iter_steady_s"] / base_mean - 1.0)
                    if st_base:
                        r["overhead_steady_vs_steady_base_pct"] = 100.0 * (r["mean_iter_steady_s"] / mean(st_base) - 1.0)
            ck = [c for c in ctx.ckpts if c["system"] == name and c["phase"] == phase and not c.get("skipped")]
            r["checkpoints_skipped_low_memory"] = sum(1 for c in ctx.ckpts if c["system"] == name and c["phase"] == phase and c.get("skipped"))
            if ck and base_med is not None:
                byg = {x["g"]: x["dt"] for x in rows}
                stalls = []
                for c in ck:
                    g = c["global_iter"]
                    ex = sum(max(0.0, byg.get(g + j, base_med) - base_med) for j in range(3))
                    c["stall_excess_s"] = ex
                    stalls.append(ex)
                steady = [c for c in ck if c["global_iter"] != first_ckpt_iter.get(name)]
                ss = [c["stall_excess_s"] for c in steady] or stalls
                r["checkpoints"] = len(ck)
                r["first_checkpoint_stall_s"] = ck[0]["stall_excess_s"] if ck[0]["global_iter"] == first_ckpt_iter.get(name) else None
                r["stall_max_s"] = max(ss)
                r["stall_median_s"] = med(ss)
                r["call_median_s"] = med([c.get("call_s") for c in steady] or [c.get("call_s") for c in ck])
                dur = [c.get("durable_s") for c in steady if c.get("durable_s") is not None] or [c.get("durable_s") for c in ck if c.get("durable_s") is not None]
                r["durable_median_s"] = med(dur)
                r["durable_max_s"] = max(dur) if dur else None
                r["max_pending_at_call"] = max(c.get("pending_at_call", 0) for c in ck)
            if segs and ctx.cuda:
                pr = med([s.get("gpu_peak_reserved") for s in segs])
                pa = med([s.get("gpu_peak_allocated") for s in segs])
                r["gpu_peak_reserved_bytes"] = pr
                r["gpu_peak_allocated_bytes"] = pa
                r["gpu_peak_reserved_vs_base_bytes"] = (pr - base_reserved) if (pr is not None and base_reserved is not None) else None
                r["gpu_peak_allocated_vs_base_bytes"] = (pa - base_alloc) if (pa is not None and base_alloc is not None) else None
                held = [s.get("gpu_device_used_held_after_durable") for s in segs]
                r["gpu_device_used_held_after_durable_first_bytes"] = held[0]
                r["gpu_device_used_held_after_durable_max_later_bytes"] = max(held[1:]) if len(held) > 1 else None
                r["gpu_reserved_held_after_durable_max_bytes"] = max(s.get("gpu_reserved_held_after_durable") or 0 for s in segs)
            if segs:
                r["host_rss_tree_peak_delta_bytes"] = max(s["host"].get("rss_tree_peak_delta") or 0 for s in segs)
                r["host_rss_tree_peak_bytes"] = max(s["host"].get("rss_tree_peak") or 0 for s in segs)
                r["dev_shm_peak_delta_bytes"] = max(s["host"].get("shm_peak_delta") or 0 for s in segs)
                r["dev_shm_peak_bytes"] = max(s["host"].get("shm_peak") or 0 for s in segs)
                r["host_used_peak_delta_bytes"] = max(s["host"].get("host_used_peak_delta") or 0 for s in segs)
                r["drain_max_s"] = max(s.get("drain_s") or 0 for s in segs)
                r["segments"] = len(segs)
            sysobj = ctx.systems.get(name)
            if sysobj is not None:
                r["api"] = sysobj.api
                r["notes"] = sysobj.notes
                r["setup_s"] = getattr(sysobj, "setup_s", None)
            rows_out[name] = r
        summary[phase] = rows_out
    # the goals, computed from the numbers above (main phase)
    goals = {}
    mainrows = summary.get("main") or {}
    sa, sb = mainrows.get("shm-async") or {}, mainrows.get("shm-block") or {}
    k = results["meta"].get("k")
    if sa.get("mean_iter_s") is not None:
        ov = sa.get("overhead_steady_pct", sa.get("overhead_pct"))
        others = [r.get("overhead_steady_pct", r.get("overhead_pct")) for n, r in mainrows.items() if n not in ("none", "shm-async") and r.get("mean_iter_s") is not None]
        goals["shm_async_overhead_pct"] = ov
        goals["shm_async_overhead_le_1pct"] = ov is not None and ov <= 1.0
        goals["shm_async_lowest_overhead"] = ov is not None and all(o is None or ov <= o for o in others)
        goals["shm_async_gpu_peak_reserved_vs_base_bytes"] = sa.get("gpu_peak_reserved_vs_base_bytes")
    d2h = (results.get("d2h") or {}).get("seconds")
    # The overhead is measured over whole segments (lead iterations and the tail after the
    # last checkpoint included), so the prediction uses the same iterations per checkpoint.
    bsegs = [s for s in results.get("segments") or [] if s.get("system") == "shm-block" and s.get("phase") == "main" and s.get("ok") and s.get("checkpoints")]
    per_ck = (sum(s["n_iters"] for s in bsegs) / sum(s["checkpoints"] for s in bsegs)) if bsegs else k
    if sb.get("mean_iter_s") is not None and d2h and per_ck and base_mean:
        pred = 100.0 * d2h / (per_ck * base_mean)
        goals["shm_block_iters_per_checkpoint"] = per_ck
        meas = sb.get("overhead_steady_pct", sb.get("overhead_pct"))
        goals["shm_block_predicted_overhead_pct"] = pred
        goals["shm_block_measured_overhead_pct"] = meas
        goals["shm_block_within_10pct_of_prediction"] = meas is not None and abs(meas - pred) <= 0.1 * pred
    # issue 13: DCP through shmckpt within 1.10 x shmckpt's native (blocking) Python path
    ds = mainrows.get("dcp-shm") or {}
    if ds.get("mean_iter_s") is not None and sb.get("mean_iter_s") is not None:
        ratios = {}
        for key in ("mean_iter_s", "stall_median_s", "durable_median_s", "host_rss_tree_peak_delta_bytes", "dev_shm_peak_delta_bytes"):
            a, b = ds.get(key), sb.get(key)
            if key.endswith("_bytes") and a is not None and b is not None:
                # Memory peaks below 64 MiB are the sampler's noise (the interpreter's own
                # allocations, log buffers): compared with that floor, not as a ratio of
                # two near-zero numbers.
                a, b = max(a, MEM_FLOOR), max(b, MEM_FLOOR)
            if a is not None and b:
                ratios[key] = a / b
        goals["dcp_shm_over_shm_block"] = ratios
        goals["dcp_shm_within_1_10x_of_native"] = all(v <= 1.10 for v in ratios.values()) if ratios else None
    col = {c["system"]: c for c in results.get("colocated") or [] if c.get("ok")}
    if "shm-async" in col:
        goals["shm_async_colocated_not_returned_bytes"] = col["shm-async"].get("not_returned_bytes")
    summary["goals"] = goals
    summary["baseline_phase"] = base_phase
    summary["baseline_median_iter_s"] = base_med
    summary["baseline_mean_iter_s"] = base_mean
    results["summary"] = summary


def fmt_b(x):
    return "-" if x is None else f"{x / GiB:+.2f}"


def fmt_gb(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def fmt_s(x, p=2):
    return "-" if x is None else f"{x:.{p}f}"


def render_md(results):
    m = results["meta"]
    out = [f"# Training-loop checkpoint benchmark, state {m.get('state')} ({m.get('state_bytes', 0) / GiB:.2f} GiB, {m.get('tensors')} tensors, {m.get('params', 0) / 1e9:.3f} B params)", ""]
    out.append(f"device {m.get('gpu') or m.get('device')}; torch {m.get('versions', {}).get('torch')}; NVRx {m.get('versions', {}).get('nvidia-resiliency-ext')}; shmckpt {m.get('versions', {}).get('shmckpt')}")
    raw = results.get("raw_disk") or {}
    if raw.get("best_gbps"):
        out.append(f"raw disk limit (best of single-stream and {m.get('raw_inflight')}-in-flight O_DIRECT): {raw['best_gbps']:.2f} GB/s ({raw.get('best')}); state / raw = {raw.get('state_write_s', 0):.2f} s")
    s = results.get("summary", {})
    if m.get("shmckpt_open_s") is not None:
        out.append(f"shmckpt start-up, outside the timed loop: Checkpointer({m.get('shmckpt_kwargs')}) {m['shmckpt_open_s']:.2f} s, prepare_cuda {fmt_s(m.get('shmckpt_prepare_cuda_s'))} s")
    out.append(f"baseline iteration: median {fmt_s((s.get('baseline_median_iter_s') or 0) * 1e3, 1)} ms, mean {fmt_s((s.get('baseline_mean_iter_s') or 0) * 1e3, 1)} ms")
    for phase, title in (("main", f"K = {m.get('k')} (disk keeps up)"), ("fast", f"K = {m.get('k_fast')} (disk cannot keep up)")):
        rows = s.get(phase) or {}
        if not rows:
            continue
        out += ["", f"## {title}", ""]
        out.append("| system | mean ms | p99 ms | overhead % (all rounds) | overhead % (rounds 2+) | stall median s | stall max s | first stall s | durable median s | durable max s | max pending | drain s | GPU peak reserved vs base GiB | GPU peak alloc vs base GiB | GPU held after durable GiB (first / later) | host RSS tree peak Δ GiB | /dev/shm peak Δ GiB | host used peak Δ GiB |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            if r.get("mean_iter_s") is None:
                out.append(f"| {name} | FAILED: {r.get('error', '')[:200]} |" + " |" * 16)
                continue
            held = f"{fmt_b(r.get('gpu_device_used_held_after_durable_first_bytes'))} / {fmt_b(r.get('gpu_device_used_held_after_durable_max_later_bytes'))}"
            out.append(
                f"| {name} | {r['mean_iter_s'] * 1e3:.1f} | {r['p99_iter_s'] * 1e3:.1f} | {fmt_s(r.get('overhead_pct'), 1)} | {fmt_s(r.get('overhead_steady_pct'), 1)} | {fmt_s(r.get('stall_median_s'))} | {fmt_s(r.get('stall_max_s'))} | "
                f"{fmt_s(r.get('first_checkpoint_stall_s'))} | {fmt_s(r.get('durable_median_s'))} | {fmt_s(r.get('durable_max_s'))} | {r.get('max_pending_at_call', '-')} | {fmt_s(r.get('drain_max_s'))} | "
                f"{fmt_b(r.get('gpu_peak_reserved_vs_base_bytes'))} | {fmt_b(r.get('gpu_peak_allocated_vs_base_bytes'))} | {held} | {fmt_gb(r.get('host_rss_tree_peak_delta_bytes'))} | "
                f"{fmt_gb(r.get('dev_shm_peak_delta_bytes'))} | {fmt_gb(r.get('host_used_peak_delta_bytes'))} |"
            )
    col = results.get("colocated") or []
    mt = results.get("colocated_main_trainer")
    if mt and mt.get("before_free"):
        out += ["", f"Main trainer (saved by every system) freed before the colocated trials: {fmt_gb(mt.get('freed_by_trainer_bytes'))} GiB freed, "
                f"{fmt_gb(mt.get('device_returned_without_empty_cache_bytes'))} GiB back without empty_cache, {fmt_gb(mt.get('device_returned_after_empty_cache_bytes'))} GiB after "
                f"({fmt_s(mt.get('empty_cache_s'), 3)} s), not returned {fmt_gb(mt.get('not_returned_bytes'))} GiB"]
    if col:
        out += ["", "## Colocated: free weights + grads + optimizer state after a durable save", ""]
        out.append("| system | freed by trainer GiB | device memory back without empty_cache GiB | back after empty_cache GiB | empty_cache s | device used beyond torch reserved GiB | not returned GiB |")
        out.append("|---|---|---|---|---|---|---|")
        for c in col:
            if not c.get("ok"):
                out.append(f"| {c['system']} | FAILED: {(c.get('error') or '')[:200]} | | | | | |")
                continue
            out.append(
                f"| {c['system']} | {fmt_gb(c.get('freed_by_trainer_bytes'))} | {fmt_gb(c.get('device_returned_without_empty_cache_bytes'))} | {fmt_gb(c.get('device_returned_after_empty_cache_bytes'))} | "
                f"{fmt_s(c.get('empty_cache_s'), 3)} | {fmt_gb(c.get('device_used_not_torch_reserved_bytes'))} | {fmt_gb(c.get('not_returned_bytes'))} |"
            )
    cl = results.get("close") or {}
    if cl:
        out += ["", "Device memory given back when each system was closed at the end (mem_get_info): " + ", ".join(f"{k} {fmt_gb(v.get('device_freed_bytes'))} GiB ({fmt_s(v.get('close_s'))} s)" for k, v in cl.items())]
    skipped = results.get("skipped") or []
    if skipped:
        out += ["", "Skipped: " + "; ".join(skipped)]
    if results.get("failed"):
        out += ["", "Failures:"] + [f"- {k}: `{v['error'][:300]}`" for k, v in results["failed"].items()]
    out += ["", "Goals (issue 14): shm-async overhead <= 1 % at the smallest K the disk sustains, lowest of all; 0 bytes extra GPU memory reserved; all memory back in the colocated case. shm-block overhead = (pinned copy of the state) / (K x iteration time) within 10 %."]
    g = s.get("goals") or {}
    if g:
        out.append("Computed from this run (overheads: rounds 2+ when there are any): " + "; ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in g.items()))
    d = results.get("d2h") or {}
    if d.get("seconds"):
        out.append(f"Pinned D2H copy of the state (reference): {d['seconds']:.3f} s, {d['gbps']:.1f} GB/s")
    return "\n".join(out) + "\n"


def write_outputs(ctx, results, final=False):
    try:
        if ctx.iters and ctx.segments:
            summarize(ctx, results)
        results["segments"] = ctx.segments
        results["checkpoints"] = ctx.ckpts
        results["failed"] = ctx.failed
        p = os.path.join(ctx.out_dir, "results.json")
        with open(p + ".tmp", "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(p + ".tmp", p)
        with open(os.path.join(ctx.out_dir, "iters.csv"), "w", newline="") as f:
            if ctx.iters:
                w = csv.DictWriter(f, fieldnames=list(ctx.iters[0].keys()))
                w.writeheader()
                w.writerows(ctx.iters)
        with open(os.path.join(ctx.out_dir, "results.md"), "w") as f:
            f.write(render_md(results))
    except Exception as e:
        log(f"writing results failed: {e!r}\n{traceback.format_exc()}")
    if final:
        plot(ctx.out_dir)


COLORS = {"none": "#444444", "torch": "#d62728", "dcp": "#ff7f0e", "dcp-shm": "#e6ab02", "nvrx": "#9467bd", "nvrx-fswa": "#8c564b", "shm-block": "#1f77b4", "shm-async": "#2ca02c"}


def plot(out_dir):
    """iteration time against global step, one colour per system, checkpoints
    marked; also runnable alone: python3 train.py --plot-only DIR."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        log(f"no matplotlib here ({e!r}); iters.csv + `train.py --plot-only DIR` plot elsewhere")
        return None
    rows = []
    with open(os.path.join(out_dir, "iters.csv")) as f:
        for r in csv.DictReader(f):
            rows.append(r)
    if not rows:
        return None
    with open(os.path.join(out_dir, "results.json")) as f:
        res = json.load(f)
    phases = [p for p in ("main", "fast") if any(r["phase"] == p for r in rows)]
    fig, axes = plt.subplots(len(phases), 1, figsize=(16, 5 * len(phases)), squeeze=False)
    for ax, phase in zip(axes[:, 0], phases):
        seen = set()
        pr = [r for r in rows if r["phase"] == phase]
        segs = collections.OrderedDict()
        for r in pr:
            segs.setdefault((r["system"], r["round"], r["phase"]), []).append(r)
        for (name, _rnd, _ph), rs in segs.items():
            g = [int(r["g"]) for r in rs]
            y = [float(r["dt"]) * 1e3 for r in rs]
            ax.plot(g, y, lw=0.8, color=COLORS.get(name, "k"), label=None if name in seen else name)
            seen.add(name)
            cg = [int(r["g"]) for r in rs if r["ckpt"] == "1"]
            cy = [float(r["dt"]) * 1e3 for r in rs if r["ckpt"] == "1"]
            ax.scatter(cg, cy, marker="v", s=30, color=COLORS.get(name, "k"), zorder=3)
            ax.text(g[0], ax.get_ylim()[1] if False else max(y) * 1.05, name, fontsize=7, color=COLORS.get(name, "k"))
        durable_marked = False
        for c in res.get("checkpoints", []):
            if c.get("phase") == phase and c.get("durable_at_global_iter") is not None:
                # a dot on the x axis where the poll first saw the save durable
                ax.plot([c["global_iter"], c["durable_at_global_iter"]], [0.02, 0.02], transform=ax.get_xaxis_transform(), color=COLORS.get(c["system"], "k"), lw=1.5,
                        label=None if durable_marked else "checkpoint call -> durable")
                ax.plot([c["durable_at_global_iter"]], [0.02], "o", ms=3, transform=ax.get_xaxis_transform(), color=COLORS.get(c["system"], "k"))
                durable_marked = True
        ax.set_yscale("log")
        ax.set_xlabel("global iteration (systems run in turn; triangles = checkpoint iterations)")
        ax.set_ylabel("iteration time, ms (log)")
        m = res.get("meta", {})
        ax.set_title(f"{phase}: state {m.get('state')} {m.get('state_bytes', 0) / GiB:.2f} GiB, K = {m.get('k') if phase == 'main' else m.get('k_fast')}")
        ax.legend(loc="upper right", fontsize=8, ncol=4)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out_dir, "iters.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    log(f"plot: {p}")
    return p


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--state", default="8g", choices=list(SIZES), help="model size: 8g (0.732 B params, 8.18 GiB of state, 1,168 tensors), 16g (1.429 B, 15.97 GiB, 1,312), tiny (CPU smoke)")
    a("--systems", default=",".join(SYSTEMS), help="comma list of " + ",".join(SYSTEMS) + " (none is always run: it is the baseline)")
    a("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke test only (use with --state tiny)")
    a("--dir", default="/var/tmp/trainbench", help="checkpoint directory, on the real disk (cleared at start and end)")
    a("--out", default=None, help="results directory (default $OUT, else ./trainbench-out)")
    a("--budget-s", type=float, default=480, help="wall-clock budget: phases/segments whose estimate would end after this are skipped (recorded)")
    a("--rounds", type=int, default=2, help="main-phase rounds (each round runs every system once, order reversed every other round; 0 = no main phase)")
    a("--ckpts", type=int, default=2, help="checkpoints per main segment")
    a("--k", type=int, default=0, help="main K (0 = auto: ceil(k-factor x state_bytes / raw disk limit / baseline iteration))")
    a("--k-factor", type=float, default=1.5, help="auto K margin over the raw-disk write time of the state")
    a("--k-fast", type=int, default=0, help="fast-phase K, where the disk cannot keep up (0 = auto: a quarter of the state's raw write time)")
    a("--fast-ckpts", type=int, default=4, help="checkpoints per fast-phase segment (0 = no fast phase)")
    a("--fast-systems", default=None, help="systems in the fast phase (default: --systems)")
    a("--colocated", default=",".join(COLOCATED_ORDER), help="systems for the colocated case, in priority order ('' = skip); CUDA only")
    a("--lead", type=int, default=3, help="iterations at the start of each segment before its first checkpoint")
    a("--warmup", type=int, default=8, help="untimed warm-up iterations, then 20 timed ones to measure the iteration time")
    a("--batch", type=int, default=None, help="override the size's batch")
    a("--seq", type=int, default=None, help="override the size's sequence length")
    a("--layers", type=int, default=None, help="override the size's layer count")
    a("--fused", default="auto", choices=["auto", "fused", "foreach", "single"], help="AdamW implementation (auto: fused on CUDA, foreach on CPU)")
    a("--keep-last", type=int, default=2, help="checkpoints kept per system (older ones deleted in a background thread; shmckpt: keep_last)")
    a("--dcp-state", default="nested", choices=["nested", "flat"], help="dcp and dcp-shm: the state as {'model': {...}, 'optim': {...}} (as torchtitan passes it; DCP flattens it to the same names) or the other systems' flat dict of 1,312 keys (DCP's async_save then spends ~0.1 s a call on its per-key logging)")
    a("--dcp-plan-caching", default="on", choices=["on", "off"], help="dcp and dcp-shm: DefaultSavePlanner(enable_plan_caching=True), DCP's own option (torch >= 2.7): from the second save on no plans are exchanged")
    a("--threads", type=int, default=4, help="writer threads for DCP FileSystemWriter and NVRx FileSystemWriterAsync")
    a("--raw-bytes", type=float, default=0, help="bytes for each raw-disk write (0 = the state size)")
    a("--raw-inflight", type=int, default=16, help="in-flight writes for the second raw-disk measurement")
    a("--raw-chunk-mib", type=int, default=8, help="write size of the in-flight raw measurement (single stream uses 64 MiB)")
    a("--timeout", type=float, default=240, help="seconds to wait for any one save to become durable")
    a("--shmckpt-path", default=None, help="directory prepended to sys.path before `import shmckpt`")
    a("--shm-staging-bytes", type=int, default=0, help="shmckpt staging_capacity (0 = state bytes + 256 MiB)")
    a("--no-d2h-ref", action="store_true", help="skip the pinned D2H copy of the state (the reference of the shm-block goal)")
    a("--no-prepare-cuda", action="store_true", help="do not call Checkpointer.prepare_cuda() at start-up (then the first device save registers the staging memory)")
    a("--seed", type=int, default=1234)
    a("--mem-interval", type=float, default=0.1, help="host memory sampling interval, s")
    a("--host-mem-gib", type=float, default=120, help="host memory limit for the OOM guard: a checkpoint call is skipped (recorded) when host used + 2 x state + 8 GiB would exceed it (nvidia-h200: 128 GiB)")
    a("--plot-only", default=None, metavar="DIR", help="only (re)draw DIR/iters.png from DIR/iters.csv + results.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        plot(args.plot_only)
        return 0
    out_dir = args.out or os.environ.get("OUT") or "./trainbench-out"
    os.makedirs(out_dir, exist_ok=True)
    set_log_file(open(os.path.join(out_dir, "train.log"), "a"))
    cuda = args.device == "cuda"
    if not cuda:
        os.environ["TRAINBENCH_CPU_SMOKE"] = "1"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.shmckpt_path:
        sys.path.insert(0, os.path.abspath(args.shmckpt_path))
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    log(f"trainbench start argv={sys.argv[1:]} out={out_dir}")
    import torch
    import torch.distributed as dist

    if not cuda:
        torch.cuda.synchronize = lambda *a, **k: None  # smoke test only, see top of file
    elif not torch.cuda.is_available():
        log("CUDA is not available; use --device cpu --state tiny for a smoke test")
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            log(f"unknown system {s!r}")
            return 2
    if "none" not in systems:
        systems.insert(0, "none")
    fast_order = ["shm-async", "shm-block", "dcp-shm", "nvrx-fswa", "nvrx", "dcp", "torch"]
    fast_systems = [s.strip() for s in (args.fast_systems or ",".join(sorted(systems, key=lambda x: fast_order.index(x) if x in fast_order else -1))).split(",") if s.strip() and s.strip() != "none"]
    colocated = [s.strip() for s in args.colocated.split(",") if s.strip()]
    ctx = Ctx(args, out_dir)
    ctx.base_ckpts = args.ckpts
    shutil.rmtree(ctx.ckpt_dir, ignore_errors=True)
    os.makedirs(ctx.ckpt_dir, exist_ok=True)
    results = {"meta": {}, "skipped": []}
    m = results["meta"]
    m.update(started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), argv=sys.argv[1:], device=args.device, state=args.state, systems=systems)
    m["nofile"] = raise_nofile()
    shm_ver = None
    try:
        import shmckpt

        shm_ver = getattr(shmckpt, "__version__", "unknown") + f" ({getattr(shmckpt, '__file__', '?')})"
    except Exception as e:
        shm_ver = f"import failed: {type(e).__name__}: {e}"
        ctx.shm_error = shm_ver
        for s in ("shm-block", "shm-async", "dcp-shm"):
            if s in systems:
                ctx.failed[s] = {"error": f"import shmckpt: {type(e).__name__}: {e}"}
    m["versions"] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "nvidia-resiliency-ext": pkg_version("nvidia-resiliency-ext"), "shmckpt": shm_ver, "numpy": pkg_version("numpy")}
    m["host"] = platform.node()
    m["kernel"] = platform.release()
    m["cpus"] = os.cpu_count()
    m["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    m["ckpt_dir"] = ctx.ckpt_dir
    m["ckpt_fs"] = fs_type_of(ctx.ckpt_dir)
    m["ckpt_free_bytes"] = shutil.disk_usage(ctx.ckpt_dir).free
    m["dev_shm_total_bytes"] = (lambda st: st.f_blocks * st.f_frsize)(os.statvfs("/dev/shm")) if os.path.exists("/dev/shm") else None
    log(f"versions {m['versions']}; ckpt dir {m['ckpt_fs']} free {m['ckpt_free_bytes'] / GiB:.1f} GiB; /dev/shm {(m['dev_shm_total_bytes'] or 0) / GiB:.1f} GiB")
    if (m["ckpt_fs"].get("fstype") or "") in ("tmpfs", "ramfs", "overlay"):
        log(f"WARNING: {ctx.ckpt_dir} is on {m['ckpt_fs']['fstype']}, not a real disk")
    need_pg = any(s in ("dcp", "dcp-shm", "nvrx", "nvrx-fswa") for s in systems)
    if need_pg and not dist.is_initialized():
        port = free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        m["process_group"] = f"gloo world_size=1 port {port}"
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    sampler = MemSampler(args.mem_interval).start()
    gpu0 = gpu_snapshot(cuda)
    m["gpu_at_start"] = gpu0

    cfg = dict(SIZES[args.state])
    for k in ("batch", "seq", "layers"):
        if getattr(args, k):
            cfg[k] = getattr(args, k)
    m["model"] = cfg
    t = now()
    tr = Trainer(cfg, args.device, args.fused, args.seed)
    m["params"] = tr.params()
    m["optimizer"] = tr.opt_mode
    for _ in range(max(1, args.warmup)):
        tr.fwd_bwd()
        tr.step()
    tr.sync()
    state = tr.build_state()
    m["state_bytes"] = ctx.state_bytes = state_nbytes(state)
    m["tensors"] = len(state)
    m["build_and_warmup_s"] = now() - t
    log(f"model {cfg}: {m['params'] / 1e9:.3f} B params, optimizer {tr.opt_mode}, state {m['state_bytes'] / GiB:.2f} GiB in {m['tensors']} tensors; build+warm-up {m['build_and_warmup_s']:.1f}s")
    # on disk at once: shmckpt's keep_last + the running system's keep_last + one in flight
    if ctx.keep_last > 1 and m["ckpt_free_bytes"] < (2 * ctx.keep_last + 2) * m["state_bytes"]:
        ctx.keep_last = 1
        log(f"WARNING: only {m['ckpt_free_bytes'] / GiB:.1f} GiB free in {ctx.ckpt_dir}: keep_last lowered to 1")
    m["keep_last"] = ctx.keep_last
    if m["ckpt_free_bytes"] < 4 * m["state_bytes"]:
        log(f"WARNING: {m['ckpt_free_bytes'] / GiB:.1f} GiB free in {ctx.ckpt_dir} for a {m['state_bytes'] / GiB:.1f} GiB state; saves may fail with ENOSPC")
    # shmckpt first (guard must be on the optimizer before the first timed iteration)
    if any(s.startswith("shm-") for s in systems) and ctx.shm_error is None:
        try:
            ctx.get_shm().guard(tr.opt)
            m["shmckpt_open_s"] = ctx.shm.open_s
            m["shmckpt_kwargs"] = ctx.shm.kwargs
            if cuda and hasattr(ctx.shm.ck, "prepare_cuda") and not args.no_prepare_cuda:
                # the documented start-up call: registers the staging memory with CUDA
                # now instead of in the first device save (time reported, not hidden)
                t = now()
                r = ctx.shm.ck.prepare_cuda()
                m["shmckpt_prepare_cuda_s"] = now() - t
                m["shmckpt_prepare_cuda_reported_s"] = r
                log(f"shmckpt: Checkpointer opened in {ctx.shm.open_s:.2f}s, prepare_cuda {m['shmckpt_prepare_cuda_s']:.2f}s")
        except Exception as e:
            for s in ("shm-block", "shm-async"):
                if s in systems:
                    ctx.failed[s] = {"error": f"Checkpointer/guard: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"shmckpt unavailable: {e!r}")
    timed = []
    for _ in range(20):
        t0 = now()
        tr.fwd_bwd()
        tr.step()
        tr.sync()
        timed.append(now() - t0)
    it_s = med(timed)
    m["warmup_iter_median_s"] = it_s
    log(f"iteration (warm-up median of 20): {it_s * 1e3:.1f} ms")
    write_outputs(ctx, results)

    # raw disk limit (same run, same directory)
    raw_bytes = int(args.raw_bytes) if args.raw_bytes else m["state_bytes"]
    rd = {"bytes": raw_bytes}
    results["raw_disk"] = rd
    rp = os.path.join(ctx.ckpt_dir, "raw-write.bin")
    for key, inflight, chunk in (("single", 1, 64 * MiB), (f"qd{args.raw_inflight}", args.raw_inflight, args.raw_chunk_mib * MiB)):
        try:
            rd[key] = raw_write(rp, raw_bytes, inflight, chunk)
            log(f"raw disk {key}: {rd[key]['gbps']:.2f} GB/s ({rd[key]['seconds']:.2f}s, o_direct={rd[key]['o_direct']})")
        except Exception as e:
            rd[key + "_error"] = repr(e)
            log(f"raw disk {key} FAILED: {e!r}")
    cands = [(v["gbps"], k) for k, v in rd.items() if isinstance(v, dict) and v.get("gbps")]
    if cands:
        rd["best_gbps"], rd["best"] = max(cands)
        rd["state_write_s"] = m["state_bytes"] / (rd["best_gbps"] * 1e9)
    m["raw_inflight"] = args.raw_inflight
    if cuda and not args.no_d2h_ref:
        try:
            results["d2h"] = d2h_ref(state)
            log(f"pinned D2H of the state: {results['d2h']['seconds']:.3f}s ({results['d2h']['gbps']:.1f} GB/s; pinned alloc {results['d2h']['pinned_alloc_s']:.2f}s)")
        except Exception as e:
            results["d2h"] = {"error": repr(e)}
            log(f"pinned D2H reference FAILED: {e!r}")
    wr_s = rd.get("state_write_s") or 5.0
    k = args.k or max(2, math.ceil(args.k_factor * wr_s / it_s))
    k_fast = args.k_fast or max(2, math.ceil(0.25 * wr_s / it_s))
    m["k"], m["k_fast"] = k, k_fast
    m["checkpoint_interval_s_at_baseline"] = k * it_s
    log(f"K = {k} ({k * it_s:.2f}s between checkpoints at the baseline; raw write of the state {wr_s:.2f}s); fast K = {k_fast} ({k_fast * it_s:.2f}s)")
    write_outputs(ctx, results)

    # time estimates (refined from measured segments)
    seg_wall = {}

    def est_segment(name, kk, nck):
        n = args.lead + max(nck, 1) * kk
        if name in seg_wall:
            w, n0, nc0 = seg_wall[name]
            per_ck = max(0.0, (w - n0 * it_s) / max(nc0, 1))
        else:
            per_ck = {"none": 0.0, "torch": 2.5 * wr_s, "dcp": 1.2 * wr_s + 4}.get(name, 0.8 * wr_s + 3)
        return n * it_s + (nck if name != "none" else 0) * per_ck

    def remember(seg):
        if seg and seg["ok"]:
            seg_wall[seg["system"]] = (seg["wall_s"], seg["n_iters"], max(seg["checkpoints"], 1))

    colocated_reserve = 0.0
    if cuda and colocated:
        colocated_reserve = min(3, len(colocated)) * (m["build_and_warmup_s"] + 1.5 * wr_s + 4)
    close_reserve = 25.0

    # main rounds
    for rnd in range(args.rounds):
        order = [s for s in systems if s != "none"]
        if rnd % 2:
            order.reverse()
        order = ["none"] + order
        est = sum(est_segment(s, k, args.ckpts) for s in order if s not in ctx.failed)
        reserve = close_reserve + (colocated_reserve if rnd > 0 else 0)
        if rnd > 0 and elapsed() + est + reserve > args.budget_s:
            msg = f"main round {rnd + 1}: estimated {est:.0f}s, elapsed {elapsed():.0f}s, budget {args.budget_s:.0f}s"
            results["skipped"].append(msg)
            log("SKIP " + msg)
            break
        log(f"== main round {rnd + 1}/{args.rounds} (estimated {est:.0f}s): {' '.join(order)}")
        for name in order:
            if name in ctx.failed:
                continue
            e = est_segment(name, k, args.ckpts)
            if elapsed() + e + close_reserve > args.budget_s:
                msg = f"main round {rnd + 1} {name}: estimated {e:.0f}s, elapsed {elapsed():.0f}s"
                results["skipped"].append(msg)
                log("SKIP " + msg)
                continue
            remember(run_segment(ctx, tr, sampler, name, "main", rnd + 1, k, args.ckpts if name != "none" else 0, args.lead))
            write_outputs(ctx, results)

    # fast phase: the disk cannot keep up
    if args.fast_ckpts > 0:
        log(f"== fast phase, K = {k_fast}")
        base_done = False
        for name in ["none"] + fast_systems:
            if name in ctx.failed:
                continue
            nck = args.fast_ckpts
            if name == "none":
                if base_done:
                    continue
                base_done = True
            e = est_segment(name, k_fast, nck) + (nck * wr_s if name != "none" else 0)
            if elapsed() + e + colocated_reserve + close_reserve > args.budget_s:
                msg = f"fast {name}: estimated {e:.0f}s, elapsed {elapsed():.0f}s"
                results["skipped"].append(msg)
                log("SKIP " + msg)
                continue
            old = ctx.base_ckpts
            ctx.base_ckpts = nck
            run_segment(ctx, tr, sampler, name, "fast", 1, k_fast, nck if name != "none" else 0, args.lead)
            ctx.base_ckpts = old
            write_outputs(ctx, results)

    # colocated case
    results["colocated"] = []
    if colocated and not cuda:
        results["skipped"].append("colocated: needs CUDA (mem_get_info)")
    elif colocated:
        log("== colocated case")
        for s_ in ctx.systems.values():
            s_.release_refs()
        tr.state = None
        holder = {"tr": tr}
        del tr, state
        try:
            results["colocated_main_trainer"] = measure_free(holder)
            log(f"  main trainer freed (every system saved it): {results['colocated_main_trainer']['device_returned_after_empty_cache_bytes'] / GiB:.2f} GiB back after empty_cache")
        except Exception as e:
            results["colocated_main_trainer"] = {"error": repr(e)}
        holder.clear()
        gc.collect()
        per = m["build_and_warmup_s"] + 1.5 * wr_s + 4
        for name in colocated:
            if name != "none" and (name not in systems or name in ctx.failed):
                continue
            if elapsed() + per + close_reserve > args.budget_s:
                msg = f"colocated {name}: elapsed {elapsed():.0f}s"
                results["skipped"].append(msg)
                log("SKIP " + msg)
                continue
            c = colocated_trial(ctx, cfg, name, sampler)
            results["colocated"].append(c)
            if c.get("ok"):
                log(
                    f"  colocated {name}: freed {c['freed_by_trainer_bytes'] / GiB:.2f} GiB; back without empty_cache {c['device_returned_without_empty_cache_bytes'] / GiB:.2f}, "
                    f"after empty_cache {c['device_returned_after_empty_cache_bytes'] / GiB:.2f} GiB ({c['empty_cache_s']:.3f}s); not returned {c['not_returned_bytes'] / GiB:.2f} GiB"
                )
            else:
                log(f"  colocated {name}: FAILED {c.get('error')}")
            write_outputs(ctx, results)

    # close every system, recording the device memory each gives back
    results["close"] = {}
    for name, s in list(ctx.systems.items()):
        if name in ctx.failed and name not in ctx.systems:
            continue
        b = gpu_snapshot(cuda)
        t = now()
        try:
            s.release_refs()
            s.close()
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        gc.collect()
        a = gpu_snapshot(cuda)
        results["close"][name] = {"close_s": now() - t, "error": err, "device_freed_bytes": (a["device_free"] - b["device_free"]) if cuda else None}
    if ctx.shm is not None:
        b = gpu_snapshot(cuda)
        t = now()
        try:
            ctx.shm.close()
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        a = gpu_snapshot(cuda)
        results["close"]["shmckpt-Checkpointer"] = {"close_s": now() - t, "error": err, "device_freed_bytes": (a["device_free"] - b["device_free"]) if cuda else None}
    sampler.stop()
    ctx.deleter.wait()
    shutil.rmtree(ctx.ckpt_dir, ignore_errors=True)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    m["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    m["total_s"] = elapsed()
    write_outputs(ctx, results, final=True)
    print(open(os.path.join(out_dir, "results.md")).read(), flush=True)
    log(f"done in {elapsed():.0f}s: {out_dir}/ results.json, results.md, iters.csv, train.log" + (", iters.png" if os.path.exists(os.path.join(out_dir, "iters.png")) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
