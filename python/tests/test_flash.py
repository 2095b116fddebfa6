"""Flash restore from Python: ``keep_in_memory=True`` serves the next checkpointer's load
from the kept shared-memory arena, byte-exact, and says so; with the option off the disk
serves every load."""

import os

import torch
from conftest import remove_arenas_of, shm_arenas_of

import shmckpt


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(256, 33, generator=g), "b": torch.arange(7, dtype=torch.int64)},
        "step": step,
    }


def _kept_names(root):
    return shm_arenas_of(root, "kept")


def test_kept_arena_serves_the_next_load_from_memory(tmp_path):
    root = str(tmp_path)
    assert _kept_names(root) == []
    ck = shmckpt.Checkpointer(
        root, keep_in_memory=True, tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=1 << 20)
    )
    ck.save(3, _state(3)).wait()
    ck.save(4, _state(4)).wait()
    ck.close()
    kept = _kept_names(root)
    assert len(kept) == 1, kept
    try:
        ck2 = shmckpt.Checkpointer(
            root, keep_in_memory=True, tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=1 << 20)
        )
        assert ck2.last_load_source is None
        got = ck2.load()
        assert ck2.last_load_source == ("memory", None)
        want = _state(4)
        assert got["step"] == 4
        assert torch.equal(got["model"]["w"], want["model"]["w"])
        assert got["model"]["w"].numpy().tobytes() == want["model"]["w"].numpy().tobytes()
        assert got["model"]["b"].tolist() == list(range(7))
        # An older step is not in memory: the disk serves it, and says why.
        old = ck2.load(3)
        source, reason = ck2.last_load_source
        assert source == "disk" and reason, (source, reason)
        assert torch.equal(old["model"]["w"], _state(3)["model"]["w"])
        ck2.close()
    finally:
        remove_arenas_of(root, "kept")


def test_option_off_keeps_nothing_and_loads_from_disk(tmp_path):
    ck = shmckpt.Checkpointer(str(tmp_path), tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=1 << 20))
    ck.save(1, _state(1)).wait()
    got = ck.load()
    assert ck.last_load_source == ("disk", None)
    assert torch.equal(got["model"]["w"], _state(1)["model"]["w"])
    ck.close()
    assert _kept_names(str(tmp_path)) == []


def test_a_damaged_disk_copy_is_reported_by_a_load_from_memory(tmp_path):
    """Issue 21, item 7: the kept image serves the load (its bytes are the manifest's), and
    the truncated file on disk is reported, not hidden."""
    root = str(tmp_path)
    ck = shmckpt.Checkpointer(
        root, keep_in_memory=True, tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=1 << 20)
    )
    ck.save(4, _state(4)).wait()
    ck.close()
    try:
        path = os.path.join(root, "step-4", "rank-00000-of-00001.safetensors")
        size = os.path.getsize(path)
        os.truncate(path, size - 1)
        ck2 = shmckpt.Checkpointer(
            root, keep_in_memory=True, tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=1 << 20)
        )
        got = ck2.load()
        source, problem = ck2.last_load_source
        assert source == "memory", (source, problem)
        assert problem is not None and f"is {size - 1} bytes, the manifest says {size}" in problem, problem
        assert got["model"]["w"].numpy().tobytes() == _state(4)["model"]["w"].numpy().tobytes()
        ck2.close()
    finally:
        remove_arenas_of(root, "kept")
