"""py_bench.py: the results document and its markdown, the context shared by the
sections and the section runner."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from typing import Any, Callable, Dict

import torch

from pyb_common import Budget, Evictor, fmt, gbps, GiB, log, ratio


class Results:
    """The JSON document, rewritten (atomically) with its markdown after every change."""

    def __init__(self, out_dir: str, meta: Dict[str, Any]):
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.doc: Dict[str, Any] = {"meta": meta, "states": {}}

    def state(self, name: str) -> Dict[str, Any]:
        return self.doc["states"].setdefault(name, {})

    def flush(self) -> None:
        for fname, text in (
            ("py_bench.json", json.dumps(self.doc, indent=1, default=str)),
            ("py_bench.md", render_markdown(self.doc)),
        ):
            p = os.path.join(self.out_dir, fname)
            with open(p + ".tmp", "w") as f:
                f.write(text)
            os.replace(p + ".tmp", p)


# ----------------------------------------------------------------------------- context
class Ctx:
    def __init__(self, args: argparse.Namespace, res: Results, budget: Budget):
        self.args = args
        self.res = res
        self.budget = budget
        self.device = args.device
        self.evictor = Evictor()


def run_section(ctx: Ctx, sname: str, section: str, fn: Callable[[Dict[str, Any]], None]) -> None:
    rec = ctx.res.state(sname).setdefault(section, {})
    log(f"{sname}: {section} (budget left {ctx.budget.left():.0f} s)")
    t = time.monotonic()
    try:
        fn(rec)
    except Exception:
        rec["error"] = traceback.format_exc()
        log(f"{sname}: {section} FAILED:\n{rec['error']}")
    finally:
        rec["section_s"] = time.monotonic() - t
        ctx.res.flush()
        gc.collect()
        if ctx.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the benchmark's own leftovers only


# ----------------------------------------------------------------------------- markdown
def render_markdown(doc: Dict[str, Any]) -> str:
    m = doc["meta"]
    L = [f"# shmckpt Python benchmark ({m.get('device_name')}, {m.get('started')})", "",
         f"torch {m.get('torch')}, safetensors {m.get('safetensors')}, shmckpt {m.get('shmckpt')}, "
         f"Python {m.get('python')}; root `{m.get('root')}`; medians of alternated runs.", ""]
    for sname, st in doc["states"].items():
        L.append(f"## {sname}: {st.get('desc', '')}")
        L.append("")
        s = st.get("stall", {}).get("summary")
        if s:
            L += ["| stall | s | GB/s | ratio | goal |", "|---|---|---|---|---|",
                  f"| pinned D2H (this run) | {fmt(s['d2h_s'])} | {fmt(s['d2h_gbps'], 1)} | 1 | |",
                  f"| CLI `shmckpt bench` stall | {fmt(s['cli_stall_s'])} | {fmt(gbps(st['stall']['bytes'], s['cli_stall_s']), 1)} | {fmt(s['cli_over_d2h'], 3)} × D2H | |",
                  f"| Python `save()` wall | {fmt(s['py_stall_s'])} | {fmt(gbps(st['stall']['bytes'], s['py_stall_s']), 1)} | {fmt(s['py_over_d2h'], 3)} × D2H | |",
                  f"| engine staging seen from Python (report `staging`) | {fmt(s['py_engine_staging_s'])} | | {fmt(ratio(s['py_engine_staging_s'], s['cli_stall_s']), 3)} × CLI | |",
                  f"| Python / CLI | | | **{fmt(s['py_over_cli'], 3)}** | ≤ 1.05: {fmt(s['goal_py_over_cli_1_05_met'])} |",
                  f"| Python first save (warm-up) | {fmt(s['py_stall_first_s'])} | | | |",
                  f"| memory_allocated/reserved unchanged by save | {fmt(s.get('memory_unchanged_by_save'))} | | | must be yes |",
                  ""]
        for sec in ("stall", "guard", "load"):
            r = st.get(sec, {})
            if r.get("error"):
                L += [f"**{sec} failed**: `{r['error'].strip().splitlines()[-1]}`", ""]
            if r.get("skipped"):
                L += [f"{sec} skipped: " + "; ".join(r["skipped"]), ""]
        s = st.get("load", {}).get("summary")
        if s:
            nb = st["load"].get("file_bytes")
            L += ["| load | s | GB/s | × raw read | verified |", "|---|---|---|---|---|"]
            for k in st["load"]["runs"]:
                L.append(f"| {k} | {fmt(s.get(k))} | {fmt(gbps(nb, s.get(k)), 2)} | {fmt(s.get(f'{k}_over_raw_read'), 3)} | {st['load'].get('verified', {}).get(k, '')} |")
            pc = st["load"].get("page_cache", {})
            L += ["", f"drop_caches write accepted: {fmt(pc.get('drop_caches_ok'))}; fadvise DONTNEED: {fmt(pc.get('fadvise_dontneed_ok'))}; "
                  f"eviction effective (buffered read after it ≥ 0.7 × raw read): {fmt(s.get('page_cache_drop_effective'))}; "
                  f"raw read O_DIRECT: {fmt(st['load'].get('raw_read_direct'))}", ""]
        g = st.get("guard", {})
        if g.get("cases"):
            L += [f"Guard: {g.get('saved_bytes', 0) / GiB:.2f} GiB of parameters (AdamW), pinned copy {fmt(g.get('pinned_copy_s'))} s", "",
                  "| fake fwd/bwd | wait in opt.step (pre-hook) | × pinned copy | opt.step extra vs no save | lower bound max(0, copy − fwd) | fwd/bwd with save | save() call | iteration extra | device memory unchanged by save() | goal ≤ 0.2 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
            for c in g["cases"]:
                cs = c.get("summary")
                if cs:
                    L.append(f"| {fmt(cs['fwd_bwd_s'])} s | {fmt(cs['step_wait_s'])} s | {fmt(cs['wait_over_pinned_copy'], 3)} | {fmt(cs['opt_step_extra_s'])} s | {fmt(cs['lower_bound_s'])} s | {fmt(cs['fwd_bwd_with_save_s'])} s | {fmt(cs['save_call_s'])} s | {fmt(cs['iteration_extra_s'])} s | {fmt(cs['memory_unchanged_by_save_call'])} | {fmt(cs['goal_0_2_met'])} |")
            L.append("")
    return "\n".join(L) + "\n"
