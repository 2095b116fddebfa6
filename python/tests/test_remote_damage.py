"""A local copy damaged on the disk, the bucket holding the same step: loads read the
bucket's copy (never another step's or another run's bytes), ``source="local"`` never
does. Split from test_remote.py (same fixtures)."""

from __future__ import annotations

import pytest

import shmckpt

from conftest import SMALL

from test_remote import moto, open_ck, s3, same, state  # noqa: F401  (fixtures)

torch = pytest.importorskip("torch")

FILE = "rank-00000-of-00001.safetensors"


def flip(root, step: int, at: int) -> None:
    """XOR one byte of the rank file of ``step`` (``at`` from the end when negative)."""
    path = root / f"step-{step}" / FILE
    b = bytearray(path.read_bytes())
    b[at] ^= 0x40
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", ["data", "header", "cut"])
def test_a_damaged_local_file_is_loaded_from_the_bucket(s3, root, damage):
    _, bucket = s3
    url = f"s3://{bucket}/dmg"
    st = state(5)
    with open_ck(root, url) as ck:
        h = ck.save(5, st)
        h.wait()
        h.wait_remote()
    path = root / "step-5" / FILE
    if damage == "data":
        flip(root, 5, -64)
    elif damage == "header":
        flip(root, 5, 12)
    else:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 100)
    want = {"data": shmckpt.ChecksumError, "header": shmckpt.CorruptError, "cut": shmckpt.Truncated}[damage]
    with open_ck(root, url) as ck:
        # Asked for the disk only: the damage is the error.
        with pytest.raises(want) as e:
            ck.load(5, source="local")
        assert e.value.path == str(path) or damage == "header"
        back = ck.load()
        same(back, st)
        src, why = ck.last_load_source
        assert src == "remote" and str(path) in why, ck.last_load_source
        dest = {"model": {"w": torch.zeros_like(st["model"]["w"]), "b": torch.zeros(7, dtype=torch.int64)}}
        res = ck.load_into(dest)
        assert res.step == 5
        assert torch.equal(dest["model"]["w"], st["model"]["w"]) and torch.equal(dest["model"]["b"], st["model"]["b"])
    # The disk's file is left as it was (loads do not repair it): without a bucket the
    # damage is still the error.
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20)) as ck:
        with pytest.raises(want):
            ck.load(5)


def test_another_runs_step_in_the_bucket_is_never_served(s3, root, tmp_path):
    """The bucket's step 5 was written by another run (other values): a damaged local
    step 5 is an error, not the bucket's bytes."""
    _, bucket = s3
    url = f"s3://{bucket}/other"
    with open_ck(tmp_path / "other", url) as ck:
        h = ck.save(5, state(1))
        h.wait()
        h.wait_remote()
    # No bucket: disk only.
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20)) as ck:
        ck.save(5, state(2)).wait()
    flip(root, 5, -64)
    with open_ck(root, url) as ck:
        with pytest.raises(shmckpt.ChecksumError):
            ck.load(5)
        dest = {"model": {"w": torch.zeros_like(state(2)["model"]["w"]), "b": torch.zeros(7, dtype=torch.int64)}}
        with pytest.raises(shmckpt.ChecksumError):
            ck.load_into(dest)
        same(ck.load(5, source="remote"), state(1))  # read only when asked for
