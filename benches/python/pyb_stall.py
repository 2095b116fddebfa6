"""py_bench.py section 1: stall of a blocking save (Python, CLI, pinned D2H), memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import traceback
from typing import Any, Callable, Dict, List

from pyb_common import gbps, log, med, mem_snapshot, parse_cli_json, ratio, sync
from pyb_results import Ctx


# ----------------------------------------------------------------------------- 1. stall
def section_stall(ctx: Ctx, sname: str, st: Dict[str, Any], rec: Dict[str, Any]) -> None:
    a, dev, bud = ctx.args, ctx.device, ctx.budget
    state, ckpt, pinned, nbytes = st["state"], st["ckpt"], st["pinned"], st["nbytes"]
    save_est = nbytes / (a.disk_gbps * 1e9) + 0.5
    rec.update(bytes=nbytes, tensors=len(state), py_runs=[], d2h_runs_s=[], cli_blocks=[], memory_runs=[])
    pinned.d2h(dev)  # warm-up: first touch of the pinned pages
    if dev.startswith("cuda"):
        rec["prepare_cuda_s"] = ckpt.prepare_cuda()

    def py_block(n: int, warm: bool) -> None:
        for i in range(n):
            if not bud.allows(save_est):
                rec.setdefault("skipped", []).append("python save: budget")
                return
            rec["d2h_runs_s"].append(pinned.d2h(dev))
            m0 = mem_snapshot(dev)
            step = st["next_step"]
            st["next_step"] += 1
            sync(dev)
            t = time.perf_counter()
            h = ckpt.save(step, state)
            stall = time.perf_counter() - t
            m1 = mem_snapshot(dev)
            rep = h.wait()
            m2 = mem_snapshot(dev)
            st["last_step"] = step
            st["last_file"] = rep.get("file")
            rec["py_runs"].append(
                {
                    "step": step,
                    "warmup": warm and i == 0,
                    "stall_s": stall,
                    "report": {k: v for k, v in rep.items() if isinstance(v, (int, float, str, bool))},
                }
            )
            if m0 is not None:
                rec["memory_runs"].append({"before": m0, "staged": m1, "durable": m2})
            ctx.res.flush()

    def cli_block(n: int) -> None:
        cli = a.cli
        if not cli or not os.path.exists(cli):
            rec.setdefault("skipped", []).append(f"CLI: binary {cli!r} not found")
            return
        est = (n + 1) * save_est + nbytes / 3e9 + 5
        if not bud.allows(est):
            rec.setdefault("skipped", []).append(f"CLI block: budget (needs ~{est:.0f} s)")
            return
        d = os.path.join(a.root, f"cli-{sname}")
        shutil.rmtree(d, ignore_errors=True)
        cmd = [cli, "bench", "--source", "cuda" if dev.startswith("cuda") else "host",
               "--layout", st["layout_path"], "--repeat", str(n), "--json",
               "--no-reference", "--dir", d]
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, bud.left()))
        finally:
            shutil.rmtree(d, ignore_errors=True)
        blk: Dict[str, Any] = {"cmd": " ".join(cmd), "rc": p.returncode, "wall_s": time.monotonic() - t}
        if p.returncode != 0:
            blk["stderr_tail"] = p.stderr[-3000:]
            blk["stdout_tail"] = p.stdout[-2000:]
        else:
            blk["json"] = parse_cli_json(p.stdout)
        rec["cli_blocks"].append(blk)
        ctx.res.flush()

    def guarded(fn: Callable[..., None], *args: Any, **kw: Any) -> None:
        try:
            fn(*args, **kw)
        except Exception:
            rec.setdefault("block_errors", []).append(traceback.format_exc())
            log(f"{sname}: stall block failed:\n{rec['block_errors'][-1]}")

    k = a.py_per_block
    guarded(py_block, k + 1, warm=True)   # A (first save is a warm-up: fresh staging pages)
    for _ in range(max(1, a.cli_blocks)):
        guarded(cli_block, a.cli_repeat)  # B
        guarded(py_block, k, warm=False)  # A

    # Summary.
    py = [r["stall_s"] for r in rec["py_runs"] if not r["warmup"]]
    cli_runs: List[float] = []
    cli_d2h: List[float] = []
    for b in rec["cli_blocks"]:
        j = b.get("json")
        if j:
            cli_runs += [r["stall_s"] for r in j.get("runs", [])][1:] or [r["stall_s"] for r in j.get("runs", [])]
            cli_d2h += j.get("d2h_runs_s", []) or []
    s = {
        "py_stall_s": med(py),
        "py_stall_first_s": rec["py_runs"][0]["stall_s"] if rec["py_runs"] else None,
        "py_engine_staging_s": med([r["report"].get("staging") for r in rec["py_runs"] if not r["warmup"] and "staging" in r["report"]]),
        "cli_stall_s": med(cli_runs),
        "cli_d2h_s": med(cli_d2h),
        "d2h_s": med(rec["d2h_runs_s"]),
        "py_durable_s": med([r["report"].get("durable") for r in rec["py_runs"] if "durable" in r["report"]]),
    }
    s["d2h_gbps"] = gbps(nbytes, s["d2h_s"])
    s["py_over_cli"] = ratio(s["py_stall_s"], s["cli_stall_s"])
    s["py_over_d2h"] = ratio(s["py_stall_s"], s["d2h_s"])
    s["cli_over_d2h"] = ratio(s["cli_stall_s"], s["d2h_s"])
    s["goal_py_over_cli_1_05_met"] = None if s["py_over_cli"] is None else s["py_over_cli"] <= 1.05
    if rec["memory_runs"]:
        unchanged = all(
            m["before"]["allocated"] == m["staged"]["allocated"] == m["durable"]["allocated"]
            and m["before"]["reserved"] == m["staged"]["reserved"] == m["durable"]["reserved"]
            for m in rec["memory_runs"]
        )
        s["memory_unchanged_by_save"] = unchanged
        s["max_free_drop_during_save_bytes"] = max(
            max(m["before"]["free"] - m["staged"]["free"], m["before"]["free"] - m["durable"]["free"])
            for m in rec["memory_runs"]
        )
    rec["summary"] = s

