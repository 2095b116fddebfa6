"""shmckpt.dcp: PyTorch Distributed Checkpoint through shmckpt (CPU torch, gloo).

Multi-process tests spawn real ranks (tests/dcp_worker.py), check every exit status and
read what each rank verified; single-process tests cover errors and bad input."""

import json
import os
import pathlib
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torch.distributed.checkpoint.api import CheckpointException

from shmckpt import Tuning, errors
from shmckpt.dcp import ShmckptReader, ShmckptStorageInfo, ShmckptWriter, release

from conftest import descriptors_under
from ranks_support import run_ranks

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "dcp_worker.py"
CHUNK = 1 << 20
#: DCP wraps each rank's exception in CheckpointException (a BaseException).
FAIL = (Exception, CheckpointException)


def spawn(scenario, world, workdir, *args, timeout=240, run="0"):
    """Run `world` ranks of `scenario`; every one must exit 0. Returns their results."""
    env = dict(os.environ)
    env["DCP_RUN"] = f"{scenario}-{run}"
    # The workers import the installed package, like the test process (never the source
    # tree's python/shmckpt, which has no compiled extension).
    run_ranks(WORKER, scenario, world, workdir, *args, env=env, timeout=timeout)
    res = []
    for r in range(world):
        with open(os.path.join(workdir, f"result-{scenario}-{r}.json")) as f:
            res.append(json.load(f))
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_save_async_save_load_roundtrip(tmp_path, world):
    res = spawn("roundtrip", world, tmp_path)
    for r in res:
        # 4 DTensors + 6 plain tensors + step, sched, counter n, counter hist
        assert r["checks"] == {"sync": 14, "async": 14, "interchange": 4, "hf": 4, "sync_single_copies": 6, "async_single_copies": 6}
    files = res[0]["files"]
    assert files == [".metadata", "manifest.json"] + [f"rank-{k:05d}-of-{world:05d}.safetensors" for k in range(world)]
    ck = tmp_path / "ckpt"
    # Nothing else is left next to the checkpoints but the (empty) spool.
    assert sorted(os.listdir(ck)) == [".shmckpt-dcp", "async", "sync"]
    spool = ck / ".shmckpt-dcp"
    assert sorted(os.listdir(spool)) == [f"rank-{k:05d}" for k in range(world)]
    for k in range(world):
        (root,) = os.listdir(spool / f"rank-{k:05d}")  # one engine root per rank process
        assert os.listdir(spool / f"rank-{k:05d}" / root) == [f".shmckpt-rank-{k}.lock"]
    # .metadata points every item at (file, offset, length, CRC) that the manifest confirms.
    man = json.loads((ck / "sync" / "manifest.json").read_text())
    md = ShmckptReader(ck / "sync").read_metadata()
    by = {(f["file"], t["name"]): (f["data_start"] + t["data_offsets"][0], t) for f in man["files"] for t in f["tensors"]}
    assert len(md.storage_data) >= 14
    for idx, info in md.storage_data.items():
        assert isinstance(info, ShmckptStorageInfo)
        off, t = by[(info.relative_path, info.tensor)]
        assert (info.offset, info.length, info.crc32c) == (off, t["data_offsets"][1] - t["data_offsets"][0], t["crc32c"])
        raw = (ck / "sync" / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert len(raw) == info.length


def test_saved_on_4_ranks_loads_on_2(tmp_path):
    """DTensor Shard(0) state, and a real FSDP2 model (fully_shard on a CPU mesh) with
    AdamW after two steps, saved with async_save on 4 ranks, loaded on 2: the DTensors
    resharded and as whole tensors; the FSDP2 model and optimizer fresh on 2 ranks through
    get_state_dict / set_state_dict, every full tensor byte-exact."""
    saved = spawn("reshard_save", 4, tmp_path)
    # Uneven Shard(0): 10 rows over 4 ranks.
    assert [s["local_rows"]["model.layers.0.w"] for s in saved] == [3, 3, 3, 1]
    # 3 modules with weight + bias (6 parameters), 3 AdamW tensors each (step, exp_avg, exp_avg_sq)
    n = 6 + 6 * 3
    assert [s["fsdp2_tensors"] for s in saved] == [n] * 4
    loaded = spawn("reshard_load", 2, tmp_path)
    for r in loaded:
        assert r == {"checks": 14, "full": 4, "fsdp2_checked": n}


def test_dcp_plan_caching_reuses_the_writers_global_plan(tmp_path):
    """Three async_saves on 2 ranks with DCP's plan caching: the later ones reuse the
    cached plans (DCP logs each hit); every one loads byte-exact (14 checks each)."""
    res = spawn("plan_cache", 2, tmp_path, "3")
    assert res == [{"checks": 3 * 14, "saves": 3, "cached_plans_used": 2}] * 2


def test_a_checkpoint_loads_whatever_its_directory_is_called(tmp_path):
    """Issue 21 item 8: a directory named step-100 made the reader compare the manifest's
    step (the writer's private number) with the name, and fail."""
    res = spawn("dirnames", 2, tmp_path, timeout=200)
    names = ["step-100", "checkpoint-500", "global_step1000", "epoch=3-step=900", "plain"]
    assert res == [{"checks": {n: 14 for n in names}}] * 2
    # The commit (Rust's assemble_ranks) records the step a step-N directory is named by,
    # so the engine's own tools (Manifest::read: `shmckpt verify DIR`) accept it too.
    man = json.loads((tmp_path / "ckpt" / "step-100" / "manifest.json").read_text())
    assert (man["step"], man["world_size"], man["metadata"]) == (100, 2, {"shmckpt_dcp.format": "1"})


def test_a_load_that_fails_on_one_rank_raises_on_every_rank_promptly(tmp_path):
    """A corrupted rank file read by one rank only, then a .metadata read that fails once
    on one rank: every rank raises within seconds (a hang is killed by the worker's
    faulthandler and the subprocess timeout, failing the test), and the group still loads
    a good checkpoint afterwards."""
    env_timeout = os.environ.get("DCP_WORKER_TIMEOUT")
    os.environ["DCP_WORKER_TIMEOUT"] = "90"
    try:
        res = spawn("failed_load", 2, tmp_path, timeout=120)
    finally:
        if env_timeout is None:
            del os.environ["DCP_WORKER_TIMEOUT"]
        else:
            os.environ["DCP_WORKER_TIMEOUT"] = env_timeout
    for r in res:
        c = r["corrupt"]
        assert (c["raised"], c["failures"]) == ("CheckpointException", {"1": "ChecksumError"}), c
        f = r["flaky_metadata"]
        # DCP reports the failed read as an AssertionError ("metadata is None; global
        # metadata read failed: ...") of rank 0, and is not asked to read it again.
        assert (f["raised"], f["failures"]) == ("CheckpointException", {"0": "AssertionError"}), f
        assert c["secs"] < 30 and f["secs"] < 30, r
        assert r["after"]["raised"] is None and r["after_checked"] == 4, r
    assert [r["metadata_reads"] for r in res] == [1, 1]


def test_100_saves_keep_host_memory_flat(tmp_path):
    res = spawn("flat", 2, tmp_path, "100", timeout=300)
    for r in res:
        s = r["samples"]
        assert len(s) == 100
        # One arena per rank, its size fixed after the first save.
        assert {x["segs"] for x in s} == {1}
        assert len({x["shm"] for x in s}) == 1 and s[0]["shm"] >= 2 << 20
        # RSS after warm-up: no growth per save (a leaked staging copy would be 2 MiB each).
        grow = s[-1]["rss"] - s[9]["rss"]
        assert grow < 24 << 20, f"RSS grew {grow} bytes over 90 saves: {[x['rss'] for x in s[::10]]}"
        assert s[-1]["fds"] <= s[9]["fds"] + 2, [x["fds"] for x in s[::10]]


# -- single process -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    release()


def state():
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "meta": {"epoch": 3, "tag": "x"},
    }


def zeros():
    return {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "meta": {"epoch": 0, "tag": ""}}


def cause(e):
    """The first rank's original exception inside DCP's CheckpointException."""
    failures = getattr(e, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


def save(path, **kw):
    dcp.save(state(), storage_writer=ShmckptWriter(path, tuning=Tuning(chunk_size=CHUNK), **kw))


def test_single_process_roundtrip_and_layout(tmp_path):
    p = tmp_path / "c"
    save(p)
    dst = zeros()
    dcp.load(dst, storage_reader=ShmckptReader(p))
    src = state()
    assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["b"], src["b"])
    assert dst["meta"] == {"epoch": 3, "tag": "x"}
    assert sorted(os.listdir(p)) == [".metadata", "manifest.json", "rank-00000-of-00001.safetensors"]
    assert ShmckptReader.validate_checkpoint_id(p) and not ShmckptReader.validate_checkpoint_id(tmp_path)


def test_a_finished_save_keeps_no_descriptor_of_its_files(tmp_path):
    # Deleting a checkpoint must free it in the deleting thread, never in the next save's
    # staging (the engine once held its last file open until the next save).
    for i in range(3):
        p = tmp_path / f"c{i}"
        save(p)
        assert descriptors_under(tmp_path) == []
        dst = zeros()
        dcp.load(dst, storage_reader=ShmckptReader(p))
        assert torch.equal(dst["w"], state()["w"])
        shutil.rmtree(p)
        assert descriptors_under(tmp_path) == []


def test_existing_target_is_refused_before_writing(tmp_path):
    p = tmp_path / "c"
    p.mkdir()
    (p / "x").write_bytes(b"1")
    with pytest.raises(FAIL) as ei:
        save(p)
    assert isinstance(cause(ei.value), FileExistsError)
    assert "exists and is not empty" in str(cause(ei.value))
    assert sorted(os.listdir(p)) == ["x"]
    # An empty directory is fine (the rename replaces it).
    q = tmp_path / "empty"
    q.mkdir()
    save(q)
    assert (q / ".metadata").is_file()


def _spool_leftovers(tmp_path):
    spool = tmp_path / ".shmckpt-dcp"
    return sorted(n for n in os.listdir(spool) if not n.startswith("rank-")) if spool.exists() else []


def test_a_second_save_into_one_directory_replaces_it(tmp_path):
    """DCP's FileSystemWriter overwrites by default; so does ShmckptWriter: the second
    save's exact values load back, nothing of the first is left (issue 39, item 3)."""
    p = tmp_path / "c"
    save(p)
    second = {"w": state()["w"] * 3 + 1, "b": state()["b"] - 2, "meta": {"epoch": 4, "tag": "second"}}
    dcp.save(second, storage_writer=ShmckptWriter(p, tuning=Tuning(chunk_size=CHUNK)))
    dst = zeros()
    dcp.load(dst, storage_reader=ShmckptReader(p))
    assert torch.equal(dst["w"], second["w"]) and torch.equal(dst["b"], second["b"])
    assert dst["meta"] == {"epoch": 4, "tag": "second"}
    assert sorted(os.listdir(p)) == [".metadata", "manifest.json", "rank-00000-of-00001.safetensors"]
    assert _spool_leftovers(tmp_path) == [], "the replaced checkpoint is removed"
    # async_save too (DCP's fastest path through the same writer).
    third = {"w": state()["w"] - 7, "b": state()["b"], "meta": {"epoch": 5, "tag": "third"}}
    _result(dcp.async_save(third, storage_writer=ShmckptWriter(p, tuning=Tuning(chunk_size=CHUNK))))
    dst = zeros()
    dcp.load(dst, storage_reader=ShmckptReader(p))
    assert torch.equal(dst["w"], third["w"]) and dst["meta"] == {"epoch": 5, "tag": "third"}


def test_overwrite_false_refuses_and_a_failed_second_save_keeps_the_first(tmp_path, monkeypatch):
    p = tmp_path / "c"
    save(p)
    want = state()
    second = {"w": want["w"] + 1, "b": want["b"], "meta": {"epoch": 9, "tag": "y"}}

    def first_is_intact():
        dst = zeros()
        dcp.load(dst, storage_reader=ShmckptReader(p))
        assert torch.equal(dst["w"], want["w"]) and torch.equal(dst["b"], want["b"])
        assert dst["meta"] == {"epoch": 3, "tag": "x"}

    with pytest.raises(FAIL) as ei:
        dcp.save(second, storage_writer=ShmckptWriter(p, overwrite=False, tuning=Tuning(chunk_size=CHUNK)))
    assert isinstance(cause(ei.value), FileExistsError) and "overwrite=False" in str(cause(ei.value))
    first_is_intact()
    # The second save fails after its rank's file is durable, before it is published:
    # the first checkpoint stays, whole.
    from shmckpt.dcp import writer as writer_mod

    def boom(*a, **k):
        raise OSError("injected: publish failed")

    monkeypatch.setattr(writer_mod._shmckpt, "publish_dir", boom)
    with pytest.raises(FAIL) as ei:
        dcp.save(second, storage_writer=ShmckptWriter(p, tuning=Tuning(chunk_size=CHUNK)))
    assert "injected" in str(cause(ei.value))
    monkeypatch.undo()
    first_is_intact()
    # A directory that holds no DCP checkpoint is never replaced, overwrite or not.
    q = tmp_path / "other"
    q.mkdir()
    (q / "x").write_bytes(b"1")
    with pytest.raises(FAIL) as ei:
        save(q)
    assert "holds no DCP checkpoint" in str(cause(ei.value))
    assert sorted(os.listdir(q)) == ["x"]


def test_missing_metadata_is_a_clear_error(tmp_path):
    with pytest.raises(FAIL) as ei:
        dcp.load(zeros(), storage_reader=ShmckptReader(tmp_path / "nothing"))
    assert "no DCP metadata" in str(ei.value) and "nothing/.metadata" in str(ei.value)


def test_missing_rank_file_names_it(tmp_path):
    p = tmp_path / "c"
    save(p)
    f = p / "rank-00000-of-00001.safetensors"
    f.unlink()
    with pytest.raises(FAIL) as ei:
        dcp.load(zeros(), storage_reader=ShmckptReader(p))
    c = cause(ei.value)
    assert isinstance(c, errors.ShmckptError), repr(c)
    assert str(f) in str(c)


def test_corrupted_bytes_fail_the_checksum(tmp_path):
    p = tmp_path / "c"
    save(p)
    md = ShmckptReader(p).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    f = p / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset + 100] ^= 0x40
    f.write_bytes(bytes(data))
    dst = zeros()
    with pytest.raises(FAIL) as ei:
        dcp.load(dst, storage_reader=ShmckptReader(p))
    c = cause(ei.value)
    assert isinstance(c, errors.ChecksumError), repr(c)
    assert "'w'" in str(c) or '"w"' in str(c)
    assert str(f) in str(c)
    # Whole contiguous destinations are filled as the file is read, so a failed load may
    # have written into them (documented: never use the state of a failed load); a
    # destination that needs a copy (strided here) is written only after every checksum of
    # its file passed.
    strided = {"w": torch.zeros(32, 64).t(), "b": torch.zeros(32, dtype=torch.bfloat16), "meta": {"epoch": 0, "tag": ""}}
    with pytest.raises(FAIL) as ei:
        dcp.load(strided, storage_reader=ShmckptReader(p))
    assert isinstance(cause(ei.value), errors.ChecksumError)
    assert not strided["w"].any()


def test_truncated_file_is_an_error(tmp_path):
    p = tmp_path / "c"
    save(p)
    f = p / "rank-00000-of-00001.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    with pytest.raises(FAIL) as ei:
        dcp.load(zeros(), storage_reader=ShmckptReader(p))
    assert isinstance(cause(ei.value), (errors.Truncated, errors.CorruptError)), repr(cause(ei.value))


def test_metadata_disagreeing_with_manifest_is_refused(tmp_path):
    p = tmp_path / "c"
    save(p)
    md = ShmckptReader(p).read_metadata()
    for v in md.storage_data.values():
        v.crc32c = (v.crc32c or 0) ^ 1
    with open(p / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(FAIL) as ei:
        dcp.load(zeros(), storage_reader=ShmckptReader(p))
    c = cause(ei.value)
    assert isinstance(c, errors.CorruptError) and "disagrees with the manifest" in str(c)


def test_hostile_metadata_pickle_is_refused(tmp_path):
    p = tmp_path / "c"
    save(p)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (p / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(FAIL) as ei:
        dcp.load(zeros(), storage_reader=ShmckptReader(p))
    assert "refuses to load global" in str(ei.value)
    assert not (tmp_path / "pwned").exists()
    # A function of an allowed module (here DCP's own filesystem writer module) is refused
    # too: only the metadata classes those modules define may be named.
    for fn in ("_generate_uuid", "_write_files_from_queue", "dataclass"):
        (p / ".metadata").write_bytes(
            b"ctorch.distributed.checkpoint.filesystem\n" + fn.encode() + b"\n)R."
        )
        with pytest.raises(FAIL) as ei:
            dcp.load(zeros(), storage_reader=ShmckptReader(p))
        assert "refuses to load global" in str(ei.value), fn
    (p / ".metadata").write_bytes(b"garbage")
    with pytest.raises(FAIL) as ei:
        dcp.load(zeros(), storage_reader=ShmckptReader(p))
    assert "not valid DCP metadata" in str(ei.value)


def test_filesystem_reader_refuses_clearly(tmp_path):
    """DCP's FileSystemReader expects a torch.save stream per item: it cannot read these
    safetensors files, and says so through the transform descriptor instead of loading
    wrong bytes."""
    p = tmp_path / "c"
    save(p)
    dst = zeros()
    with pytest.raises(FAIL) as ei:
        dcp.load(dst, storage_reader=dcp.FileSystemReader(p))
    assert "shmckpt-safetensors" in str(ei.value)
    assert not dst["w"].any()


def test_reader_refuses_a_filesystemwriter_checkpoint(tmp_path):
    p = tmp_path / "fs"
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(p))
    with pytest.raises(FAIL) as ei:
        dcp.load(zeros(), storage_reader=ShmckptReader(p))
    assert "not written by ShmckptWriter" in str(ei.value)


def test_unsupported_dtype_is_a_type_error(tmp_path):
    st = {"c": torch.zeros(3, dtype=torch.complex128)}
    with pytest.raises(FAIL) as ei:
        dcp.save(st, storage_writer=ShmckptWriter(tmp_path / "c", tuning=Tuning(chunk_size=CHUNK)))
    assert "complex128" in str(ei.value)
    assert not (tmp_path / "c").exists()


def _result(resp):
    return (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()


def test_checkpoint_id_given_to_async_save_is_where_it_is_published(tmp_path):
    w = ShmckptWriter(tmp_path / "ctor", tuning=Tuning(chunk_size=CHUNK))
    _result(dcp.async_save(state(), checkpoint_id=tmp_path / "a", storage_writer=w))
    # The same writer again, for another checkpoint.
    _result(dcp.async_save(state(), checkpoint_id=tmp_path / "b", storage_writer=w))
    assert not (tmp_path / "ctor").exists()
    for name in ("a", "b"):
        dst = zeros()
        dcp.load(dst, storage_reader=ShmckptReader(tmp_path / name))
        assert torch.equal(dst["w"], state()["w"]) and dst["meta"]["epoch"] == 3


def test_overlapping_async_saves_each_keep_their_own_snapshot(tmp_path):
    """A second async_save while the first one still uploads; each checkpoint holds the
    values at its own call."""
    s = state()
    r1 = dcp.async_save(s, storage_writer=ShmckptWriter(tmp_path / "one", tuning=Tuning(chunk_size=CHUNK)))
    s["w"].add_(1.0)
    s["meta"]["epoch"] = 4
    r2 = dcp.async_save(s, storage_writer=ShmckptWriter(tmp_path / "two", tuning=Tuning(chunk_size=CHUNK)))
    s["w"].add_(1.0)
    _result(r1)
    _result(r2)
    base = state()["w"]
    for name, add, epoch in (("one", 0.0, 3), ("two", 1.0, 4)):
        dst = zeros()
        dcp.load(dst, storage_reader=ShmckptReader(tmp_path / name))
        assert torch.equal(dst["w"], base + add), name
        assert dst["meta"]["epoch"] == epoch


def test_a_larger_state_grows_the_arena_and_older_files_survive(tmp_path):
    small = state()
    r1 = dcp.async_save(small, storage_writer=ShmckptWriter(tmp_path / "small", tuning=Tuning(chunk_size=CHUNK)))
    big = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: needs a bigger arena
    r2 = dcp.async_save(big, storage_writer=ShmckptWriter(tmp_path / "big", tuning=Tuning(chunk_size=CHUNK)))
    _result(r1)
    _result(r2)
    dst = zeros()
    dcp.load(dst, storage_reader=ShmckptReader(tmp_path / "small"))
    assert torch.equal(dst["w"], small["w"])
    d2 = {"w": torch.zeros(3 << 20)}
    dcp.load(d2, storage_reader=ShmckptReader(tmp_path / "big"))
    assert torch.equal(d2["w"], big["w"])


def test_a_reused_writer_never_publishes_an_older_snapshot(tmp_path):
    """The first async_save fails in DCP's upload (its target is not empty) after
    stage(); the next one through the same writer must publish its own values."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x").write_bytes(b"1")
    w = ShmckptWriter(tmp_path / "unused", tuning=Tuning(chunk_size=CHUNK))
    first = state()
    with pytest.raises(FAIL):
        _result(dcp.async_save(first, checkpoint_id=bad, storage_writer=w))
    second = {"w": first["w"] + 5.0, "b": first["b"], "meta": {"epoch": 9, "tag": "y"}}
    _result(dcp.async_save(second, checkpoint_id=tmp_path / "good", storage_writer=w))
    dst = zeros()
    dcp.load(dst, storage_reader=ShmckptReader(tmp_path / "good"))
    assert torch.equal(dst["w"], second["w"]) and dst["meta"] == {"epoch": 9, "tag": "y"}
    assert sorted(os.listdir(bad)) == ["x"]


def test_a_symlinked_rank_file_is_refused(tmp_path):
    p = tmp_path / "c"
    save(p)
    f = p / "rank-00000-of-00001.safetensors"
    real = tmp_path / "elsewhere.safetensors"
    f.rename(real)
    f.symlink_to(real)
    dst = zeros()
    with pytest.raises(FAIL) as ei:
        dcp.load(dst, storage_reader=ShmckptReader(p))
    c = cause(ei.value)
    assert isinstance(c, errors.CorruptError) and "symbolic link" in str(c) and str(f) in str(c)
    assert not dst["w"].any()


def test_fifo_metadata_is_refused_without_blocking(tmp_path):
    import signal

    p = tmp_path / "c"
    save(p)
    (p / ".metadata").unlink()
    os.mkfifo(p / ".metadata")

    def hung(*_):
        raise AssertionError("the reader blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(FAIL) as ei:
            dcp.load(zeros(), storage_reader=ShmckptReader(p))
        assert "not a regular file" in str(ei.value)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _arenas_of_this_process():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"shmckpt.{os.getpid()}."))


def test_prepare_opens_the_engine_every_later_writer_reuses(tmp_path):
    from shmckpt.dcp import prepare

    assert _arenas_of_this_process() == []
    info = prepare(tmp_path, staging_capacity=8 << 20, devices=[], tuning=Tuning(chunk_size=CHUNK))
    assert info["cuda_registration_s"] is None
    assert info["staging_capacity"] == 8 << 20
    assert info["open_s"] > 0
    assert _arenas_of_this_process() == [info["shm_name"]]
    src = state()
    dcp.save(src, storage_writer=ShmckptWriter(tmp_path / "a"))
    w = ShmckptWriter(tmp_path / "b", tuning=Tuning(chunk_size=CHUNK))
    _result(dcp.async_save(src, storage_writer=w))
    # stage() said where its time went; the prepared arena needed no registration.
    st = w.last_stage
    assert set(st) == {"items_s", "submit_s", "total_s", "engine"}
    assert 0 <= st["items_s"] + st["submit_s"] <= st["total_s"]
    assert st["engine"]["bytes"] == os.path.getsize(tmp_path / "b" / "rank-00000-of-00001.safetensors")
    assert st["engine"]["registration"] == 0.0
    # Both saves went through the prepared arena: no other arena was made.
    assert _arenas_of_this_process() == [info["shm_name"]]
    for name in ("a", "b"):
        dst = zeros()
        dcp.load(dst, storage_reader=ShmckptReader(tmp_path / name))
        assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["b"], src["b"]), name
        assert dst["meta"] == {"epoch": 3, "tag": "x"}
    # Another parent directory is another spool, hence another engine.
    other = tmp_path / "other"
    other.mkdir()
    dcp.save(src, storage_writer=ShmckptWriter(other / "c", tuning=Tuning(chunk_size=CHUNK)))
    assert len(_arenas_of_this_process()) == 2
    release()
    assert _arenas_of_this_process() == []


def test_prepare_too_small_is_grown_by_the_first_save_that_needs_more(tmp_path):
    from shmckpt.dcp import prepare

    info = prepare(tmp_path, staging_capacity=1 << 20, devices=[], tuning=Tuning(chunk_size=CHUNK))
    big = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB
    dcp.save(big, storage_writer=ShmckptWriter(tmp_path / "big"))
    arenas = _arenas_of_this_process()
    assert len(arenas) == 1 and arenas != [info["shm_name"]]
    d = {"w": torch.zeros(3 << 20)}
    dcp.load(d, storage_reader=ShmckptReader(tmp_path / "big"))
    assert torch.equal(d["w"], big["w"])


def test_reader_reports_the_path_each_item_took_on_cpu(tmp_path):
    p = tmp_path / "c"
    save(p)
    reader = ShmckptReader(p)
    assert reader.last_read is None
    dcp.load(zeros(), storage_reader=reader)
    # Contiguous CPU destinations of the same dtype (w, b) are filled as the file is read;
    # the two values of meta come back as bytes.
    assert reader.last_read == {"files": 1, "device_items": 0, "direct_host_items": 2, "host_items": 2}
    # A strided destination, and one of another dtype, come through buffers of their own
    # and are copied (converted) into place.
    dst = {"w": torch.zeros(32, 64).t(), "b": torch.zeros(32, dtype=torch.float32), "meta": {"epoch": 0, "tag": ""}}
    dcp.load(dst, storage_reader=reader)
    src = state()
    assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["b"], src["b"].float())
    assert reader.last_read == {"files": 1, "device_items": 0, "direct_host_items": 0, "host_items": 4}
    # DCP plans no read for an empty tensor.
    q = tmp_path / "e"
    dcp.save(
        {"a": torch.ones(3), "e": torch.empty(0, 3)}, storage_writer=ShmckptWriter(q, tuning=Tuning(chunk_size=CHUNK))
    )
    dst = {"a": torch.zeros(3), "e": torch.empty(0, 3)}
    r2 = ShmckptReader(q)
    dcp.load(dst, storage_reader=r2)
    assert torch.equal(dst["a"], torch.ones(3)) and dst["e"].shape == (0, 3)
    assert r2.last_read == {"files": 1, "device_items": 0, "direct_host_items": 1, "host_items": 0}


def test_a_part_only_save_commits_nothing_and_its_part_is_found(tmp_path):
    """The DCP writer's engines save part-only (``Engine.save(..., part_only=True)``):
    the rank's file and manifest part are durable in ``step-N.partial/`` and nothing is
    committed, even with one rank; ``find_parts`` finds the part (and nothing for another
    step), and the part's file holds exactly the saved bytes. Only a blocking save can be
    part-only."""
    from safetensors.torch import load_file

    from shmckpt import _shmckpt

    root = tmp_path / "rank-00000" / "77-0"
    root.mkdir(parents=True)
    t = torch.arange(1000, dtype=torch.int32)
    e = _shmckpt.Engine(str(root), dict(staging_capacity=1 << 20, chunk_size=1 << 20))
    try:
        with pytest.raises(errors.ConfigError, match="blocking"):
            e.save(5, [("t", "I32", [1000], t.__dlpack__(), t.numel() * 4, -1)], {}, [], False, part_only=True)
        h = e.save(5, [("t", "I32", [1000], t.__dlpack__(), t.numel() * 4, -1)], {}, [], True, part_only=True)
        rep = h.wait()
    finally:
        e.close()
    part = root / "step-5.partial"
    assert rep["dir"] is None
    assert rep["file"] == str(part / "rank-00000-of-00001.safetensors")
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-5.partial"]
    assert sorted(p.name for p in part.iterdir()) == ["rank-00000-of-00001.safetensors", "rank-00000.manifest.json"]
    assert _shmckpt.find_parts(str(tmp_path / "rank-00000"), 5) == [str(part)]
    assert _shmckpt.find_parts(str(tmp_path / "rank-00000"), 6) == []
    assert torch.equal(load_file(rep["file"])["t"], t)
