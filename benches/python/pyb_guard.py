"""py_bench.py section 2: non-blocking save under guard(opt) in a fake training step."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import torch

from pyb_common import med, mem_snapshot, Pinned, ratio, sync
from pyb_results import Ctx


# ----------------------------------------------------------------------------- 2. guard
def section_guard(ctx: Ctx, sname: str, st: Dict[str, Any], rec: Dict[str, Any]) -> None:
    a, dev, bud = ctx.args, ctx.device, ctx.budget
    state = st["state"]
    cuda = dev.startswith("cuda")
    params = {k: v for k, v in state.items() if v.is_floating_point()}
    pbytes = sum(v.numel() * v.element_size() for v in params.values())
    save_est = pbytes / (a.disk_gbps * 1e9) + 0.5
    if not bud.allows(3 * save_est + 10):
        rec.setdefault("skipped", []).append(f"guard: budget (needs ~{3 * save_est + 10:.0f} s)")
        return
    # The pinned copy of exactly the saved bytes (the guarded parameters).
    ref = st["pinned"] if len(params) == len(state) else Pinned(params, dev)
    ref.d2h(dev)
    copies = [ref.d2h(dev) for _ in range(3)]
    copy_s = med(copies)
    rec.update(saved_bytes=pbytes, saved_tensors=len(params), pinned_copy_runs_s=copies, pinned_copy_s=copy_s)
    del ref
    st["dirty"] = True  # opt.step() changes the state after its last save
    try:
        _guard_body(ctx, st, rec, params, pbytes, save_est, copy_s, cuda)
    finally:
        for p in params.values():
            p.grad = None
            p.requires_grad_(False)


def _guard_body(ctx: Ctx, st: Dict[str, Any], rec: Dict[str, Any], params: Dict[str, torch.Tensor],
                pbytes: int, save_est: float, copy_s: Optional[float], cuda: bool) -> None:
    a, dev, bud, ckpt = ctx.args, ctx.device, ctx.budget, st["ckpt"]
    for p in params.values():
        p.requires_grad_(True)
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(list(params.values()), lr=1e-6, foreach=True)
    opt.step()  # allocate exp_avg / exp_avg_sq
    sync(dev)
    rec["optimizer"] = "AdamW(foreach=True), state allocated by one step before timing"
    n = a.mm_size
    A = torch.randn(n, n, dtype=torch.bfloat16 if cuda else torch.float32, device=dev)
    B = torch.randn_like(A)
    C = torch.empty_like(A)
    grads = [p.grad for p in params.values()]

    def fwd_bwd(k: int) -> None:
        for _ in range(k):
            torch.matmul(A, B, out=C)
        for g in grads:  # the "backward" writes the gradients
            g.mul_(0.5)

    # Calibrate matmuls per fake forward/backward.
    def timed(k: int) -> float:
        t = time.perf_counter()
        fwd_bwd(k)
        sync(dev)
        return time.perf_counter() - t

    timed(2)
    t_grads = min(timed(0) for _ in range(3))
    t_10 = min(timed(10) for _ in range(3))
    per_mm = max((t_10 - t_grads) / 10, 1e-6)
    rec["calibration"] = {"grads_only_s": t_grads, "ten_matmuls_s": t_10, "per_matmul_s": per_mm}
    hook_t: List[float] = []
    ckpt.guard(opt)
    h_mine = opt.register_step_pre_hook(lambda *_: hook_t.append(time.perf_counter()))
    stream_sync = (lambda: torch.cuda.current_stream().synchronize()) if cuda else (lambda: None)
    targets = [float(x) for x in a.fwd_ms.split(",")] + ([1.3 * copy_s * 1e3] if a.fwd_covering and copy_s else [])
    rec["cases"] = []
    try:
        for target_ms in targets:
            k = max(1, round((target_ms / 1e3 - t_grads) / per_mm))
            case: Dict[str, Any] = {"target_fwd_ms": target_ms, "matmuls": k, "matmul_n": n, "with": [], "without": []}
            rec["cases"].append(case)
            fwd_bwd(k)  # warm
            opt.step()
            sync(dev)
            for rep in range(a.guard_reps):
                for with_save in ((False, True) if rep % 2 == 0 else (True, False)):
                    last_it = max([x["iteration_s"] for x in case["without"]] or [target_ms / 1e3])
                    if not bud.allows(last_it + (save_est if with_save else 0) + 1):
                        rec.setdefault("skipped", []).append(f"target {target_ms} rep {rep}: budget")
                        continue
                    sync(dev)
                    hook_t.clear()
                    h = None
                    m0 = mem_snapshot(dev) if with_save else None
                    t0 = time.perf_counter()
                    if with_save:
                        step = st["next_step"]
                        st["next_step"] += 1
                        h = ckpt.save(step, params, blocking=False)
                    t1 = time.perf_counter()
                    m1 = mem_snapshot(dev) if with_save else None
                    fwd_bwd(k)
                    stream_sync()  # e.g. loss.item(): the host sees the end of the backward
                    t2 = time.perf_counter()
                    staged_before_step = h.staged() if h is not None else None
                    opt.step()
                    t3 = time.perf_counter()
                    stream_sync()
                    t4 = time.perf_counter()
                    r = {
                        "save_call_s": t1 - t0,
                        "fwd_bwd_s": t2 - t1,
                        "step_wait_s": (hook_t[-1] - t2) if hook_t else None,
                        "opt_step_host_s": t3 - t2,
                        "iteration_s": t4 - t0,
                        "staged_before_step": staged_before_step,
                    }
                    if m0 is not None:
                        r["memory_at_save_call"] = {"before": m0, "after": m1}
                    if h is not None:
                        rep_ = h.wait()
                        st["last_step"] = step
                        st["last_file"] = rep_.get("file")
                        r["engine_staging_s"] = rep_.get("staging")
                    case["with" if with_save else "without"].append(r)
                    ctx.res.flush()
            w = lambda key, side: med([x[key] for x in case[side] if x[key] is not None])  # noqa: E731
            wait_with, wait_without = w("step_wait_s", "with"), w("step_wait_s", "without")
            step_with, step_without = w("opt_step_host_s", "with"), w("opt_step_host_s", "without")
            fwd = w("fwd_bwd_s", "without")
            stall = None if step_with is None or step_without is None else max(0.0, step_with - step_without)
            mems = [x["memory_at_save_call"] for x in case["with"] if "memory_at_save_call" in x]
            case["summary"] = {
                "memory_unchanged_by_save_call": None if not mems else all(
                    m["before"]["allocated"] == m["after"]["allocated"] and m["before"]["reserved"] == m["after"]["reserved"]
                    for m in mems),
                "step_wait_s": wait_with,
                "step_wait_no_save_s": wait_without,
                "opt_step_extra_s": stall,
                "iteration_extra_s": None if w("iteration_s", "with") is None or w("iteration_s", "without") is None
                else w("iteration_s", "with") - w("iteration_s", "without"),
                "fwd_bwd_s": fwd,
                "fwd_bwd_with_save_s": w("fwd_bwd_s", "with"),
                "save_call_s": w("save_call_s", "with"),
                "wait_over_pinned_copy": ratio(wait_with, copy_s),
                "lower_bound_s": None if fwd is None or copy_s is None else max(0.0, copy_s - fwd),
                "goal_0_2_met": None if wait_with is None or copy_s is None else wait_with <= 0.2 * copy_s,
            }
            ctx.res.flush()
    finally:
        h_mine.remove()
        ckpt.unguard(opt)
        del opt, A, B, C, grads

