"""DCP checkpoints in a bucket (``ShmckptWriter``/``ShmckptReader`` on
``s3://bucket/prefix/step-N``) against moto's S3 server, started as in test_remote.py.
Without moto the tests are skipped; ``SHMCKPT_REQUIRE_S3=1`` (CI) makes that a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from shmckpt.dcp import ShmckptReader, ShmckptWriter, release  # noqa: E402
from shmckpt.errors import ConfigError  # noqa: E402

from test_remote import Moto, _free_port, _require_moto, keys, rank_key  # noqa: E402
import zygote


@pytest.fixture(scope="module")
def moto():
    _require_moto()
    m = Moto()
    yield m
    m.stop()


@pytest.fixture
def s3(moto, monkeypatch):
    """Environment for `moto`, a fresh bucket; yields (boto3 client, bucket name)."""
    import boto3

    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto.url,
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield client, bucket
    release()


def _dcp_error(fn):
    """The exception a single-process DCP call raised on rank 0 (DCP wraps it in a
    ``CheckpointException``, a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as e:
        fn()
    exc = e.value.failures[0]
    return exc[0] if isinstance(exc, tuple) else exc


def _ranks(mode: str, url: str, world: int, tmp_path, env=None):
    port = _free_port()
    outs = [tmp_path / f"{mode}-{r}.json" for r in range(world)]
    worker = os.path.join(os.path.dirname(__file__), "dcp_remote_worker.py")
    procs = [
        zygote.spawn(
            [sys.executable, worker, mode, url, str(r), str(world), str(port), str(outs[r])],
            env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * world
    return [json.loads(o.read_text()) for o in outs]


def test_two_gloo_ranks_save_to_a_bucket_and_load_exact_values(s3, tmp_path):
    """dcp.save and dcp.async_save of two gloo ranks to s3://.../step-N, then dcp.load in
    fresh processes (nothing local: each rank's engine kept only a scratch directory,
    removed at exit) gives every tensor and value back exactly."""
    client, bucket = s3
    url = f"s3://{bucket}/dcp/step-10"
    saved = _ranks("save", url, 2, tmp_path)
    assert [r["remote_committed"] for r in saved] == [11, 11]
    for s in (10, 11):
        assert keys(client, bucket, f"dcp/step-{s}/") == [
            f"dcp/step-{s}/.metadata",
            f"dcp/step-{s}/manifest.json",
            rank_key(client, bucket, f"dcp/step-{s}", 0),
            f"dcp/step-{s}/rank-00000.manifest.json",
            rank_key(client, bucket, f"dcp/step-{s}", 1),
            f"dcp/step-{s}/rank-00001.manifest.json",
        ]
        m = json.loads(client.get_object(Bucket=bucket, Key=f"dcp/step-{s}/manifest.json")["Body"].read())
        assert m["step"] == s and m["world_size"] == 2
    loaded = _ranks("load", url, 2, tmp_path)
    for rank, r in enumerate(loaded):
        for s in ("10", "11"):
            assert r[s]["meta"] is True, (rank, s, r)
            assert r[s]["tensors"] == {k: True for k in ("shared", f"w{rank}", f"b{rank}", f"bf{rank}")}, (rank, r)
            assert r[s]["files"] >= 1


def test_single_process_save_then_load_after_the_local_directory_is_gone(s3, tmp_path, monkeypatch):
    """One process: the engine's scratch directory (TMPDIR) holds nothing after the save;
    the reader needs nothing local. Items are checked exactly, and the step is a committed
    shmckpt step of the bucket root (listed by a Checkpointer on that root)."""
    import shmckpt

    client, bucket = s3
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    url = f"s3://{bucket}/one/step-3"
    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(1000, 37, generator=g), "i": torch.arange(-50, 50, dtype=torch.int32), "v": {"x": [1, "a"]}}
    w = ShmckptWriter(url)
    dcp.save(sd, storage_writer=w)
    assert w.last_report["remote"]["step"] == 3
    release()
    import shutil

    shutil.rmtree(scratch)  # nothing local is left, nothing local is needed
    got = {"w": torch.zeros(1000, 37), "i": torch.zeros(100, dtype=torch.int32), "v": {"x": None}}
    dcp.load(got, storage_reader=ShmckptReader(url))
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["i"], sd["i"]) and got["v"] == {"x": [1, "a"]}
    scratch.mkdir()  # a Checkpointer keeps its scratch directory there
    with shmckpt.Checkpointer(f"s3://{bucket}/one", tuning=shmckpt.Tuning(staging_capacity=8 << 20)) as ck:
        assert ck.list(remote=True) == [3]
    # A second save to the same step is refused before anything is written.
    err = _dcp_error(lambda: dcp.save(sd, storage_writer=ShmckptWriter(url)))
    assert isinstance(err, FileExistsError) and "already committed in the bucket" in str(err), err
    assert sorted(k.rsplit("/", 1)[1] for k in keys(client, bucket, "one/step-3/")) == [
        ".metadata",
        "manifest.json",
        rank_key(client, bucket, "one/step-3").rsplit("/", 1)[1],
        "rank-00000.manifest.json",
    ]


def test_a_flipped_byte_in_the_bucket_fails_the_load(s3):
    client, bucket = s3
    url = f"s3://{bucket}/bad/step-1"
    sd = {"w": torch.arange(1 << 14, dtype=torch.float32)}
    dcp.save(sd, storage_writer=ShmckptWriter(url))
    key = rank_key(client, bucket, "bad/step-1")
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-5] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    got = {"w": torch.zeros(1 << 14)}
    from shmckpt.errors import ChecksumError

    err = _dcp_error(lambda: dcp.load(got, storage_reader=ShmckptReader(url)))
    assert isinstance(err, ChecksumError) and "fails its checksum" in str(err), err
    assert not got["w"].any()


def test_an_unfinished_save_has_no_metadata_and_is_a_clear_error(s3):
    """A step committed by the engine but without DCP's .metadata (the coordinator died
    before finish) is not a DCP checkpoint."""
    client, bucket = s3
    url = f"s3://{bucket}/unf/step-2"
    dcp.save({"w": torch.ones(10)}, storage_writer=ShmckptWriter(url))
    client.delete_object(Bucket=bucket, Key="unf/step-2/.metadata")
    assert not ShmckptReader.validate_checkpoint_id(url)
    err = _dcp_error(lambda: dcp.load({"w": torch.zeros(10)}, storage_reader=ShmckptReader(url)))
    assert "unf/step-2/.metadata: no DCP metadata" in str(err), err


@pytest.mark.parametrize("bad", ["s3://b", "s3://b/x", "s3:///step-1", "s3://b/p/step-x"])
def test_a_bucket_path_must_name_a_step(bad):
    with pytest.raises(ConfigError, match="step-N"):
        ShmckptWriter(bad)
    with pytest.raises(ConfigError, match="step-N"):
        ShmckptReader(bad)


def test_prepare_refuses_a_bucket():
    from shmckpt.dcp import prepare

    with pytest.raises(ConfigError, match="opens at its first save"):
        prepare("s3://b/p", staging_capacity=1 << 20)


def test_a_failed_upload_fails_the_save_and_leaves_nothing_visible(s3, moto, monkeypatch):
    """Every part refused (503, after object_store's retries): the save raises
    ``RemoteFailed`` on the rank, no object of the step is visible, the multipart upload
    is aborted; once the server answers again, a save of the same step commits and
    loads exactly."""
    from shmckpt.errors import RemoteFailed

    from test_remote import FaultProxy

    client, bucket = s3
    proxy = FaultProxy(moto.port, fail_part=1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    try:
        url = f"s3://{bucket}/fail/step-4"
        sd = {"w": torch.arange(1 << 16, dtype=torch.float32), "v": 3}
        err = _dcp_error(lambda: dcp.save(sd, storage_writer=ShmckptWriter(url)))
        assert isinstance(err, RemoteFailed) and "remote copy of step 4 failed" in str(err), err
        assert proxy.failed >= 1
        assert keys(client, bucket, "fail/") == []
        assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
        proxy.armed = False
        dcp.save(sd, storage_writer=ShmckptWriter(url))
        got = {"w": torch.zeros(1 << 16), "v": 0}
        dcp.load(got, storage_reader=ShmckptReader(url))
        assert torch.equal(got["w"], sd["w"]) and got["v"] == 3
    finally:
        proxy.stop()


def test_export_from_a_bucket_equals_the_local_export(s3, tmp_path):
    """``shmckpt.export("s3://bucket/prefix")`` of a DCP save in the bucket (its latest
    committed step) writes the bytes the export of the same save on disk writes."""
    import shmckpt

    client, bucket = s3
    g = torch.Generator().manual_seed(4)
    sd = {"model": {"w": torch.randn(300, 41, generator=g), "i": torch.arange(77)}, "optim": {"m": torch.ones(5000)}}
    dcp.save(sd, storage_writer=ShmckptWriter(f"s3://{bucket}/ex/step-4"))
    dcp.save(sd, storage_writer=ShmckptWriter(str(tmp_path / "local")))
    rb = shmckpt.export(f"s3://{bucket}/ex", tmp_path / "b", max_shard_size=40_000)
    rl = shmckpt.export(tmp_path / "local", tmp_path / "l", max_shard_size=40_000)
    assert rb.source == f"s3://{bucket}/ex/step-4" and rb.step == 4
    assert rb.files == rl.files and len(rb.files) == 3, rb.files
    for f in rb.files:
        assert (tmp_path / "b" / f).read_bytes() == (tmp_path / "l" / f).read_bytes(), f
    assert rb.bytes == 300 * 41 * 4 + 77 * 8
