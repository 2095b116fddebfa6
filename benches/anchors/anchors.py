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

This file is the entry point and the driver (arguments, meta, the loop over
states and systems); the rest lives next to it: anchors_state.py (generator,
layouts, state), anchors_util.py (memory sampler, helpers), anchors_refs.py
(raw write, pinned D2H), anchors_systems.py (torch, dcp, nvrx, nvrx-fswa,
SYSTEMS, measure_system), anchors_shmckpt.py (shmckpt runner, interchange
check), anchors_report.py (tables, results files).

The script spawns processes (DCP's writer process, NVRx's worker, a
multiprocessing Manager): everything that runs is under the __main__ guard, and
the module top level only defines things, because spawned children re-import
this file as __mp_main__.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import traceback

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
    log,
    now,
    pkg_version,
    raise_nofile,
    set_log_file,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from anchors_refs import d2h_ref, raw_write_ref  # noqa: E402  (sibling modules, see README.md)
from anchors_report import render_text, table_rows, write_results  # noqa: E402
from anchors_shmckpt import interchange_check, selftest_interchange_synthetic  # noqa: E402
from anchors_state import GiB, layout_nbytes, make_layout, make_state, selftest_generator  # noqa: E402
from anchors_systems import (  # noqa: E402
    DEFAULT_SYSTEMS,
    EST_FIXED_S,
    EST_S_PER_GIB,
    SYSTEMS,
    Ctx,
    _dcp_shutdown,
    measure_system,
)
from anchors_util import gbps, grep_package, host_cleanup, median_or_none, rmtree  # noqa: E402


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
