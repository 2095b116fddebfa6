"""Part of train.py (the training-loop checkpoint benchmark; see its docstring and
README.md): the systems under test, one System class each (none, torch, dcp, dcp-shm,
nvrx, nvrx-fswa, shm-block, shm-async), and SYSTEM_CLASSES, name -> class."""

import collections
import concurrent.futures
import json
import os
import shutil
import time
from functools import partial

from peers import fsync_path, now, nvrx_close
from train_model import MiB


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
            f"dcp.async_save(state, storage_writer=ShmckptWriter(dir/step, tuning=shmckpt.Tuning(staging_capacity={self.capacity}))) "
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
        from shmckpt import Tuning
        from shmckpt.dcp import ShmckptWriter

        w = {}
        sd = dcp_state(self.ctx, state)

        def call(d):
            w["writer"] = ShmckptWriter(d, tuning=Tuning(staging_capacity=self.capacity))
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
        self.kwargs = {"keep_last": ctx.keep_last, "tuning": shmckpt.Tuning(staging_capacity=int(self.staging_capacity))}
        #: The call, as the rows' ``api`` says it.
        self.call = f"shmckpt.Checkpointer(root, keep_last={ctx.keep_last}, tuning=shmckpt.Tuning(staging_capacity={int(self.staging_capacity)}))"
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
    snapshot = None  # shm-snap: save(..., snapshot="device")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.shared = ctx.get_shm()
        self.api = (
            f"ckpt = {self.shared.call}; ckpt.guard(opt) once; "
            + ("h = ckpt.save(step, state)" if self.blocking else "h = ckpt.save(step, state, blocking=False" + (f", snapshot={self.snapshot!r})" if self.snapshot else ")"))
            + "; every iteration h.done(); at the end h.wait()"
        )
        self.notes.append("one Checkpointer (root dir/shmckpt) shared by shm-block and shm-async; guard(opt) installed before the first timed iteration of every system")
        self.notes.append("durable = h.done() seen by the per-iteration poll (resolution: one iteration); keep_last handled by shmckpt")

    def save(self, step, state, rec):
        rec["queue_depth"] = len(self.pending)
        if self.blocking:
            h = self.shared.ck.save(step, state)
        elif self.snapshot:
            h = self.shared.ck.save(step, state, blocking=False, snapshot=self.snapshot)
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


class SysShmSnap(_Shm):
    """shm-async with the opt-in device snapshot (issue 24): what is still copying when
    opt.step() starts is snapshotted device-to-device; the report's snapshot_bytes is its
    size. Not in train.py's default systems (sweep.py: --systems ...,shm-snap)."""

    name = "shm-snap"
    blocking = False
    snapshot = "device"


SYSTEM_CLASSES = {
    "none": SysNone,
    "torch": SysTorch,
    "dcp": SysDCP,
    "dcp-shm": SysDCPShm,
    "nvrx": SysNVRx,
    "nvrx-fswa": SysNVRxFSWA,
    "shm-block": SysShmBlock,
    "shm-async": SysShmAsync,
    "shm-snap": SysShmSnap,
}
