"""Part of train.py (the training-loop checkpoint benchmark; see its docstring and
README.md): the run context (Ctx), one timed segment of one system (run_segment), and
the colocated case (measure_free, colocated_trial)."""

import gc
import os
import time
import traceback

from peers import elapsed, log, now
from train_measure import gpu_snapshot, host_used
from train_model import GiB, Trainer, mean, med, pct
from train_systems import SYSTEM_CLASSES, Deleter, ShmShared, SysNone


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
