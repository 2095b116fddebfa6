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
import datetime
import gc
import math
import os
import platform
import shutil
import sys
import traceback

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
    log,
    now,
    pkg_version,
    raise_nofile,
    set_log_file,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the train_*.py modules beside this file
from train_measure import MemSampler, d2h_ref, gpu_snapshot, raw_write  # noqa: E402
from train_model import COLOCATED_ORDER, GiB, MiB, SIZES, SYSTEMS, Trainer, med, state_nbytes  # noqa: E402
from train_report import plot, write_outputs  # noqa: E402
from train_run import Ctx, colocated_trial, measure_free, run_segment  # noqa: E402

# The code is split by responsibility (pure moves out of one file):
#   train_model.py    constants, statistics helpers, model, optimizer, Trainer
#   train_measure.py  host memory sampling, device memory snapshots, raw disk limit, D2H reference
#   train_systems.py  the systems under test (System classes) and SYSTEM_CLASSES
#   train_run.py      run context (Ctx), one timed segment (run_segment), the colocated case
#   train_report.py   summary, results.md, results.json/iters.csv, plot
#   train.py          command line and the driver (main); the entry point


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
