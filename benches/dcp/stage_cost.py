#!/usr/bin/env python3
"""Per-tensor cost of ``ShmckptWriter.stage()`` on the trainer's thread.

Stages a state of many tiny CPU tensors (so the copies cost nothing and the Python work
per tensor shows) 21 times and prints the median of the last 20, in ms. For an A/B, run
it with ``PYTHONPATH`` on two copies of the installed package that differ in ``dcp.py``,
alternating: ``PYTHONPATH=/tmp/ab/old python benches/dcp/stage_cost.py old``.
"""

import os
import shutil
import statistics
import sys
import time
import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402

import shmckpt  # noqa: E402
from shmckpt.dcp import ShmckptWriter, release  # noqa: E402


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1300
    root = f"/var/tmp/shmckpt-stage-cost-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    state = {f"layer{i}.w": torch.randn(16, 16) for i in range(n)}
    times = []
    try:
        for i in range(21):
            w = ShmckptWriter(f"{root}/s{i}", tuning=shmckpt.Tuning(staging_capacity=64 << 20))
            t = time.perf_counter()
            w.stage(state)
            times.append(time.perf_counter() - t)
            w._staged[0].handle.wait()  # durable before the next (one arena)
    finally:
        release()
        shutil.rmtree(root, ignore_errors=True)
    print(label, f"{statistics.median(times[1:]) * 1e3:.1f} ms for {n} tensors", shmckpt.__file__)


if __name__ == "__main__":
    main()
