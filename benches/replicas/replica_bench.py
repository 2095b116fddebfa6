"""Peer replicas (docs/replicas.md): time to k-safe and replication bandwidth against the
transport's own limit, and the restore of a lost machine's ranks from peers against the
transport limit and against a restore from local disk, all measured in the same run.

    python benches/replicas/replica_bench.py --world 2 --size-mib 64 --rounds 5 \
        --root /tmp/replica-bench [--bandwidth none] [--json out.json]
    python benches/replicas/replica_bench.py --size-mib 1024,4096,8192 --rounds 3 ...

``--size-mib`` takes one size or a comma-separated list: each size is a separate run (a new
world and root), printed as its own table, then a summary of the ratios of every size.

It starts ``--world`` ranks (this script, ``--role rank``) over gloo on 127.0.0.1, the
first half on simulated machine "m0", the second on "m1" (``Replicas(k=1, node=...)``:
partners i <-> i + world/2). Each rank holds ``--size-mib`` MiB of float32 tensors (pieces
of at most 256 MiB). After one warm-up replication (arena, files, connections), every
round does, in alternated order (even rounds A then B, odd rounds B then A):

  A  replication: ``save(step)`` (non-blocking), ``wait()`` (durable), ``wait_replicated()``
     (k-safe: every rank's image received straight into a replica arena in its partner's
     /dev/shm and sealed there: CRC-checked against the manifest). Reported: save to
     k-safe (the slowest rank), durable to k-safe, and the replication bandwidth: this
     rank's image bytes / its exchange's seconds (the report's ``transfer_seconds``; the
     slowest rank).
  B  the transport's limit: a plain ``isend``/``irecv`` of the same number of bytes between
     the same partners over the same gloo group (the replication group), posted at once,
     waited; seconds of the slowest rank.

then the restore rounds, again alternated (even rounds C then D, odd D then C), on the
last step saved:

  C  restore from peers: the ranks of machine m1 remove their file of the step (the lost
     machine) and ``load`` it (collective): the partner maps its replica read-only and
     checks it in place, sends it, the lost rank receives it into memory, checks it, writes
     it back as its file (fsync) and is served its tensors from that memory (source
     ``("peer", partner)``). Reported: the fetch (the collective part:
     ``last_fetch_seconds``) and the whole load (the slowest of the lost ranks), set against
     B's seconds.
  D  restore from local disk: every rank loads the step from its file (``load``; source
     "disk"; the slowest rank).

  E  (with ``--s3-server``) restore from S3: once the rounds above are done, every rank
     saves the same state once to an S3-protocol server (an ``s3s-fs`` binary started on
     127.0.0.1, serving a directory beside ``--root``; ``Checkpointer("s3://...")``, remote
     only, no local file), then in ``--rounds`` rounds the ranks of machine m1 load it from
     there (``load(step, source="remote")``: ranged GETs, every CRC-32C checked; the slowest
     of the lost ranks), set against B's seconds (the median of B over the run).

The checkpointer keeps nothing in memory (``keep_in_memory=False``), so D reads files; the
senders send from their saves' staging chunks where they are held (the output's last line
sums the reports' ``sent_from``: staging, copied from staging, the committed file); the
ranks share one root on local disk (``--root``, default a new temporary
directory) that keeps only the newest step by default (``--keep-last 1``: at 8 GiB per rank
the disk holds two steps at most, 32 GiB). Then every commit deletes the step before it
while the senders read their new files back: the runs of 2026-12-02 with ``keep_last=1``
had the exchange at 0.52-0.72 x the transport, the run before it (no deletion in its 4
steps) at 0.91-0.96 x; ``--keep-last 10`` (room permitting) runs without deletions.
``--bandwidth`` is ``replica_bandwidth`` (bytes/s, or ``none``: unbounded, the default
here, to set replication against the transport's limit; the library's default is 1 GiB/s).

Prints a table (medians with min-max over the rounds) and writes every sample as JSON
with ``--json``. Needs torch, numpy and shmckpt; CPU only (no GPU is used).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_state(rank: int, nbytes: int) -> Dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    piece = 256 << 20
    state: Dict[str, Any] = {}
    left, i = nbytes, 0
    while left > 0:
        n = min(piece, left) // 4
        state[f"t{i:03d}"] = torch.rand(n, generator=g)
        left -= n * 4
        i += 1
    return state


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shmckpt
    from shmckpt.replicas import list_replicas, remove_replica

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    me, world = a.rank, a.world
    half = world // 2
    bw = None if a.bandwidth == "none" else float(a.bandwidth)
    state = make_state(me, a.size_mib << 20)
    nbytes = sum(t.numel() * 4 for t in state.values())
    ck = shmckpt.Checkpointer(
        a.root,
        keep_in_memory=False,
        keep_last=a.keep_last,
        replicas=shmckpt.Replicas(k=1, node=f"m{me // half}", bandwidth=bw, timeout=600.0),
        tuning=shmckpt.Tuning(staging_capacity=nbytes + (64 << 20)),
    )
    rep = ck._replicator
    assert rep is not None
    group = rep.group
    partner = rep.plan[me][0]
    source = [q for q in range(world) if me in rep.plan[q]]

    def gather_max(x: float) -> float:
        out: List[Any] = [None] * world
        dist.all_gather_object(out, x, group=group)
        return max(float(v) for v in out)

    def gather_lost_max(x: float, lost: bool) -> float:
        out: List[Any] = [None] * world
        dist.all_gather_object(out, (x, lost), group=group)
        return max(float(v) for v, lo in out if lo)

    samples: Dict[str, List[float]] = {}
    # Where every rank's replicated bytes came from, summed over every replication (the
    # report's ``sent_from``: staging, copies of staging, the committed file).
    sent_from: Dict[str, int] = {"staging": 0, "copied": 0, "file": 0}

    def put(k: str, v: float) -> None:
        samples.setdefault(k, []).append(v)

    image = None  # the image size in bytes (the committed file), known after the first save

    def replicate(step: int) -> None:
        nonlocal image
        dist.barrier(group=group)
        t0 = time.monotonic()
        h = ck.save(step, state, blocking=False)
        h.wait()
        t1 = time.monotonic()
        r = h.wait_replicated()
        t2 = time.monotonic()
        assert r["k_safe"], r
        image = int(r["bytes_sent"])
        out: List[Any] = [None] * world
        dist.all_gather_object(out, r["sent_from"], group=group)
        for d in out:
            for k in sent_from:
                sent_from[k] += int(d[k])
        put("save_to_k_safe_s", gather_max(t2 - t0))
        put("durable_to_k_safe_s", gather_max(t2 - t1))
        put("replication_exchange_s", gather_max(float(r["transfer_seconds"])))
        # Each phase of the replication (the report's `phases`: seconds from the start
        # of the step's replication), as its own duration, the slowest rank's.
        prev = 0.0
        for name, at in r["phases"].items():
            put(f"phase_{name}_s", gather_max(float(at) - prev))
            prev = float(at)

    def transport() -> None:
        assert image is not None
        out = torch.zeros(image, dtype=torch.uint8)
        inn = {q: torch.empty(image, dtype=torch.uint8) for q in source}
        dist.barrier(group=group)
        t0 = time.monotonic()
        works = [dist.irecv(inn[q], src=q, group=group) for q in source]
        works.append(dist.isend(out, dst=partner, group=group))
        for w in works:
            w.wait()
        put("transport_s", gather_max(time.monotonic() - t0))

    step = 0
    for rnd in range(a.rounds + 1):  # round 0 warms up (arena, files, connections)
        step += 1
        order = (replicate, transport) if rnd % 2 == 0 else (transport, replicate)
        for f in order:
            if f is replicate:
                f(step)
            else:
                f()  # type: ignore[call-arg]
        if rnd == 0:
            samples.clear()

    last = step
    lost = me >= half
    entry = ck._rank_entry(last)[1]
    path = os.path.join(a.root, f"step-{last}", entry["file"])

    def from_peers() -> None:
        dist.barrier(group=group)
        if lost:
            os.unlink(path)
        dist.barrier(group=group)
        t0 = time.monotonic()
        got = ck.load(last)
        t2 = time.monotonic()
        fetch = rep.last_fetch_seconds
        assert fetch is not None
        src = ck.last_load_source
        if lost:
            assert src == ("peer", partner), src
        else:
            assert src is not None and src[0] == "disk", src
        assert all(torch.equal(got[k], v) for k, v in state.items())
        del got
        put("peer_fetch_s", gather_lost_max(fetch, lost))
        put("peer_restore_s", gather_lost_max(t2 - t0, lost))

    def from_disk() -> None:
        dist.barrier(group=group)
        t0 = time.monotonic()
        got = ck.load(last)
        t1 = time.monotonic()
        src = ck.last_load_source
        assert src is not None and src[0] == "disk", src
        assert all(torch.equal(got[k], v) for k, v in state.items())
        del got
        put("disk_restore_s", gather_lost_max(t1 - t0, lost))

    for rnd in range(a.rounds):  # no warm-up: the connections are up, the files written
        order = (from_peers, from_disk) if rnd % 2 == 0 else (from_disk, from_peers)
        for f in order:
            f()

    ck.close()
    if a.s3_url:
        # E: a restore of the lost ranks from S3 (remote only: no local file).
        s3 = shmckpt.Checkpointer(a.s3_url, keep_in_memory=False, tuning=shmckpt.Tuning(staging_capacity=nbytes + (64 << 20)))
        s3.save(1, state).wait_remote()
        for _ in range(a.rounds):
            dist.barrier(group=group)
            t0 = time.monotonic()
            got = s3.load(1, source="remote") if lost else None
            t1 = time.monotonic()
            if got is not None:
                src = s3.last_load_source
                assert src is not None and src[0] == "remote", src
                assert all(torch.equal(got[k], v) for k, v in state.items())
            del got
            put("s3_restore_s", gather_lost_max(t1 - t0, lost))
        s3.close()
    dist.barrier()
    tag = shmckpt._shmckpt.replica_tag(a.root)
    for r in list_replicas():
        if r["root_tag"] == tag and r["source_rank"] in source:
            remove_replica(r["name"])
    if me == 0:
        with open(a.out, "w") as f:
            json.dump({"image_bytes": image, "samples": samples, "sent_from": sent_from}, f)
    dist.destroy_process_group()


def med(xs: List[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def rate(n: int, xs: List[float]) -> str:
    rs = [n / x / (1 << 30) for x in xs]
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"


def ratio(num: List[float], den: List[float]) -> str:
    """Per round: limit seconds / measured seconds (1.0: at the limit)."""
    rs = [d / n for n, d in zip(num, den)]
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"


def run_size(a: argparse.Namespace, size_mib: int) -> Dict[str, Any]:
    """One world at ``size_mib`` MiB per rank: its samples (and its table printed)."""
    made = a.root is None
    root = a.root or tempfile.mkdtemp(prefix="replica-bench-")
    if os.path.isdir(root):
        shutil.rmtree(root)
    out = os.path.join(tempfile.mkdtemp(prefix="replica-bench-out-"), "r0.json")
    port = free_port()
    base = [sys.executable, os.path.abspath(__file__), "--role", "rank", "--world", str(a.world),
            "--size-mib", str(size_mib), "--rounds", str(a.rounds), "--root", root,
            "--bandwidth", a.bandwidth, "--port", str(port), "--out", out, "--keep-last", str(a.keep_last)]
    server = None
    env = dict(os.environ)
    if a.s3_server:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s3"))
        from s3_server import ACCESS, BUCKET, REGION, SECRET, Server

        s3_root = root.rstrip("/") + "-s3"
        server = Server(a.s3_server, s3_root, None)
        env.update(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION=REGION,
                   AWS_ENDPOINT_URL=server.url, AWS_ALLOW_HTTP="true", AWS_EC2_METADATA_DISABLED="true")
        base += ["--s3-url", f"s3://{BUCKET}/replica-bench-{size_mib}"]
    try:
        procs = [subprocess.Popen(base + ["--rank", str(r)], env=env) for r in range(a.world)]
        codes = [pr.wait() for pr in procs]
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(s3_root, ignore_errors=True)
    if any(codes):
        sys.exit(f"a rank failed at {size_mib} MiB: exit codes {codes}")
    with open(out) as f:
        res = json.load(f)
    shutil.rmtree(os.path.dirname(out))
    if made:
        shutil.rmtree(root)
    else:
        shutil.rmtree(root, ignore_errors=True)  # the next size's /dev/shm and disk
    n, s = int(res["image_bytes"]), res["samples"]
    print(f"world {a.world} (2 simulated machines, gloo on 127.0.0.1), image {n / (1 << 20):.1f} MiB per rank, "
          f"replica_bandwidth {a.bandwidth}, {a.rounds} rounds (alternated), median (min-max)")
    print("| measure | seconds | GiB/s per rank | x transport limit |")
    print("| --- | --- | --- | --- |")
    print(f"| transport limit: plain isend/irecv, same bytes, same group | {med(s['transport_s'])} | {rate(n, s['transport_s'])} | 1 |")
    print(f"| replication exchange | {med(s['replication_exchange_s'])} | {rate(n, s['replication_exchange_s'])} | "
          f"{ratio(s['replication_exchange_s'], s['transport_s'])} |")
    print(f"| durable to k-safe | {med(s['durable_to_k_safe_s'])} | {rate(n, s['durable_to_k_safe_s'])} | "
          f"{ratio(s['durable_to_k_safe_s'], s['transport_s'])} |")
    print(f"| save to k-safe | {med(s['save_to_k_safe_s'])} | | |")
    for k in [k for k in s if k.startswith("phase_")]:
        print(f"| replication phase: {k[6:-2]} (its own seconds, slowest rank) | {med(s[k])} | | |")
    print(f"| lost ranks: fetch from peers (checked, written back) | {med(s['peer_fetch_s'])} | {rate(n, s['peer_fetch_s'])} | "
          f"{ratio(s['peer_fetch_s'], s['transport_s'])} |")
    print(f"| lost ranks: restore from peers (load: fetch + tensors) | {med(s['peer_restore_s'])} | {rate(n, s['peer_restore_s'])} | "
          f"{ratio(s['peer_restore_s'], s['transport_s'])} |")
    print(f"| restore from local disk (load) | {med(s['disk_restore_s'])} | {rate(n, s['disk_restore_s'])} | "
          f"{ratio(s['disk_restore_s'], s['transport_s'])} |")
    if "s3_restore_s" in s:
        t = statistics.median(s["transport_s"])
        print(f"| lost ranks: restore from S3 (s3s-fs on 127.0.0.1; load, source remote) | {med(s['s3_restore_s'])} | "
              f"{rate(n, s['s3_restore_s'])} | {ratio(s['s3_restore_s'], [t] * len(s['s3_restore_s']))} (vs the median limit) |")
    sf = res.get("sent_from", {})
    print(f"replicated bytes sent from (every rank, every replication): staging {sf.get('staging', 0)}, "
          f"copied from staging {sf.get('copied', 0)}, the committed file {sf.get('file', 0)}")
    print(flush=True)
    return {"size_mib": size_mib, **res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (even: half on each simulated machine)")
    p.add_argument("--size-mib", default="64", help="MiB of tensors per rank; a comma-separated list runs each")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (replication: plus one warm-up)")
    p.add_argument("--root", default=None, help="checkpoint root (local disk; emptied first)")
    p.add_argument("--bandwidth", default="none", help="Replicas.bandwidth in bytes/s, or none")
    p.add_argument("--keep-last", type=int, default=1, help="the root's keep_last (1: every commit deletes the step before; see the docstring)")
    p.add_argument("--json", default=None, help="write every sample here")
    p.add_argument("--s3-server", default=None,
                   help="an s3s-fs binary: also time a restore of the lost ranks from S3 (phase E)")
    p.add_argument("--s3-url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--role", default="launch", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "rank":
        a.size_mib = int(a.size_mib)
        rank_main(a)
        return
    if a.world < 2 or a.world % 2:
        p.error("--world must be even and at least 2")
    try:
        sizes = [int(x) for x in str(a.size_mib).split(",") if x.strip()]
    except ValueError:
        p.error(f"--size-mib {a.size_mib!r}: integers separated by commas")
    if not sizes or any(x <= 0 for x in sizes):
        p.error("--size-mib: positive sizes")
    runs = [run_size(a, m) for m in sizes]
    print("summary: x the transport limit measured in the same run, median (min-max)")
    print("| MiB per rank | replication exchange | durable to k-safe | fetch from peers | restore from peers |")
    print("| --- | --- | --- | --- | --- |")
    for r in runs:
        s = r["samples"]
        t = s["transport_s"]
        print(f"| {r['size_mib']} | {ratio(s['replication_exchange_s'], t)} | {ratio(s['durable_to_k_safe_s'], t)} | "
              f"{ratio(s['peer_fetch_s'], t)} | {ratio(s['peer_restore_s'], t)} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
