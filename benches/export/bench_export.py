"""Export speed against the disk's own copy speed of the same bytes (docs/benchmarks.md).

    python benches/export/bench_export.py DIR [--size-mib 1024] [--tensors 64] [--rounds 7]

Saves one checkpoint of SIZE MiB of F32 tensors under DIR (one rank), then alternates, for
ROUNDS rounds: `shmckpt.export` of the whole model; `dd` of the rank file with O_DIRECT
reads of 16 MiB and `conv=fsync` (a raw read + write of the same bytes); `cp` + `sync` of
the rank file. Each output is removed before the next run. Prints the medians, min-max and
the ratios copy-time / export-time (>= 1: the export is as fast as the copy).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time

import torch

import shmckpt


def timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    root = os.path.join(a.dir, "ck")
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    per = (a.size_mib << 20) // a.tensors // 4
    state = {"model": {f"layers.{i}.weight": torch.randn(per) for i in range(a.tensors)}}
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=(a.size_mib + 64) << 20)) as ck:
        ck.save(1, state).wait()
    del state
    step = os.path.join(root, "step-1")
    manifest = json.load(open(os.path.join(step, "manifest.json")))
    rank_file = os.path.join(step, manifest["files"][0]["file"])
    nbytes = os.path.getsize(rank_file)
    out = os.path.join(a.dir, "out")
    runs = {"export": [], "dd_direct": [], "cp_sync": []}

    def export():
        shmckpt.export(root, out)

    def dd():
        subprocess.run(
            ["dd", f"if={rank_file}", f"of={out}", "bs=16M", "iflag=direct", "conv=fsync", "status=none"], check=True
        )

    def cp():
        subprocess.run(["cp", rank_file, out], check=True)
        subprocess.run(["sync", out], check=True)

    for _ in range(a.rounds):
        for name, f in (("export", export), ("dd_direct", dd), ("cp_sync", cp)):
            runs[name].append(timed(f))
            if os.path.isdir(out):
                shutil.rmtree(out)
            else:
                os.unlink(out)
    res = {"bytes": nbytes, "rounds": a.rounds}
    for k, v in runs.items():
        res[k] = {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "GBps": nbytes / statistics.median(v) / 1e9}
    # Per round (alternated runs of the same round), the copy's time over the export's.
    res["ratio_dd_over_export"] = statistics.median(d / e for d, e in zip(runs["dd_direct"], runs["export"]))
    res["ratio_cp_over_export"] = statistics.median(c / e for c, e in zip(runs["cp_sync"], runs["export"]))
    res["ratio_dd_range"] = [min(d / e for d, e in zip(runs["dd_direct"], runs["export"])), max(d / e for d, e in zip(runs["dd_direct"], runs["export"]))]
    res["ratio_cp_range"] = [min(c / e for c, e in zip(runs["cp_sync"], runs["export"])), max(c / e for c, e in zip(runs["cp_sync"], runs["export"]))]
    print(json.dumps(res, indent=1))
    shutil.rmtree(a.dir)


if __name__ == "__main__":
    main()
