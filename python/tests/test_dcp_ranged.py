"""Ranged reads: ``_shmckpt.read_rank_ranges`` and ``ShmckptReader`` reading only the
tensors of its load plan (CPU torch, gloo)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shmckpt import Tuning, _shmckpt, errors
from shmckpt.dcp import ShmckptReader, ShmckptWriter
import zygote

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "dcp_ranged_worker.py"


def test_a_2_rank_load_reads_only_the_tensors_of_its_plan(tmp_path):
    """Sharded tensors in each rank's file, replicated ones spread by DCP over both files:
    each rank reads every replicated tensor and its own shards, never the other rank's
    shards (768 KiB), byte-exact."""
    world = 2
    env = dict(os.environ, DCP_RUN="ranged", OMP_NUM_THREADS="1")
    procs = [
        zygote.spawn(
            [sys.executable, str(WORKER), str(r), str(world), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-6000:]}"
    res = [json.loads((tmp_path / f"result-ranged-{r}.json").read_text()) for r in range(world)]

    path = tmp_path / "ckpt" / "c"
    man = json.loads((path / "manifest.json").read_text())
    data = {f["file"]: f["bytes"] - f["data_start"] for f in man["files"]}
    total = sum(data.values())
    md = ShmckptReader(path).read_metadata()
    files = [f"rank-{k:05d}-of-{world:05d}.safetensors" for k in range(world)]
    # DCP spread the replicated tensors over both files; each file holds its rank's shards.
    rep = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn.startswith("rep.")}
    assert rep == set(files)
    shards = {f: 0 for f in files}
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith("sharded."):
            shards[info.relative_path] += info.length
    assert shards == {f: (256 + 512) << 10 for f in files}
    for r in range(world):
        # Every byte but the other rank's shards (a whole-file read would read `total`).
        need = total - sum(n for f, n in shards.items() if f != files[r])
        assert need == total - (768 << 10)
        b, d = res[r]["buffered"], res[r]["direct"]
        assert (b["checks"], b["files"], d["checks"], d["files"]) == (9, 2, 9, 2)
        # Buffered: exactly those bytes (the other shards are gaps wider than 128 KiB).
        assert b["io"]["bytes"] == need, (r, b["io"], need)
        # O_DIRECT (where the filesystem allows it): whole pages, at most two pages more
        # per read.
        assert need <= d["io"]["bytes"] <= need + 8192 * d["io"]["reads"], (r, d["io"], need)
        assert d["io"]["bytes"] < total


def saved(tmp_path):
    """A one-process DCP checkpoint of three float32 tensors; returns its path and each
    tensor's bytes by the name the rank file gives it."""
    p = tmp_path / "c"
    st = {
        "a": torch.arange(1000, dtype=torch.float32),
        "b": torch.arange(3000, dtype=torch.float32) * 2,
        "c": torch.arange(500, dtype=torch.float32) * 3,
    }
    dcp.save(st, storage_writer=ShmckptWriter(p, tuning=Tuning(chunk_size=1 << 20)))
    md = ShmckptReader(p).read_metadata()
    names = {idx.fqn: info.tensor for idx, info in md.storage_data.items()}
    return p, {names[k]: v.numpy().tobytes() for k, v in st.items()}, names


def test_read_rank_ranges_reads_the_requested_bytes_only(tmp_path):
    p, raw, names = saved(tmp_path)
    a, b, c = names["a"], names["b"], names["c"]
    part = np.zeros(40, dtype=np.uint8)
    file, _meta, tensors, stats = _shmckpt.read_rank_ranges(
        str(p), 0, [a], direct_io=False, gap=0, host=[(b, part.__dlpack__(), 400)]
    )
    assert file == "rank-00000-of-00001.safetensors"
    # One tuple per requested tensor, in file order; a's bytes in a buffer of its own, b
    # read whole (its CRC-32C) and 40 of its bytes copied out.
    by = {t[0]: t for t in tensors}
    assert sorted(by) == sorted([a, b])
    assert bytes(np.asarray(by[a][6])) == raw[a]
    assert by[b][6] is None and part.tobytes() == raw[b][400:440]
    assert (by[a][5], by[b][5]) == (4000, 12000)
    # c (between or after them) is never read: exactly a and b, in one or two reads.
    assert stats["bytes"] == 16000 and stats["tensors"] == 2 and stats["direct_io"] == 0


def test_read_rank_ranges_refuses_bad_requests(tmp_path):
    p, raw, names = saved(tmp_path)
    with pytest.raises(errors.DestinationError, match="nope"):
        _shmckpt.read_rank_ranges(str(p), 0, [names["a"], "nope"])
    buf = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        _shmckpt.read_rank_ranges(
            str(p), 0, [], host=[(names["a"], buf[:40].__dlpack__(), 0), (names["b"], buf[8:48].__dlpack__(), 0)]
        )
    with pytest.raises(errors.DestinationError, match="outside the tensor"):
        _shmckpt.read_rank_ranges(str(p), 0, [], host=[(names["c"], buf.__dlpack__(), 1990)])
    # An address is no destination.
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        _shmckpt.read_rank_ranges(str(p), 0, [], host=[(names["c"], int(buf.ctypes.data), 0)])
    assert not buf.any()


def test_a_damaged_tensor_fails_only_the_reads_that_ask_for_it(tmp_path):
    p, raw, names = saved(tmp_path)
    man = json.loads((p / "manifest.json").read_text())
    (f,) = man["files"]
    t = next(t for t in f["tensors"] if t["name"] == names["b"])
    path = p / f["file"]
    data = bytearray(path.read_bytes())
    data[f["data_start"] + t["data_offsets"][0] + 5] ^= 0x40
    path.write_bytes(bytes(data))
    _, _, tensors, _ = _shmckpt.read_rank_ranges(str(p), 0, [names["a"], names["c"]], gap=0)
    assert {x[0]: bytes(np.asarray(x[6])) for x in tensors} == {names["a"]: raw[names["a"]], names["c"]: raw[names["c"]]}
    with pytest.raises(errors.ChecksumError) as ei:
        _shmckpt.read_rank_ranges(str(p), 0, [names["a"], names["b"]])
    assert names["b"] in str(ei.value) and str(path) in str(ei.value)
    # Through DCP: the load fails naming b.
    dst = {"a": torch.zeros(1000), "b": torch.zeros(3000), "c": torch.zeros(500)}
    with pytest.raises((Exception, CheckpointException)) as ei:
        dcp.load(dst, storage_reader=ShmckptReader(p))
    failures = getattr(ei.value, "failures", None) or {0: ei.value}
    first = next(iter(failures.values()))
    c = first[0] if isinstance(first, tuple) else first
    assert isinstance(c, errors.ChecksumError) and names["b"] in str(c), repr(c)
