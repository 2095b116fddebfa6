#!/usr/bin/env python3
"""O_DIRECT read patterns of one file, alternated: which request size and depth reads a
disk fastest (the device loader's choice). Depth N = N threads each issuing one pread at a
time on its own stripe of requests (what N requests in flight give the device).

    python3 benches/disk/read_sweep.py --dir /var/tmp/sweep --gib 4 --rounds 2
"""
import argparse, json, mmap, os, statistics, threading, time

MiB = 1 << 20


def write_file(path, size):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    buf = mmap.mmap(-1, 64 * MiB)
    buf.write(os.urandom(MiB) * 64)
    try:
        off = 0
        while off < size:
            off += os.pwritev(fd, [buf], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_pattern(path, size, req, depth):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    n = size // req
    nxt = [0]
    lock = threading.Lock()

    def worker():
        buf = mmap.mmap(-1, req)
        while True:
            with lock:
                k = nxt[0]
                nxt[0] += 1
            if k >= n:
                return
            os.preadv(fd, [buf], k * req)

    t = time.perf_counter()
    ths = [threading.Thread(target=worker) for _ in range(depth)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    dt = time.perf_counter() - t
    os.close(fd)
    return dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--patterns", default="16:1,4:16,16:4,32:2,64:1,64:2,8:8")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "sweep.bin")
    size = int(a.gib * (1 << 30)) // (64 * MiB) * (64 * MiB)
    write_file(path, size)
    pats = [tuple(int(x) for x in p.split(":")) for p in a.patterns.split(",")]
    res = {p: [] for p in pats}
    for r in range(a.rounds):
        for p in (pats if r % 2 == 0 else pats[::-1]):
            dt = read_pattern(path, size, p[0] * MiB, p[1])
            res[p].append(dt)
            print(f"round {r} {p[0]:>3} MiB x {p[1]:>2} in flight: {dt:.3f} s  {size / dt / 1e9:.2f} GB/s", flush=True)
    os.remove(path)
    print("medians:")
    out = []
    for p, v in sorted(res.items(), key=lambda kv: statistics.median(kv[1])):
        m = statistics.median(v)
        print(f"  {p[0]:>3} MiB x {p[1]:>2}: {m:.3f} s  {size / m / 1e9:.2f} GB/s  runs {['%.3f' % x for x in v]}")
        out.append({"req_mib": p[0], "depth": p[1], "median_s": m, "runs_s": v, "bytes": size})
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
