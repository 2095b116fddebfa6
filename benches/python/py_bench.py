#!/usr/bin/env python3
"""Python-level benchmark of the shmckpt package against its physical limits (issue 11).

For each state (``8g``: 8 GiB in 64 bf16 tensors; ``16g``: 16 GiB in 1,000 tensors of the
CLI's ``--dtype mixed`` layout; ``tiny``: a few MiB, for a CPU smoke test) it measures, in
one process and with A/B alternation:

1. ``stall``: wall time of a blocking ``Checkpointer.save`` against the Rust CLI
   (``shmckpt bench --layout``, same tensors) and against a plain pinned D2H copy of the
   same bytes measured here; GPU memory counters around every save (``memory``).
2. ``load``: ``Checkpointer.load(map_location=dev)`` and ``load_into`` against
   ``safetensors.torch.load_file`` of the same file, ``torch.load`` of a ``torch.save`` of
   the same state, a raw O_DIRECT read of the file (1 stream and 16 in flight) and a
   pinned H2D copy; the page cache is dropped before every file read when possible.
3. ``guard``: non-blocking save under ``guard(opt)`` in a fake training step (AdamW over
   the state's floating tensors, matmul-heavy fake forward/backward): how long
   ``opt.step()`` waits in the guard's pre-hook.

Results go to ``OUT/py_bench.json`` and ``OUT/py_bench.md``, rewritten after every
measurement, so a run cut short keeps what it measured. Sections that fail record their
traceback and the others go on. See benches/python/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import time
import traceback
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pyb_common import Budget, build_state, GiB, layout_bytes, log, mem_snapshot, MiB, Pinned, STATES, sync  # noqa: E402
from pyb_results import Ctx, render_markdown, Results, run_section  # noqa: E402
from pyb_guard import section_guard  # noqa: E402
from pyb_load import section_load  # noqa: E402
from pyb_stall import section_stall  # noqa: E402


def build_entry(ctx: Ctx, sname: str, srec: Dict[str, Any]) -> Dict[str, Any]:
    a, dev = ctx.args, ctx.device
    layout = STATES[sname]()
    nbytes = layout_bytes(layout)
    dts = "/".join(sorted({e["dtype"] for e in layout}))
    srec["desc"] = f"{nbytes / GiB:.2f} GiB in {len(layout)} tensors ({dts}) on {dev}"
    lp = os.path.join(a.out, f"layout-{sname}.json")
    with open(lp, "w") as f:
        json.dump(layout, f)
    t = time.perf_counter()
    state = build_state(layout, dev)
    sync(dev)
    srec["fill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    pinned = Pinned(state, dev)
    srec["pinned_alloc_s"] = time.perf_counter() - t
    srec["memory_after_alloc"] = mem_snapshot(dev)
    return {"state": state, "nbytes": nbytes, "layout_path": lp, "pinned": pinned}


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--state", "--states", dest="states", default="8g,16g", help="comma list of " + ",".join(STATES))
    ap.add_argument("--sections", default="stall,load,guard", help="comma list of stall,load,guard (memory is recorded in stall)")
    ap.add_argument("--guard-states", default="8g,tiny,1g", help="states the guard section runs on")
    ap.add_argument("--load-states", default="8g,16g,tiny,1g", help="states the load section runs on")
    ap.add_argument("--root", default=None, help="checkpoint root on the disk to measure (default: ./py-bench-root)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "py-bench-out")
    ap.add_argument("--cli", default="target/release/shmckpt", help="the shmckpt CLI binary")
    ap.add_argument("--budget-s", type=float, default=280.0)
    ap.add_argument("--py-per-block", type=int, default=2, help="Python saves per A block")
    ap.add_argument("--cli-repeat", type=int, default=3, help="--repeat of each CLI block (its first run is dropped)")
    ap.add_argument("--cli-blocks", type=int, default=1)
    ap.add_argument("--load-reps", type=int, default=2)
    ap.add_argument("--guard-reps", type=int, default=3)
    ap.add_argument("--fwd-ms", default=None, help="fake forward/backward targets, ms (comma list; default 80 on cuda, 10 on cpu)")
    ap.add_argument("--fwd-covering", dest="fwd_covering", action="store_true", default=None,
                    help="also a case whose forward/backward is 1.3 x the pinned copy (default on cuda)")
    ap.add_argument("--no-fwd-covering", dest="fwd_covering", action="store_false")
    ap.add_argument("--mm-size", type=int, default=0, help="matmul side (default 8192 cuda, 256 cpu)")
    ap.add_argument("--no-torch-load", dest="torch_load", action="store_false")
    ap.add_argument("--no-dcp-load", dest="dcp_load", action="store_false", help="skip the DCP loads (FileSystemReader, ShmckptReader)")
    ap.add_argument("--no-safetensors-fast", dest="safetensors_fast", action="store_false")
    ap.add_argument("--disk-gbps", type=float, default=2.0, help="write speed assumed by the budget")
    ap.add_argument("--read-gbps", type=float, default=2.0, help="read speed assumed by the budget")
    a = ap.parse_args()
    if a.fwd_ms is None:
        a.fwd_ms = "80" if a.device == "cuda" else "10"
    if a.fwd_covering is None:
        a.fwd_covering = a.device == "cuda"
    if not a.mm_size:
        a.mm_size = 8192 if a.device == "cuda" else 256
    a.root = os.path.abspath(a.root or "py-bench-root")
    a.cli = os.path.abspath(a.cli) if a.cli else a.cli
    os.makedirs(a.root, exist_ok=True)
    budget = Budget(a.budget_s)

    import shmckpt

    try:
        import safetensors
        st_ver = safetensors.__version__
    except Exception as e:  # noqa: BLE001
        st_ver = f"unavailable: {e!r}"
    dev = "cuda:0" if a.device == "cuda" else "cpu"
    if dev.startswith("cuda"):
        torch.cuda.set_device(0)
    meta = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv,
        "args": vars(a),
        "device": dev,
        "device_name": torch.cuda.get_device_name(0) if dev.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "safetensors": st_ver,
        "shmckpt": getattr(shmckpt, "__version__", "?"),
        "shmckpt_file": shmckpt.__file__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "root": a.root,
        "cli": a.cli,
        "skipped": [],
    }
    res = Results(a.out, meta)
    ctx = Ctx(a, res, budget)
    ctx.device = dev
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    if not dev.startswith("cuda"):
        meta["skipped"].append("CUDA-only parts (pinned memory, prepare_cuda, H2D, GPU memory counters, "
                               "safetensors fast CUDA path): --device cpu; the references are plain host copies")
    res.flush()

    # The plan: first the stall (and guard) of every state, then the loads, so the
    # budget goes to the stalls first. States stay allocated between their items; each
    # item opens its own checkpointer (fresh root) and removes it after, so the disk
    # holds at most one state's checkpoints plus the CLI's.
    states = [x.strip() for x in a.states.split(",") if x.strip()]
    plan: List[Any] = []
    for sname in states:
        secs = [x for x in ("stall", "guard") if x in sections and (x != "guard" or sname in a.guard_states.split(","))]
        if secs:
            plan.append((sname, secs))
    for sname in states:
        if "load" in sections and sname in a.load_states.split(","):
            plan.append((sname, ["load"]))
    meta["plan"] = plan
    last_use = {sname: i for i, (sname, _) in enumerate(plan)}
    cache: Dict[str, Dict[str, Any]] = {}
    for idx, (sname, secs) in enumerate(plan):
        srec = res.state(sname)
        if budget.left() < 10:
            srec.setdefault("skipped", []).append(f"{','.join(secs)}: budget")
            res.flush()
            continue
        st = cache.get(sname)
        try:
            if st is None:
                st = cache[sname] = build_entry(ctx, sname, srec)
            root = os.path.join(a.root, f"py-{sname}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            t = time.perf_counter()
            st["ckpt"] = shmckpt.Checkpointer(root, keep_last=1, tuning=shmckpt.Tuning(staging_capacity=st["nbytes"] + 64 * MiB + 8 * MiB))
            srec.setdefault("checkpointer_open_s", []).append(time.perf_counter() - t)
            st.update(next_step=1, last_step=None, last_file=None, dirty=False)
            res.flush()
        except Exception:
            srec.setdefault("setup_errors", []).append(traceback.format_exc())
            log(f"{sname}: setup FAILED\n{srec['setup_errors'][-1]}")
            res.flush()
            cache.pop(sname, None)
            st = None
            gc.collect()
            continue
        try:
            for sec in secs:
                fn = {"stall": section_stall, "guard": section_guard, "load": section_load}[sec]
                run_section(ctx, sname, sec, lambda r, fn=fn: fn(ctx, sname, st, r))
        finally:
            try:
                st.pop("ckpt").close()
            except Exception:
                srec.setdefault("close_errors", []).append(traceback.format_exc())
            shutil.rmtree(os.path.join(a.root, f"py-{sname}"), ignore_errors=True)
            if last_use[sname] == idx:
                cache.pop(sname, None)
                st = None
                gc.collect()
                if dev.startswith("cuda"):
                    torch.cuda.empty_cache()
                    srec["memory_after_free"] = mem_snapshot(dev)
            res.flush()
    res.doc["meta"]["wall_s"] = budget.seconds - budget.left()
    res.flush()
    log(f"done in {res.doc['meta']['wall_s']:.1f} s; {os.path.join(a.out, 'py_bench.md')}")
    sys.stdout.write(render_markdown(res.doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
