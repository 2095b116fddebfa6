#!/usr/bin/env python3
"""Checkpoints to an S3-protocol server: shmckpt's remote tier against the server's raw
multipart PUT / ranged GET (the limit) and the peers, on one machine, same server, same
state, alternated rounds (issue 23, "Benchmarks"; docs/benchmarks.md "Checkpoints to S3").

The driver starts the server itself: ``--server PATH`` is an ``s3s-fs`` binary (the
``s3s-fs`` crate's ``binary`` feature: an S3 server on a directory; moto's server is too
slow for throughput, ~40-65 MiB/s) serving ``--dir``/server. ``--endpoint URL`` uses a
server already running instead (objects are then deleted with boto3).

Systems (``--systems``, default all; a system whose package is missing prints one
``SKIP name: reason`` line and the run goes on):

save (time from the call to committed in the bucket; GB/s = bytes of the state / time):
  shmckpt_local_remote  ``Checkpointer(local, remote=s3://...)``: ``save`` -> ``h.wait()``
                        -> ``h.wait_remote()`` (uploaded from the staging arena while the
                        local disk is written; completed and committed in the bucket after
                        the local commit); also its stall (``save`` return)
  shmckpt_remote_only   ``Checkpointer("s3://...")``: ``save`` -> ``h.wait_remote()``
  shmckpt_local         ``Checkpointer(local)`` (no bucket): stall and time to durable, the
                        reference for the stall with the remote tier on
  shmckpt_stall_uploading   the stall of a save issued while the previous save's upload
                        runs (``Checkpointer(local, remote=...)``; its time column is from
                        that save to both committed in the bucket; not a throughput row)
  raw_put               the limit: one multipart upload of the same bytes, same part size
                        and parts in flight, with object_store (``--raw-bin``: the
                        ``s3_raw`` example, ``cargo build --release --features s3 --example
                        s3_raw``); without it, boto3's low-level multipart (create/upload_part
                        from a thread pool/complete) from one in-memory buffer. With
                        ``--raw-bin`` the row also has ``complete``: the seconds of the
                        CompleteMultipartUpload request alone (``s3s-fs`` copies the whole
                        object there, on one thread: see raw_put_split)
  raw_put_split         the same bytes, parts and parts in flight, split into ``--concurrency``
                        objects uploaded at once (``s3_raw put ... OBJECTS``): the shape of
                        s3torch_dcp's output, whose ``thread_count`` files are separate
                        objects; needs ``--raw-bin``. On a server whose complete request
                        copies the object (``s3s-fs``, MinIO's FS mode, S3Proxy), this is
                        faster than raw_put by the server's copy, not by the client
  s3torch_dcp           ``dcp.save`` with s3torchconnector's ``S3StorageWriter``
                        (``thread_count`` = parts in flight; its public constructor takes no
                        endpoint: the writer's ``fs`` is replaced by an ``S3FileSystem`` over
                        ``S3Client(region, endpoint=...)`` with ``force_path_style``). DCP
                        writes one file per thread: ``--concurrency`` objects per rank
  s3torch_dcp_one       the same with ``thread_count=1``: one object per rank, as shmckpt and
                        raw_put write (the CRT client still uploads its parts in parallel)
  fsspec_dcp            ``dcp.save`` with DCP's ``FsspecWriter`` on ``s3://`` (s3fs)
  boto3_file            ``torch.save`` to a local file (fsync) then boto3 ``upload_file``
                        (``TransferConfig``: same part size and concurrency); timed from the
                        ``torch.save`` call

restore (time from the call to the tensors in memory, each system reading the object(s)
its save wrote in the same round):
  shmckpt_restore       ``Checkpointer(...).load(step, source="remote")`` (ranged GETs in
                        parallel, every CRC-32C checked)
  raw_get               the limit: parallel ranged GETs of the raw object into one buffer
                        (``s3_raw get``, or boto3 ``get_object(Range=...)`` from a pool)
  s3torch_dcp_load, fsspec_dcp_load   ``dcp.load`` with the peers' readers

Every round runs every system once, in an order rotated each round; objects no restore
reads are removed right after their save, the others after the round (not timed), so the
server's disk holds a few copies of the state at a time (8 GiB states on a 64 GiB disk).
``--sizes 1GiB:64:3,8GiB:64:1`` gives a size its own number of rounds; ``--budget-s S``
starts no round that would end past S seconds (estimated from the slowest round so far,
scaled by bytes; the table says which rounds were left out). The JSON and the tables are
written after every size, so a call stopped later keeps the sizes done. Results: medians with (min-max) over the rounds, and
each system's ratio to ``raw_put`` (save) or ``raw_get`` (restore) measured in the same
run. Output: a table on stdout and ``--out``/s3_bench.json with every sample.

    python3 benches/s3/s3_bench.py --server .dev/s3s/bin/s3s-fs --dir /var/tmp/s3b \\
        --raw-bin target/release/examples/s3_raw --sizes 1GiB:64,1GiB:1000 --rounds 5
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

from s3_server import ACCESS, BUCKET, REGION, SECRET, Server  # beside this file
SAVE_SYSTEMS = [
    "shmckpt_local_remote",
    "shmckpt_remote_only",
    "shmckpt_local",
    "shmckpt_stall_uploading",
    "raw_put",
    "raw_put_split",
    "s3torch_dcp",
    "s3torch_dcp_one",
    "fsspec_dcp",
    "boto3_file",
]
LOAD_SYSTEMS = ["shmckpt_restore", "raw_get", "s3torch_dcp_load", "fsspec_dcp_load"]
ALL = SAVE_SYSTEMS + LOAD_SYSTEMS


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())}] {msg}", flush=True)


def parse_size(s: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


class Skip(Exception):
    """A system that cannot run here (a package missing): reported, never fatal."""


# -- the state ------------------------------------------------------------------------------


def make_state(total: int, n: int, device: str) -> Dict[str, Any]:
    """``n`` fp32 tensors of ``total`` bytes in all (random values: nothing compresses)."""
    import torch

    per = max(1, total // n // 4)
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(n):
        t = torch.empty(per, dtype=torch.float32)
        t.uniform_(generator=g)
        state[f"layer{i:05d}.weight"] = t.to(device) if device != "cpu" else t
    return state


def state_bytes(state: Dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# -- systems ---------------------------------------------------------------------------------


class Ctx:
    def __init__(self, args: argparse.Namespace, server: Server, state: Dict[str, Any], label: str):
        self.args = args
        self.server = server
        self.state = state
        self.nbytes = state_bytes(state)
        self.label = label
        self.local = os.path.join(args.dir, "local", label)
        self.part = args.part_size
        self.conc = args.concurrency
        #: shmckpt's remote settings (``RemoteTier``'s): the same part size and concurrency
        #: as the others.
        self.shm_remote = dict(part_size=args.part_size, concurrency=args.concurrency)
        self.cks: Dict[str, Any] = {}
        self.step = 0
        #: What each save of a round left for the restores: system -> (url or key, step)
        self.saved: Dict[str, Any] = {}

    def prefix(self, system: str, rnd: int) -> str:
        return f"{self.label}/{system}/r{rnd}"

    def s3url(self, system: str, rnd: int) -> str:
        return f"s3://{BUCKET}/{self.prefix(system, rnd)}"


def _checkpointer(ctx: Ctx, kind: str) -> Any:
    """One Checkpointer per kind and size, opened once (as a trainer does) and reused."""
    import shmckpt

    ck = ctx.cks.get(kind)
    if ck is not None:
        return ck
    cap = ctx.nbytes + (64 << 20)
    root = os.path.join(ctx.local, kind)
    os.makedirs(root, exist_ok=True)
    url = f"s3://{BUCKET}/{ctx.label}/{kind}"
    tuning = shmckpt.Tuning(staging_capacity=cap)
    if kind == "shmckpt_local":
        ck = shmckpt.Checkpointer(root, keep_last=1, tuning=tuning)
    elif kind == "shmckpt_local_remote":
        tier = shmckpt.RemoteTier(url, keep_last=1, **ctx.shm_remote)
        ck = shmckpt.Checkpointer(root, keep_last=1, remote=tier, tuning=tuning)
    else:
        # Remote only: the root's own tier, with its settings.
        ck = shmckpt.Checkpointer(url, remote=shmckpt.RemoteTier(url, keep_last=1, **ctx.shm_remote), tuning=tuning)
    if ctx.args.device.startswith("cuda"):
        ck.prepare_cuda()
    ctx.cks[kind] = ck
    return ck


def run_shmckpt(ctx: Ctx, kind: str, rnd: int) -> Dict[str, float]:
    ck = _checkpointer(ctx, kind)
    ctx.step += 1
    step = ctx.step
    sync(ctx.args.device)
    t0 = time.perf_counter()
    h = ck.save(step, ctx.state)
    stall = time.perf_counter() - t0
    out: Dict[str, float] = {"stall": stall}
    if kind != "shmckpt_remote_only":
        h.wait()
        out["local_durable"] = time.perf_counter() - t0
    if kind == "shmckpt_local":
        out["seconds"] = out["local_durable"]
        return out
    rep = h.wait_remote()
    out["seconds"] = time.perf_counter() - t0
    out["upload"] = float(rep["upload"])
    if int(rep["bytes"]) < ctx.nbytes:
        raise RuntimeError(f"{kind}: uploaded {rep['bytes']} bytes, fewer than the state's {ctx.nbytes}")
    out["bytes"] = float(rep["bytes"])
    if kind == "shmckpt_remote_only":
        ctx.saved["shmckpt"] = (kind, step)
    return out


def run_stall_uploading(ctx: Ctx, rnd: int) -> Dict[str, float]:
    """The trainer's stall while the remote tier is busy: a save issued as soon as the
    previous one is durable on the local disk, i.e. while its upload is running (the
    ``stall`` of this row is that second ``save``'s return time)."""
    ck = _checkpointer(ctx, "shmckpt_local_remote")
    ctx.step += 2
    sync(ctx.args.device)
    h1 = ck.save(ctx.step - 1, ctx.state)
    h1.wait()
    t0 = time.perf_counter()
    h2 = ck.save(ctx.step, ctx.state)
    stall = time.perf_counter() - t0
    out = {"stall": stall}
    for name, h in (("first_committed_after", h1), ("second_committed_after", h2)):
        try:
            h.wait_remote()
        except Exception as e:  # RemoteSkipped: the documented backpressure policy
            if type(e).__name__ != "RemoteSkipped":
                raise
            name = name.replace("committed", "skipped")
        out[name] = time.perf_counter() - t0
    out["seconds"] = time.perf_counter() - t0
    return out


def _raw_bin(ctx: Ctx, op: str, key: str, objects: int = 1) -> Dict[str, float]:
    """``s3_raw``'s figures: ``seconds``, and for a put ``parts`` (until the last part was
    acknowledged) and ``complete`` (the CompleteMultipartUpload requests) when the binary
    reports them."""
    cmd = [ctx.args.raw_bin, op, f"s3://{BUCKET}/{key}", str(ctx.nbytes), str(ctx.part), str(ctx.conc)]
    if objects != 1:
        cmd.append(str(objects))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"s3_raw {op}: {r.stderr.strip()}")
    j = json.loads(r.stdout.strip().splitlines()[-1])
    out = {"seconds": float(j["seconds"])}
    if "complete_seconds" in j:
        out.update(parts=float(j["parts_seconds"]), complete=float(j["complete_seconds"]))
    return out


def _boto3(ctx: Ctx) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise Skip(f"boto3 is not installed ({e})")
    cfg = Config(
        max_pool_connections=max(ctx.conc, 10) * 2,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
    )
    return boto3.client("s3", endpoint_url=ctx.server.url, region_name=REGION, config=cfg)


#: The raw upload's parts (random bytes, made once per size, outside the timing: botocore
#: takes bytes, not memoryviews).
_RAW_PARTS: Dict[Tuple[int, int], List[bytes]] = {}


def run_raw_put(ctx: Ctx, rnd: int) -> Dict[str, float]:
    key = f"{ctx.prefix('raw', rnd)}/object"
    if ctx.args.raw_bin:
        out = _raw_bin(ctx, "put", key)
        ctx.saved["raw"] = key
        return out
    c = _boto3(ctx)
    chunks = _RAW_PARTS.get((ctx.nbytes, ctx.part))
    if chunks is None:
        _RAW_PARTS.clear()
        chunks = [os.urandom(min(ctx.part, ctx.nbytes - a)) for a in range(0, ctx.nbytes, ctx.part)]
        _RAW_PARTS[(ctx.nbytes, ctx.part)] = chunks
    t0 = time.perf_counter()
    up = c.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]

    def part(i: int) -> Dict[str, Any]:
        r = c.upload_part(Bucket=BUCKET, Key=key, UploadId=up, PartNumber=i + 1, Body=chunks[i])
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    with ThreadPoolExecutor(ctx.conc) as ex:
        parts = list(ex.map(part, range(len(chunks))))
    c.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up, MultipartUpload={"Parts": parts})
    secs = time.perf_counter() - t0
    ctx.saved["raw"] = key
    return {"seconds": secs}


def run_raw_put_split(ctx: Ctx, rnd: int) -> Dict[str, float]:
    if not ctx.args.raw_bin:
        raise Skip("needs --raw-bin (the s3_raw example)")
    return _raw_bin(ctx, "put", f"{ctx.prefix('raw_split', rnd)}/object", objects=ctx.conc)


def run_raw_get(ctx: Ctx, rnd: int) -> Dict[str, float]:
    key = ctx.saved.get("raw")
    if key is None:
        raise Skip("raw_put did not run in this round")
    if ctx.args.raw_bin:
        return _raw_bin(ctx, "get", key)
    c = _boto3(ctx)
    out = bytearray(ctx.nbytes)
    mv = memoryview(out)
    t0 = time.perf_counter()

    def get(i: int) -> None:
        a = i * ctx.part
        e = min(a + ctx.part, ctx.nbytes)
        body = c.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={a}-{e - 1}")["Body"].read()
        mv[a : a + len(body)] = body

    with ThreadPoolExecutor(ctx.conc) as ex:
        list(ex.map(get, range(-(-ctx.nbytes // ctx.part))))
    return {"seconds": time.perf_counter() - t0}


def run_shmckpt_restore(ctx: Ctx, rnd: int) -> Dict[str, float]:
    got = ctx.saved.get("shmckpt")
    if got is None:
        raise Skip("shmckpt_remote_only did not run in this round")
    kind, step = got
    ck = _checkpointer(ctx, kind)
    t0 = time.perf_counter()
    sd = ck.load(step, source="remote")
    secs = time.perf_counter() - t0
    if ck.last_load_source[0] != "remote" or len(sd) != len(ctx.state):
        raise RuntimeError(f"shmckpt_restore: loaded {len(sd)} tensors from {ck.last_load_source}")
    return {"seconds": secs}


def _s3torch(ctx: Ctx) -> Tuple[Any, Any, Any, Any]:
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
        from s3torchconnector.dcp.s3_file_system import S3FileSystem
    except ImportError as e:
        raise Skip(f"s3torchconnector is not installed ({e})")
    cfg = S3ClientConfig(force_path_style=True, part_size=ctx.part)

    def fs() -> Any:
        return S3FileSystem(REGION, s3_client=S3Client(REGION, endpoint=ctx.server.url, s3client_config=cfg))

    return S3StorageWriter, S3StorageReader, fs, cfg


def run_s3torch(ctx: Ctx, rnd: int, threads: Optional[int] = None) -> Dict[str, float]:
    """``dcp.save`` with ``S3StorageWriter``: ``threads`` files (objects) per rank, default
    ``--concurrency``; the restores read the default variant's step."""
    import torch.distributed.checkpoint as dcp

    W, _, fs, cfg = _s3torch(ctx)
    url = ctx.s3url("s3torch" if threads is None else f"s3torch_{threads}", rnd)
    sync(ctx.args.device)
    t0 = time.perf_counter()
    w = W(REGION, url, s3client_config=cfg, thread_count=threads or ctx.conc)
    w.fs = fs()
    w.path = w.fs.init_path(url)
    dcp.save(ctx.state, storage_writer=w)
    if threads is None:
        ctx.saved["s3torch"] = url
    return {"seconds": time.perf_counter() - t0}


def _zeros(ctx: Ctx) -> Dict[str, Any]:
    import torch

    return {k: torch.empty_like(v) for k, v in ctx.state.items()}


def run_s3torch_load(ctx: Ctx, rnd: int) -> Dict[str, float]:
    import torch.distributed.checkpoint as dcp

    _, R, fs, cfg = _s3torch(ctx)
    url = ctx.saved.get("s3torch")
    if url is None:
        raise Skip("s3torch_dcp did not run in this round")
    dest = _zeros(ctx)
    t0 = time.perf_counter()
    r = R(REGION, url, s3client_config=cfg)
    f = fs()
    f._reader_constructor = r.fs._reader_constructor
    r.fs = f
    r.path = f.init_path(url)
    dcp.load(dest, storage_reader=r)
    sync(ctx.args.device)
    return {"seconds": time.perf_counter() - t0}


def _fsspec_kwargs(ctx: Ctx) -> Dict[str, Any]:
    try:
        import s3fs  # noqa: F401
    except ImportError as e:
        raise Skip(f"s3fs is not installed ({e})")
    return dict(
        key=os.environ["AWS_ACCESS_KEY_ID"],
        secret=os.environ["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": ctx.server.url, "region_name": REGION},
    )


def _fsspec_dcp() -> Tuple[Any, Any]:
    """DCP's fsspec writer and reader. Where they live depends on torch's version:
    ``torch.distributed.checkpoint._fsspec_filesystem`` (the module since torch 2.2, still
    there in 2.15, the one DCP itself and torchtitan import), the public
    ``torch.distributed.checkpoint.fsspec_filesystem`` and top-level exports of some
    versions. Each is tried; when none imports, the SKIP line names every cause (an
    ImportError inside torch's module, e.g. of fsspec itself, shows there)."""
    causes = []
    for mod in (
        "torch.distributed.checkpoint._fsspec_filesystem",
        "torch.distributed.checkpoint.fsspec_filesystem",
        "torch.distributed.checkpoint",
    ):
        try:
            m = importlib.import_module(mod)
            return m.FsspecWriter, m.FsspecReader
        except (ImportError, AttributeError) as e:
            causes.append(f"{mod}: {type(e).__name__}: {e}")
    raise ImportError("; ".join(causes))


def run_fsspec(ctx: Ctx, rnd: int) -> Dict[str, float]:
    import torch.distributed.checkpoint as dcp
    FsspecWriter = _fsspec_dcp()[0]

    kw = _fsspec_kwargs(ctx)
    url = ctx.s3url("fsspec", rnd)
    sync(ctx.args.device)
    t0 = time.perf_counter()
    w = FsspecWriter(url, sync_files=False, thread_count=ctx.conc, **kw)
    dcp.save(ctx.state, storage_writer=w)
    ctx.saved["fsspec"] = url
    return {"seconds": time.perf_counter() - t0}


def run_fsspec_load(ctx: Ctx, rnd: int) -> Dict[str, float]:
    import torch.distributed.checkpoint as dcp
    FsspecReader = _fsspec_dcp()[1]

    kw = _fsspec_kwargs(ctx)
    url = ctx.saved.get("fsspec")
    if url is None:
        raise Skip("fsspec_dcp did not run in this round")
    dest = _zeros(ctx)
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=FsspecReader(url, **kw))
    sync(ctx.args.device)
    return {"seconds": time.perf_counter() - t0}


def run_boto3_file(ctx: Ctx, rnd: int) -> Dict[str, float]:
    import torch
    from boto3.s3.transfer import TransferConfig

    c = _boto3(ctx)
    path = os.path.join(ctx.local, "torch_save.pt")
    os.makedirs(ctx.local, exist_ok=True)
    sync(ctx.args.device)
    t0 = time.perf_counter()
    torch.save(ctx.state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    t1 = time.perf_counter()
    cfg = TransferConfig(multipart_threshold=ctx.part, multipart_chunksize=ctx.part, max_concurrency=ctx.conc)
    c.upload_file(path, BUCKET, f"{ctx.prefix('boto3', rnd)}/state.pt", Config=cfg)
    t2 = time.perf_counter()
    os.unlink(path)
    return {"seconds": t2 - t0, "torch_save": t1 - t0, "upload": t2 - t1}


RUNNERS: Dict[str, Callable[[Ctx, int], Dict[str, float]]] = {
    "shmckpt_local_remote": lambda c, r: run_shmckpt(c, "shmckpt_local_remote", r),
    "shmckpt_remote_only": lambda c, r: run_shmckpt(c, "shmckpt_remote_only", r),
    "shmckpt_local": lambda c, r: run_shmckpt(c, "shmckpt_local", r),
    "shmckpt_stall_uploading": run_stall_uploading,
    "raw_put": run_raw_put,
    "raw_put_split": run_raw_put_split,
    "s3torch_dcp": run_s3torch,
    "s3torch_dcp_one": lambda c, r: run_s3torch(c, r, threads=1),
    "fsspec_dcp": run_fsspec,
    "boto3_file": run_boto3_file,
    "shmckpt_restore": run_shmckpt_restore,
    "raw_get": run_raw_get,
    "s3torch_dcp_load": run_s3torch_load,
    "fsspec_dcp_load": run_fsspec_load,
}


# -- the run ---------------------------------------------------------------------------------

#: Save systems whose objects no restore reads: cleared right after the save (untimed).
UNREAD_PREFIX = {"raw_put_split": "raw_split", "s3torch_dcp_one": "s3torch_1", "boto3_file": "boto3"}


def med(xs: List[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def report(label: str, nbytes: int, samples: Dict[str, List[Dict[str, float]]], skipped: Dict[str, str]) -> List[str]:
    lines = [f"### {label}: {nbytes / 1e9:.3f} GB", ""]
    lines.append(
        "| system | s to committed / loaded, median (min-max) | GB/s median | × limit | stall s (save returns)"
        " | of which CompleteMultipartUpload s |"
    )
    lines.append("|---|---|---|---|---|---|")

    def gbps(s: Dict[str, float]) -> float:
        return nbytes / s["seconds"] / 1e9

    limits = {
        "save": statistics.median([gbps(s) for s in samples.get("raw_put", [])]) if samples.get("raw_put") else None,
        "load": statistics.median([gbps(s) for s in samples.get("raw_get", [])]) if samples.get("raw_get") else None,
    }
    for name in ALL:
        if name in skipped:
            lines.append(f"| {name} | SKIP: {skipped[name]} | | | | |")
            continue
        ss = samples.get(name)
        if not ss:
            continue
        g = statistics.median([gbps(s) for s in ss])
        lim = limits["load" if name in LOAD_SYSTEMS else "save"]
        ratio = f"{g / lim:.2f}" if lim and name not in ("shmckpt_local", "shmckpt_stall_uploading") else "-"
        stall = med([s["stall"] for s in ss if "stall" in s])
        rate = "-" if name == "shmckpt_stall_uploading" else f"{g:.3f}"
        complete = med([s["complete"] for s in ss if "complete" in s])
        lines.append(f"| {name} | {med([s['seconds'] for s in ss])} | {rate} | {ratio} | {stall} | {complete} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--server", help="an s3s-fs binary: the driver starts it on --dir/server")
    src.add_argument("--endpoint", help="an S3 endpoint already running (credentials from the environment)")
    ap.add_argument("--dir", required=True, help="working directory: the server's data, local checkpoint roots")
    ap.add_argument("--sizes", default="1GiB:64,1GiB:1000",
                    help="comma-separated BYTES:TENSORS[:ROUNDS] (e.g. 8GiB:64:1; ROUNDS overrides --rounds)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop starting rounds that would end later than this many seconds after the start "
                         "(estimated from the slowest round so far, scaled by bytes); 0: no budget")
    ap.add_argument("--systems", default=",".join(ALL))
    ap.add_argument("--raw-bin", help="the s3_raw example binary (object_store); without it raw_put/raw_get use boto3")
    ap.add_argument("--part-size", default="16MiB", help="part size of the raw and peer uploads (shmckpt's default)")
    ap.add_argument("--concurrency", type=int, default=8, help="parts in flight (shmckpt's default)")
    ap.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    ap.add_argument("--out", help="directory for s3_bench.json (default --dir)")
    args = ap.parse_args()
    args.part_size = parse_size(args.part_size)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in RUNNERS]
    if bad:
        sys.exit(f"s3_bench: unknown systems {bad}; known: {ALL}")
    os.makedirs(args.dir, exist_ok=True)
    out_dir = args.out or args.dir
    os.makedirs(out_dir, exist_ok=True)

    server = Server(args.server, os.path.join(args.dir, "server"), args.endpoint)
    if args.server:
        os.environ.update(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    os.environ.update(AWS_REGION=REGION, AWS_ENDPOINT_URL=server.url, AWS_ALLOW_HTTP="true")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    log(f"server {server.url} ({'s3s-fs ' + args.server if args.server else 'external'}), dir {args.dir}")
    import torch

    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cpus, device {args.device}")
    raw = f"object_store ({args.raw_bin})" if args.raw_bin else "boto3 low-level multipart, thread pool"
    log(f"the limit (raw_put/raw_get): {raw}; {args.part_size} B parts, {args.concurrency} in flight")
    results: Dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "raw": raw, "sizes": {}}
    tables: List[str] = []
    t_start = time.perf_counter()
    #: Slowest round so far, in seconds per byte of state (for --budget-s).
    worst_rate = 0.0

    def write_results() -> None:
        with open(os.path.join(out_dir, "s3_bench.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(out_dir, "s3_bench.md"), "w") as f:
            f.write("\n".join(tables))

    try:
        for spec in args.sizes.split(","):
            size_s, _, rest = spec.partition(":")
            n_s, _, rounds_s = rest.partition(":")
            total, n = parse_size(size_s), int(n_s or 64)
            rounds = int(rounds_s) if rounds_s else args.rounds
            label = f"s{total >> 20}m-n{n}-{uuid.uuid4().hex[:6]}"
            state = make_state(total, n, args.device)
            ctx = Ctx(args, server, state, label)
            log(f"== {spec}: {ctx.nbytes} bytes in {n} tensors, {rounds} rounds ({label})")
            samples: Dict[str, List[Dict[str, float]]] = {}
            skipped: Dict[str, str] = {}
            saves = [s for s in systems if s in SAVE_SYSTEMS]
            loads = [s for s in systems if s in LOAD_SYSTEMS]
            for rnd in range(rounds):
                if args.budget_s > 0 and worst_rate > 0:
                    spent = time.perf_counter() - t_start
                    need = worst_rate * ctx.nbytes
                    if spent + need > args.budget_s:
                        note = (f"budget: round {rnd} not started ({spent:.0f} s spent, ~{need:.0f} s more "
                                f"needed, --budget-s {args.budget_s:.0f})")
                        log(f"{spec}: {note}")
                        skipped.setdefault("_budget", note)
                        break
                t_round = time.perf_counter()
                k = rnd % max(1, len(saves))
                order = saves[k:] + saves[:k]
                k = rnd % max(1, len(loads))
                order += loads[k:] + loads[:k]
                ctx.saved = {}
                for name in order:
                    if name in skipped:
                        continue
                    try:
                        r = RUNNERS[name](ctx, rnd)
                    except Skip as e:
                        if "did not run" not in str(e):
                            skipped[name] = str(e)
                            print(f"SKIP {name}: {e}", flush=True)
                        continue
                    except Exception as e:  # a peer failing is reported, the run goes on
                        skipped[name] = f"failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
                        print(f"SKIP {name}: failed:\n{traceback.format_exc()}", flush=True)
                        continue
                    finally:
                        # Objects no restore of this round reads go at once (untimed): the
                        # server's disk holds a few copies of the state, not one per system
                        # (8 GiB states on a 64 GiB disk).
                        if name in UNREAD_PREFIX:
                            server.clear(ctx.prefix(UNREAD_PREFIX[name], rnd))
                    samples.setdefault(name, []).append(r)
                    log(f"round {rnd} {name}: {r['seconds']:.3f} s, {ctx.nbytes / r['seconds'] / 1e9:.3f} GB/s"
                        + "".join(f", {k} {v:.3f}" for k, v in r.items() if k not in ("seconds", "bytes")))
                for sysname in ("raw", "raw_split", "s3torch", "s3torch_1", "fsspec", "boto3"):
                    server.clear(ctx.prefix(sysname, rnd))
                worst_rate = max(worst_rate, (time.perf_counter() - t_round) / ctx.nbytes)
            for ck in ctx.cks.values():
                ck.close()
            server.clear(label)
            shutil.rmtree(ctx.local, ignore_errors=True)
            budget_note = skipped.pop("_budget", None)
            t = report(f"{spec} ({n} tensors, {args.device})", ctx.nbytes, samples, skipped)
            if budget_note:
                t.append(f"\n{budget_note}")
            tables += t + [""]
            print("\n".join(t), flush=True)
            results["sizes"][spec] = {"bytes": ctx.nbytes, "tensors": n, "rounds": rounds, "samples": samples,
                                      "skipped": skipped, "budget": budget_note}
            # Written after every size: a call stopped later still leaves these.
            write_results()
            del state, ctx
    finally:
        server.stop()
    write_results()
    log(f"wrote {out_dir}/s3_bench.json and s3_bench.md")


if __name__ == "__main__":
    main()
