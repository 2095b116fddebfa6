#!/usr/bin/env python3
"""The trainer process of the goodput benchmark (``goodput.py`` launches, kills and restarts
it; run it by hand only to debug).

A deterministic training loop over a synthetic state: ``--tensors`` fp32 tensors of
``--size-bytes`` in all (on the GPU when ``--device cuda``). Tensor ``i`` starts (step 0) as
``(j * 40503 + i * 7919) & 0xFFFFF`` at element ``j``, and step ``k`` adds the integer
``c(k, i) = (31 k + 17 i) % 8 + 1`` to all its elements: every value is an integer below
2**24, so fp32 holds it exactly and the state at step ``k`` is known in closed form
(``expected``). A resume is compared with it bit for bit (int32 views); any difference ends
the process with status 3.

A step is the "forward/backward" (real GPU work: ``torch.cuda._sleep`` for a calibrated
number of cycles; ``time.sleep`` on the CPU) and then the "optimizer step" (the adds, through
a ``torch.optim.Optimizer`` so that shmckpt's ``guard`` applies), then a synchronize of the
stream (as ``loss.item()`` does). Every ``--every`` steps the system under test saves the
state after the step. On start the process resumes from the system's latest checkpoint.

Every event goes to ``--events`` as one JSON line (``os.write`` on an ``O_APPEND`` file: a
SIGKILL never leaves half a line), with ``time.monotonic()`` times (one clock for every
process of the host). SIGTERM stops the loop after the current step and closes the system.

``--spare`` (``goodput.py --restart warm``): a spare started ahead of a failure. It runs the
start that touches neither the checkpoint root nor a dead trainer's resources (the
interpreter, the imports of torch and of the system's modules, the CUDA context, one
construction and step of the optimizer class on a one-element dummy tensor, which imports
what the first ``torch.optim`` construction imports), writes one JSON line to
``--ready-fd`` (spare-ready: its times and host memory) and blocks reading ``go <life>``
from stdin. Its events are held until then and written with that life; it then records
``go`` and goes on as a cold start does from the system's open on. EOF on stdin ends it.
"""

import argparse
import json
import os
import time

T_MAIN = time.monotonic()  # before any import that costs: the interpreter's start ends here

import importlib.util  # noqa: E402
import inspect  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

_FD = None
_LIFE = -1
_STOP = False
_HELD = None  # a spare's events, held until ``go`` gives them a life


def emit(**kw):
    if _HELD is not None:
        _HELD.append(kw)
        return
    kw["life"] = _LIFE
    os.write(_FD, (json.dumps(kw, separators=(",", ":")) + "\n").encode())


def release(life):
    """A spare becomes life ``life``: its held events are written with that life."""
    global _HELD, _LIFE
    held, _HELD, _LIFE = _HELD, None, life
    for kw in held or ():
        emit(**kw)


def mono():
    return time.monotonic()


def c_of(k, i):
    """What step ``k`` adds to tensor ``i``."""
    return (31 * k + 17 * i) % 8 + 1


def c_sum(k, i):
    """Sum of ``c_of(j, i)`` for j = 1..k (the sequence has period 8 and sums to 36)."""
    full, rest = divmod(k, 8)
    return 36 * full + sum(c_of(j, i) for j in range(8 * full + 1, k + 1))


def shapes(size_bytes, n):
    """Names and element counts of the state: ``n`` tensors as equal as 4-byte elements allow."""
    elems = max(n, size_bytes // 4)
    per, extra = divmod(elems, n)
    return [(f"t{i:02d}", per + (1 if i < extra else 0)) for i in range(n)]


def initial(torch, n, i, device):
    j = torch.arange(n, dtype=torch.int32, device=device)
    return ((j * 40503 + i * 7919) & 0xFFFFF).to(torch.float32)


def expected(torch, n, i, k, device):
    t = initial(torch, n, i, device)
    t.add_(float(c_sum(k, i)))
    return t


def check(torch, tensors, specs, k, device):
    """Names, shapes, dtypes and every byte of ``tensors`` against the state at step ``k``."""
    if sorted(tensors) != [name for name, _ in specs]:
        return f"names {sorted(tensors)[:4]}... differ"
    for i, (name, n) in enumerate(specs):
        t = tensors[name]
        if t.dtype != torch.float32 or tuple(t.shape) != (n,):
            return f"{name}: {t.dtype} {tuple(t.shape)}"
        e = expected(torch, n, i, k, t.device)
        if not torch.equal(t.view(torch.int32), e.view(torch.int32)):
            bad = (t.view(torch.int32) != e.view(torch.int32)).nonzero()[:1].tolist()
            return f"{name}: bytes differ from step {k}'s (first element {bad})"
    return None


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def steps_in(root, prefix, suffix=""):
    """Committed steps named ``prefix<N><suffix>`` in ``root``."""
    out = []
    for name in os.listdir(root):
        if name.startswith(prefix) and name.endswith(suffix):
            mid = name[len(prefix) : len(name) - len(suffix)] if suffix else name[len(prefix) :]
            if mid.isdigit():
                out.append(int(mid))
    return sorted(out)


# -- systems --------------------------------------------------------------------------


def one_gloo_rank():
    """A one-rank gloo process group (no-op when one exists)."""
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class System:
    """One checkpoint system. ``save`` is called after the step's update; ``poll`` after
    every step returns ``[(step, t_durable)]`` newly durable; ``before_update`` runs before
    every optimizer step."""

    every_step = False
    saves = True

    def __init__(self, torch, root, device, keep):
        self.torch, self.root, self.device, self.keep = torch, root, device, keep
        self.info = {}

    def attach(self, opt):
        pass

    def before_update(self):
        pass

    def poll(self):
        return []

    def reports(self):
        """What the system reported of the saves ``poll`` found done, since the last call
        (``saved`` events): none but shmckpt's."""
        return []

    def close(self):
        pass


class NoSystem(System):
    saves = False

    def latest(self):
        return None

    def save(self, step, tensors):
        raise AssertionError("the baseline does not save")


class Retainer:
    """Deletes all but the newest ``keep`` committed checkpoints, in a background thread
    (as train.py does for the systems without retention of their own)."""

    def __init__(self, root, prefix, suffix, keep):
        self.root, self.prefix, self.suffix, self.keep = root, prefix, suffix, keep

    def trim(self):
        old = steps_in(self.root, self.prefix, self.suffix)[: -self.keep]
        if old:
            paths = [os.path.join(self.root, f"{self.prefix}{s}{self.suffix}") for s in old]
            threading.Thread(target=_remove, args=(paths,), daemon=True).start()


def _remove(paths):
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            try:
                os.remove(p)
            except OSError:
                pass


class ShmSystem(System):
    """shmckpt: ``save(step, state, blocking=False)`` under ``guard(opt)`` (its best mode at
    these step lengths; docs/benchmarks.md), ``prepare_cuda(background=True)`` at open,
    ``keep_last``.
    ``tiered``: the same with ``disk_every="auto"``, saving every step."""

    def __init__(self, torch, root, device, keep, size_bytes, tiered=False):
        super().__init__(torch, root, device, keep)
        import shmckpt

        kw = dict(keep_last=keep)
        staging = size_bytes + (256 << 20)
        if tiered:
            # Staging for three saves (docs/python.md, "Host memory per rank"): the disk
            # save draining, the memory-only step held and the save being staged. Flash
            # restore on: after a kill, recovery keeps the memory-only step it commits in
            # the arena and the restart loads it from there (benches/goodput/restart.py).
            kw["cadence"] = shmckpt.Cadence(disk_every="auto")
            kw["keep_in_memory"] = True
            staging = 3 * size_bytes + (256 << 20)
            self.every_step = True
        self.ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=staging), **kw)
        self.info["shm_name"] = self.ck.shm_name
        self.info["recovered"] = list(getattr(self.ck, "recovered", []) or [])
        self.info["open_timings"] = getattr(self.ck, "open_timings", None)
        if device == "cuda":
            # In the background, as docs/python.md advises at start-up: the arena's
            # allocation and registration overlap the load and the first steps (a save
            # issued before they end waits for them).
            t = time.monotonic()
            self.ck.prepare_cuda(background=True)
            self.info["prepare_cuda_s"] = time.monotonic() - t
        self.pending = []
        self.done = []

    def latest(self):
        return self.ck.latest()

    def load(self, step, specs):
        st = self.ck.load(step, map_location="cuda:0" if self.device == "cuda" else None)
        self.info["load_source"] = getattr(self.ck, "last_load_source", None)
        if int(st["step"]) != step:
            raise RuntimeError(f"checkpoint {step} holds step {st['step']}")
        return dict(st["w"])

    def attach(self, opt):
        self.ck.guard(opt)

    def save(self, step, tensors):
        self.pending.append((step, self.ck.save(step, {"step": step, "w": tensors}, blocking=False)))

    def poll(self):
        out, keep = [], []
        for step, h in self.pending:
            if h.done():
                rep = h.wait()  # raises if the save failed
                out.append((step, mono()))
                tm = rep.get("timings", rep)
                # How long its staging took and waited for room, and which tier took it:
                # what a slow step after a restart is made of.
                self.done.append({"k": step, "memory_only": bool(rep.get("memory_only")), "staging_s": tm.get("staging"),
                                  "backpressure_s": tm.get("backpressure")})
            else:
                keep.append((step, h))
        self.pending = keep
        return out

    def reports(self):
        out, self.done = self.done, []
        return out

    def close(self):
        self.ck.close()


class TorchSystem(System):
    """``torch.save`` to a temporary file, fsync, atomic rename to ``ckpt-<step>.pt``, fsync
    of the directory, on the trainer's thread; ``torch.load(map_location=device)``."""

    def __init__(self, torch, root, device, keep):
        super().__init__(torch, root, device, keep)
        self.ret = Retainer(root, "ckpt-", ".pt", keep)
        self.done = []

    def latest(self):
        s = steps_in(self.root, "ckpt-", ".pt")
        return s[-1] if s else None

    def load(self, step, specs):
        st = self.torch.load(os.path.join(self.root, f"ckpt-{step}.pt"), map_location=self.device, weights_only=True)
        if int(st["step"]) != step:
            raise RuntimeError(f"checkpoint {step} holds step {st['step']}")
        return dict(st["w"])

    def save(self, step, tensors):
        tmp = os.path.join(self.root, f".tmp-{step}.pt")
        self.torch.save({"step": step, "w": tensors}, tmp)
        fsync_file(tmp)
        os.replace(tmp, os.path.join(self.root, f"ckpt-{step}.pt"))
        fsync_dir(self.root)
        self.done.append((step, mono()))
        self.ret.trim()

    def poll(self):
        out, self.done = self.done, []
        return out


class DCPSystem(System):
    """PyTorch DCP ``async_save`` (thread executor, ``no_dist=True`` where the torch version
    has it, else a one-rank gloo group) with a
    ``FileSystemWriter(sync_files=True)`` into ``tmp-<step>`` and, where the torch version
    has it, a ``DefaultStager(StagingOptions(pinned, shared=False, async, non_blocking))``
    (pinned, async and non-blocking on CUDA; no shared memory: the thread executor needs
    none), a new one per save (benches/train found torch 2.11 raising on a second
    ``stage``), its staging waited for before the
    next optimizer step; before a save, the previous upload is waited for (backpressure, as
    DCP's docs do). Once the upload is done the directory is renamed ``step-<step>`` and the
    root fsynced (committed). Load: ``dcp.load`` in place into tensors allocated on the
    device."""

    def __init__(self, torch, root, device, keep):
        super().__init__(torch, root, device, keep)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        # no_dist where this torch has it, else a one-rank gloo group
        self.nodist = {"no_dist": True} if "no_dist" in inspect.signature(dcp.async_save).parameters else {}
        if not self.nodist:
            one_gloo_rank()
            self.info["process_group"] = "gloo, one rank"
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = device == "cuda"
            self.make_stager = lambda: DefaultStager(StagingOptions(cuda, False, cuda, cuda))
            self.info["stager"] = f"DefaultStager(StagingOptions({cuda}, False, {cuda}, {cuda}))"
        except ImportError as e:
            self.make_stager = None
            self.info["stager"] = f"none ({e})"
        self.ret = Retainer(root, "step-", "", keep)
        self.staging = None
        self.uploads = []  # (step, future, stager)

    def latest(self):
        s = steps_in(self.root, "step-")
        return s[-1] if s else None

    def load(self, step, specs):
        torch = self.torch
        sd = {"w": {name: torch.empty(n, dtype=torch.float32, device=self.device) for name, n in specs}}
        self.dcp.load(sd, checkpoint_id=os.path.join(self.root, f"step-{step}"), **self.nodist)
        return sd["w"]

    def save(self, step, tensors):
        if self.uploads:
            self.uploads[-1][1].result()
        d = os.path.join(self.root, f"tmp-{step}")
        writer = self.dcp.FileSystemWriter(d, sync_files=True, overwrite=True, thread_count=4)
        stager = self.make_stager() if self.make_stager else None
        kw = {"async_stager": stager} if stager is not None else {}
        resp = self.dcp.async_save({"w": tensors}, storage_writer=writer, **self.nodist, **kw)
        if hasattr(resp, "staging_completion"):
            self.staging = resp.staging_completion
            up = resp.upload_completion
        else:
            up = resp
        self.uploads.append((step, up, stager))

    def before_update(self):
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def poll(self, block=False):
        out, keep = [], []
        for step, fut, stager in self.uploads:
            if block or fut.done():
                fut.result()
                os.rename(os.path.join(self.root, f"tmp-{step}"), os.path.join(self.root, f"step-{step}"))
                fsync_dir(self.root)
                out.append((step, mono()))
                if stager is not None:
                    stager.close()
            else:
                keep.append((step, fut, stager))
        self.uploads = keep
        if out:
            self.ret.trim()
        return out

    def close(self):
        self.before_update()
        self.poll(block=True)


class NVRxSystem(System):
    """NVRx ``TorchAsyncCheckpoint(persistent_queue=True).async_save(state, tmp)`` (the copy
    to the host in the trainer, ``torch.save`` in its persistent worker); every step
    ``maybe_finalize_async_calls(blocking=False, no_dist=True)``; a finalized file is fsynced
    and renamed ``ckpt-<step>.pt`` (committed) by a helper thread. A one-rank gloo process
    group is made at open (NVRx reads the rank). Not run on the development machine (NVRx is
    not installed there)."""

    def __init__(self, torch, root, device, keep):
        super().__init__(torch, root, device, keep)
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
        import concurrent.futures
        one_gloo_rank()  # NVRx asks for the rank in places (as train.py does)
        self.ck = TorchAsyncCheckpoint(persistent_queue=True)
        self.fifo = []
        self.commits = []
        self.ex = concurrent.futures.ThreadPoolExecutor(1)
        self.ret = Retainer(root, "ckpt-", ".pt", keep)
        self.load_torch = TorchSystem(torch, root, device, keep)

    def latest(self):
        return self.load_torch.latest()

    def load(self, step, specs):
        return self.load_torch.load(step, specs)

    def save(self, step, tensors):
        tmp = os.path.join(self.root, f".tmp-{step}.pt")
        self.ck.async_save({"step": step, "w": tensors}, tmp)
        self.fifo.append((step, tmp))

    def _commit(self, step, tmp):
        fsync_file(tmp)
        os.replace(tmp, os.path.join(self.root, f"ckpt-{step}.pt"))
        fsync_dir(self.root)
        return mono()

    def poll(self, block=False):
        q = self.ck._async_calls_queue
        for _ in q.maybe_finalize_async_calls(blocking=block, no_dist=True):
            step, tmp = self.fifo.pop(0)
            self.commits.append((step, self.ex.submit(self._commit, step, tmp)))
        out, keep = [], []
        for step, f in self.commits:
            if block or f.done():
                out.append((step, f.result()))
            else:
                keep.append((step, f))
        self.commits = keep
        if out:
            self.ret.trim()
        return out

    def close(self):
        self.poll(block=True)
        self.ck.finalize_async_save(blocking=True, no_dist=True, terminate=True)
        self.ex.shutdown(wait=True)


def probe():
    """Which systems this environment can run: {name: None or the reason it cannot}."""
    out = {"none": None, "torch": None}
    try:
        import shmckpt

        out["shm"] = None
        out["shm-tiered"] = None if hasattr(shmckpt, "Cadence") else "shmckpt has no Cadence (memory-only saves not in this build)"
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        out["shm"] = out["shm-tiered"] = f"import shmckpt failed: {e!r}"
    # found, not imported (2 s of the CPU test's start-up); a torch without async_save
    # fails the dcp run with the reason instead
    try:
        found = importlib.util.find_spec("torch.distributed.checkpoint") is not None
    except Exception as e:  # noqa: BLE001
        found, why = False, repr(e)
    else:
        why = "no torch.distributed.checkpoint in this torch"
    out["dcp"] = None if found else why
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        out["nvrx"] = "nvidia_resiliency_ext is not installed"
    else:
        try:
            from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint  # noqa: F401

            out["nvrx"] = None
        except Exception as e:  # noqa: BLE001
            out["nvrx"] = f"import TorchAsyncCheckpoint failed: {e!r}"
    return out


#: What a system imports beyond torch (a spare imports it before the failure).
SYSTEM_MODULES = {
    "none": (),
    "torch": (),
    "shm": ("shmckpt",),
    "shm-tiered": ("shmckpt",),
    "dcp": ("torch.distributed.checkpoint", "torch.distributed.checkpoint.staging"),
    "nvrx": ("nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt",),
}


def make_system(name, torch, root, device, keep, size_bytes):
    if name == "none":
        return NoSystem(torch, root, device, keep)
    if name in ("shm", "shm-tiered"):
        return ShmSystem(torch, root, device, keep, size_bytes, tiered=name == "shm-tiered")
    if name == "torch":
        return TorchSystem(torch, root, device, keep)
    if name == "dcp":
        return DCPSystem(torch, root, device, keep)
    if name == "nvrx":
        return NVRxSystem(torch, root, device, keep)
    raise SystemExit(f"unknown system {name}")


# -- the loop -------------------------------------------------------------------------


def calibrate(torch, device, step_ms, tensors, opt):
    """Time the update, and on CUDA the rate of ``torch.cuda._sleep``; the busy part of a
    step is then the step length minus the update."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ups = []
    for k in (1, 2, 3):
        sync()
        t = mono()
        opt.step(k)
        sync()
        ups.append(mono() - t)
    # undo the three steps so that the state stays at step 0
    with torch.no_grad():
        for i, t in enumerate(tensors.values()):
            t.sub_(float(c_sum(3, i)))
    out = {"update_ms": 1e3 * sorted(ups)[1]}
    if device == "cuda":
        rates = []
        for cyc in (1_000_000, 10_000_000, 1_000_000, 10_000_000):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cyc)
            b.record()
            b.synchronize()
            rates.append((cyc, a.elapsed_time(b)))
        (c1, m1), (c2, m2) = rates[2], rates[3]
        out["cycles_per_ms"] = (c2 - c1) / max(m2 - m1, 1e-6)
    out["busy_ms"] = max(0.0, step_ms - out["update_ms"])
    return out


_ADD_OPT = None


def add_opt(torch):
    """The trainer's optimizer class (one class object per process: a spare's warm-up
    constructs the very class the life uses)."""
    global _ADD_OPT
    if _ADD_OPT is None:

        class AddOpt(torch.optim.Optimizer):
            def __init__(self, params):
                super().__init__(params, {})

            @torch.no_grad()
            def step(self, k):  # noqa: D401 - the deterministic update of step k
                for i, p in enumerate(self.param_groups[0]["params"]):
                    p.add_(float(c_of(k, i)))

        _ADD_OPT = AddOpt
    return _ADD_OPT


def host_memory():
    """This process's host memory in bytes, from /proc: ``rss`` (the library pages it
    shares with the trainer included) and ``anon`` (its anonymous pages: its own heap, what
    it adds to the host); {} elsewhere."""
    fields = {"Rss": "rss_bytes", "Anonymous": "anon_bytes"}
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in fields:
                    out[fields[key]] = out.get(fields[key], 0) + int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--life", type=int, default=0)
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--size-bytes", type=int, required=True)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--step-ms", type=float, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--calib", required=True, help="JSON file: written by the baseline, read by every other run")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (the baseline); 0: until SIGTERM")
    ap.add_argument("--probe", action="store_true", help="after the steps, report which systems can run")
    ap.add_argument("--spare", action="store_true", help="start ahead, report ready on --ready-fd, wait for 'go <life>' on stdin")
    ap.add_argument("--ready-fd", type=int, help="--spare: where to write the spare-ready line")
    ap.add_argument("--meter", action="store_true",
                    help="after the steps (CUDA): the device's free memory, then again after a line on stdin (a spare ready beside)")
    return ap.parse_args()


def start(a):
    """Imports torch and makes the CUDA context (no state): (torch, t_import, t_cuda)."""
    import torch

    t_import = mono()
    if a.device == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
    torch.set_num_threads(1 if a.device == "cpu" else max(1, min(4, os.cpu_count() or 1)))
    return torch, t_import, mono()


def warm_up(a, torch):
    """A spare's start beyond ``start``: the system's modules imported, and the optimizer
    class constructed once and stepped on a one-element dummy tensor (the first
    ``torch.optim`` construction imports torch._dynamo and more)."""
    import importlib

    for name in SYSTEM_MODULES.get(a.system, ()):
        importlib.import_module(name)
    dummy = torch.zeros(1, device=a.device)
    add_opt(torch)([dummy]).step(1)
    if a.device == "cuda":
        torch.cuda.synchronize()
    del dummy


def wait_for_go(a, t_import, t_cuda):
    """spare-ready on ``--ready-fd`` (one JSON line), then ``go <life>`` from stdin: the
    spare becomes that life (its held events written with it). Returns the go's time;
    EOF on stdin (the supervisor is gone or done with it) ends the process."""
    t_ready = mono()
    ready = dict(t=t_ready, t_main=T_MAIN, t_import=t_import, t_cuda=t_cuda, pid=os.getpid(), **host_memory())
    if a.ready_fd is not None:
        os.write(a.ready_fd, (json.dumps(ready) + "\n").encode())
        os.close(a.ready_fd)
    line = sys.stdin.readline()
    t_go = mono()
    if not line.strip():
        os._exit(0)
    word, life = line.split()
    if word != "go":
        raise SystemExit(f"goodput_trainer: spare got {line!r}, not 'go <life>'")
    release(int(life))
    emit(e="go", t=t_go, t_ready=t_ready)
    return t_go


def meter(torch):
    """The device's free memory (the driver's count, every process), now and again after a
    line on stdin (the supervisor's: a spare is ready beside this process)."""
    free, total = torch.cuda.mem_get_info()
    emit(e="mem", spare=False, free=free, total=total, t=mono())
    sys.stdin.readline()
    free, total = torch.cuda.mem_get_info()
    emit(e="mem", spare=True, free=free, total=total, t=mono())


def main():
    global _FD, _LIFE, _HELD
    a = parse_args()
    _LIFE = a.life
    if a.spare:
        _HELD = []
    _FD = os.open(a.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    signal.signal(signal.SIGTERM, lambda *_: globals().__setitem__("_STOP", True))
    emit(e="main", t=T_MAIN, pid=os.getpid())
    torch, t_import, t_cuda = start(a)
    if a.spare:
        warm_up(a, torch)
        wait_for_go(a, t_import, t_cuda)
    train(a, torch, t_import, t_cuda)


def train(a, torch, t_import, t_cuda):
    """A life from the system's open on: open, load, check, set up, train until SIGTERM
    (or ``--steps``), check the live state, close."""
    os.makedirs(a.root, exist_ok=True)
    try:
        system = make_system(a.system, torch, a.root, a.device, a.keep, a.size_bytes)
    except Exception:
        emit(e="error", where="open", tb=traceback.format_exc())
        raise
    t_open = mono()
    specs = shapes(a.size_bytes, a.tensors)
    r = system.latest()
    fresh = r is None
    if fresh:
        tensors = {name: initial(torch, n, i, a.device) for i, (name, n) in enumerate(specs)}
        r = 0
    else:
        tensors = system.load(r, specs)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    t_load = mono()
    bad = None if fresh else check(torch, tensors, specs, r, a.device)
    sync()
    t_check = mono()
    emit(
        e="resume", k=r, fresh=fresh, t_import=t_import, t_cuda=t_cuda, t_open=t_open, t_load=t_load,
        t_check=t_check, check_s=t_check - t_load, ok=bad is None, why=bad, info=system.info,
    )
    if bad is not None:
        sys.stderr.write(f"goodput_trainer: resume of step {r} is not bit-exact: {bad}\n")
        os._exit(3)
    opt = add_opt(torch)(list(tensors.values()))
    t_opt = mono()
    if a.calib and os.path.exists(a.calib):
        with open(a.calib) as f:
            cal = json.load(f)
    else:
        cal = calibrate(torch, a.device, a.step_ms, tensors, opt)
        tmp = a.calib + f".{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(cal, f)
        os.replace(tmp, a.calib)
        emit(e="calib", **cal)
    t_calib = mono()
    system.attach(opt)
    # The set-up split (restart reports): the optimizer made, the calibration read (or
    # measured, in a first life), the system attached (shmckpt's guard).
    emit(e="setup", t=mono(), t_opt=t_opt, t_calib=t_calib)
    if a.device == "cuda":
        cycles = int(cal["busy_ms"] * cal["cycles_per_ms"])

        def busy():
            torch.cuda._sleep(cycles)

        stream = torch.cuda.current_stream()
        sync = stream.synchronize
    else:
        busy_s = cal["busy_ms"] / 1e3

        def busy():
            time.sleep(busy_s)

    every = 1 if system.every_step else a.every
    k = r
    t_prev = None
    try:
        while not _STOP and (a.steps == 0 or k - r < a.steps):
            k += 1
            t0 = mono()
            busy()
            system.before_update()
            opt.step(k)
            sync()
            t1 = mono()
            # the step is done (the state is at step k) before its save starts: a kill
            # during the save finds it logged. dt runs from the previous step's end, so it
            # holds the previous step's save call and poll.
            emit(e="s", k=k, t=t1, dt=t1 - (t0 if t_prev is None else t_prev))
            t_prev = t1
            if system.saves and k % every == 0:
                ts = mono()
                system.save(k, tensors)
                emit(e="sv", k=k, t=ts, call_s=mono() - ts)
            dur = system.poll()
            if dur:
                emit(e="d", dur=dur)
            for rep in system.reports():
                emit(e="saved", **rep)
        t = mono()
        bad = check(torch, tensors, specs, k, a.device)  # the live state too, after the loop
        emit(e="stop", k=k, t=t, ok=bad is None, why=bad, check_s=mono() - t)
        if bad is not None:
            sys.stderr.write(f"goodput_trainer: the state after step {k} is wrong: {bad}\n")
            os._exit(3)
        if a.probe:
            emit(e="probe", systems=probe(), torch=torch.__version__, python=sys.version.split()[0],
                 gpu=torch.cuda.get_device_name(0) if a.device == "cuda" else None)
        if a.meter and a.device == "cuda":
            meter(torch)
        t = mono()
        system.close()
        emit(e="closed", close_s=mono() - t)
    except Exception:
        emit(e="error", where="loop", k=k, tb=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
