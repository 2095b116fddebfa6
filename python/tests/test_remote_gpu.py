"""GPU loads from the bucket (moto's S3 server): bytes go bucket -> CUDA-registered
staging -> GPU with no host copy of the file. Split from test_remote.py (same fixtures)."""

from __future__ import annotations

import shutil

import pytest

import shmckpt

from test_remote import moto, open_ck, rank_key, s3  # noqa: F401  (fixtures)

torch = pytest.importorskip("torch")


def _big_state(seed: int):
    """About 100 MB: more than the two 32 MiB registered staging buffers of a device load
    (the default device read size), with tensors that straddle them, a small one and an
    empty one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(25_000_003, generator=g),
            "h": torch.randn(1_000_001, generator=g).to(torch.bfloat16),
            "b": torch.arange(7, dtype=torch.int64) + seed,
            "e": torch.empty(0, 3),
        },
        "step": seed,
    }


def _data_bytes(st) -> int:
    return sum(t.numel() * t.element_size() for t in st["model"].values())


def _assert_on_device(got, st, dev):
    for k, want in st["model"].items():
        t = got["model"][k]
        assert t.device == dev, k
        assert t.dtype == want.dtype and list(t.shape) == list(want.shape), k
        assert torch.equal(t.cpu(), want), k


@pytest.mark.gpu
def test_load_to_cuda_from_the_bucket_goes_through_registered_staging(s3, root):
    _, bucket = s3
    url = f"s3://{bucket}/dev"
    st = _big_state(4)
    with open_ck(root, url) as ck:
        h = ck.save(4, st)
        h.wait()
        h.wait_remote()
    shutil.rmtree(root / "step-4")
    dev = torch.device("cuda", 0)
    with open_ck(root, url) as ck:
        got = ck.load(4, map_location="cuda:0", source="remote")
        assert ck.last_load_source == ("remote", None)
        assert got["step"] == 4
        _assert_on_device(got, st, dev)
        step, nbytes, staged, staging, seconds = ck._engine.last_remote_device_load()
        assert step == 4 and seconds > 0
        # Every data byte went to the device from the two registered 32 MiB buffers: the
        # load held 64 MiB of staging, not a host copy of the ~104 MB of data.
        assert staged == _data_bytes(st)
        assert staging == 2 * (32 << 20) < staged
        assert nbytes > staged  # (the object: header and data)
        # "latest" with no step on disk: the bucket, to the current device.
        with torch.cuda.device(0):
            got = ck.load("latest", map_location="cuda")
        _assert_on_device(got, st, dev)
        assert ck._engine.last_remote_device_load()[2] == _data_bytes(st)


@pytest.mark.gpu
def test_load_into_cuda_destinations_from_the_bucket(s3, root):
    _, bucket = s3
    url = f"s3://{bucket}/devli"
    st = _big_state(6)
    with open_ck(root, url) as ck:
        h = ck.save(6, st)
        h.wait()
        h.wait_remote()
    shutil.rmtree(root / "step-6")
    dev = torch.device("cuda", 0)
    with open_ck(root, url) as ck:
        dest = {"model": {k: torch.full_like(v, 3).to(dev) if v.numel() else v.to(dev) for k, v in st["model"].items()}}
        # A non-contiguous destination goes through a scratch buffer on the device.
        dest["model"]["b"] = torch.zeros(14, dtype=torch.int64, device=dev)[::2]
        res = ck.load_into(dest, strict=False)
        assert res.step == 6 and res.missing_keys == [] and res.unexpected_keys == []
        _assert_on_device(dest, st, dev)
        assert ck._engine.last_remote_device_load()[2] == _data_bytes(st)


@pytest.mark.gpu
def test_a_damaged_object_fails_a_device_load_and_the_next_load_works(s3, root):
    client, bucket = s3
    url = f"s3://{bucket}/devbad"
    st = _big_state(8)
    with open_ck(root, url) as ck:
        for s in (8, 9):
            h = ck.save(s, st)
            h.wait()
            h.wait_remote()
    key = rank_key(client, bucket, "devbad/step-8")
    obj = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    obj[-5] ^= 0x40  # a data byte (the last tensor with bytes)
    client.put_object(Bucket=bucket, Key=key, Body=bytes(obj))
    with open_ck(root, url) as ck:
        with pytest.raises(shmckpt.errors.ChecksumError):
            ck.load(8, map_location="cuda:0", source="remote")
        # The staging buffers were given back: the next device load works.
        _assert_on_device(ck.load(9, map_location="cuda:0", source="remote"), st, torch.device("cuda", 0))
