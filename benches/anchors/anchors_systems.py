"""anchors: the per-system runners (torch, dcp, nvrx, nvrx-fswa; shmckpt in
anchors_shmckpt.py), the SYSTEMS table and measure_system()."""

import inspect
import os
import time
import traceback
from functools import partial

from peers import fsync_path, log, now, nvrx_close

from anchors_shmckpt import sys_shmckpt
from anchors_state import mutate_in_place
from anchors_util import EmptyCacheCounter, TreeMemSampler, disk_usage_of, gpu_mem, host_cleanup, rmtree


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
