#!/usr/bin/env python3
"""CPU-side probe of the per-step slowdown hypotheses of issue 24 while a save drains.

Alternates, in the same process, ``--rounds`` rounds of two phases of equal length:
``idle`` (no save in flight) and ``drain`` (one non-blocking save of a host state of
``--mib`` MiB in flight: staged by the engine's copy threads, written by its io_uring
writers, committed). In each phase, three probes run at once:

* **GIL wake-up latency**: a Python thread sleeps 1 ms in a loop and records how late it
  wakes (the sleep's overshoot). A thread of the extension holding the GIL, or Python
  threads of the package taking it, shows as overshoots of the switch interval (5 ms).
* **Trainer-thread gaps**: the main thread runs a pure-Python loop of small work items,
  polling ``h.staged()`` and ``h.done()`` once per item as a training loop polls once per
  iteration, and records the gaps between consecutive items (the GIL, the handle's locks,
  or the OS taking the CPU away all show here).
* **Host memory bandwidth**: a second thread copies a 64 MiB numpy array repeatedly
  (``np.copyto`` releases the GIL) and records GB/s.

And the CPU time of every thread of the process by name (``/proc/self/task``; unnamed
threads, such as the engine's scoped copy threads, count under the process name, and the
io_uring writers' work is mostly the kernel's), so the threads' share of the CPU is known. Prints medians/p99/max per phase and
writes everything to ``--out/gil_probe.json``.

    python3 benches/train/gil_probe.py --dir /var/tmp/gilprobe --out $OUT --mib 2048
"""

import argparse
import json
import os
import shutil
import statistics
import threading
import time

import numpy as np


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q / 100.0 * len(xs)))]


def thread_cpu():
    """{thread name: CPU seconds} of this process (summed over threads of one name)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        name = s[s.index("(") + 1 : s.rindex(")")]
        fields = s[s.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def summarize(xs, scale=1e3):
    if not xs:
        return None
    return {"n": len(xs), "median": statistics.median(xs) * scale, "p99": pct(xs, 99) * scale, "max": max(xs) * scale}


def phase(seconds, handle_poll):
    """Run the three probes for `seconds`; returns their samples and per-thread CPU."""
    stop = threading.Event()
    wake, bw = [], []

    def sleeper():
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            wake.append(time.perf_counter() - t - 0.001)

    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)

    def copier():
        while not stop.is_set():
            t = time.perf_counter()
            np.copyto(dst, src)
            bw.append(src.nbytes / (time.perf_counter() - t) / 1e9)

    cpu0 = thread_cpu()
    ths = [threading.Thread(target=sleeper, name="probe-sleeper"), threading.Thread(target=copier, name="probe-copier")]
    for t in ths:
        t.start()
    gaps = []
    end = time.perf_counter() + seconds
    last = time.perf_counter()
    acc = 0
    while True:
        for i in range(200):  # ~tens of microseconds of Python work per item
            acc += i * i
        handle_poll()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if now >= end:
            break
    stop.set()
    for t in ths:
        t.join()
    cpu1 = thread_cpu()
    cpu = {k: round(cpu1[k] - cpu0.get(k, 0.0), 3) for k in cpu1 if cpu1[k] - cpu0.get(k, 0.0) > 0}
    return {"wake_overshoot_ms": summarize(wake), "item_gap_ms": summarize(gaps), "copy_gbps_median": statistics.median(bw) if bw else None, "thread_cpu_s": cpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/gilprobe")
    ap.add_argument("--out", default=os.environ.get("OUT", "./gilprobe-out"))
    ap.add_argument("--mib", type=int, default=512, help="host state size")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    import shmckpt

    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    n = 64
    state = {f"t{i}": np.random.default_rng(i).random((args.mib << 20) // n // 8) for i in range(n)}
    res = {"argv": vars(args), "switch_interval_s": __import__("sys").getswitchinterval(), "cpus": os.cpu_count(), "rounds": []}
    with shmckpt.Checkpointer(args.dir, keep_last=1, tuning=shmckpt.Tuning(staging_capacity=(args.mib + 64) << 20)) as ck:
        t = time.perf_counter()
        ck.save(0, state, blocking=False).wait()  # warm: arena filled, first file
        drain_s = time.perf_counter() - t
        res["first_save_s"] = drain_s
        step = 1
        for r in range(args.rounds):
            order = ("idle", "drain") if r % 2 == 0 else ("drain", "idle")
            for ph in order:
                if ph == "idle":
                    out = phase(max(drain_s, 0.3), lambda: None)
                else:
                    t = time.perf_counter()
                    h = ck.save(step, state, blocking=False)
                    step += 1

                    def poll():
                        h.staged()
                        h.done()

                    out = phase(max(drain_s, 0.3), poll)
                    rep = h.wait()
                    out["save_total_s"] = time.perf_counter() - t
                    out["report"] = {k: rep.get(k) for k in ("staging", "durable", "committed", "bytes")}
                    drain_s = out["save_total_s"]
                out.update(round=r, phase=ph)
                res["rounds"].append(out)
                print(json.dumps({k: out[k] for k in ("round", "phase", "wake_overshoot_ms", "item_gap_ms", "copy_gbps_median")}), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    agg = {}
    for ph in ("idle", "drain"):
        rs = [x for x in res["rounds"] if x["phase"] == ph]
        agg[ph] = {
            "wake_overshoot_ms_p99_median": statistics.median(x["wake_overshoot_ms"]["p99"] for x in rs),
            "wake_overshoot_ms_max": max(x["wake_overshoot_ms"]["max"] for x in rs),
            "item_gap_ms_median": statistics.median(x["item_gap_ms"]["median"] for x in rs),
            "item_gap_ms_p99_median": statistics.median(x["item_gap_ms"]["p99"] for x in rs),
            "item_gap_ms_max": max(x["item_gap_ms"]["max"] for x in rs),
            "copy_gbps_median": statistics.median(x["copy_gbps_median"] for x in rs),
        }
    res["summary"] = agg
    with open(os.path.join(args.out, "gil_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(agg, indent=1))
    print("thread CPU s in the drain phases:", json.dumps([x["thread_cpu_s"] for x in res["rounds"] if x["phase"] == "drain"]))


if __name__ == "__main__":
    main()
