"""Start-up (issue 24): ``Checkpointer(...)`` leaves the allocation of the staging memory to
background threads; saves issued before it is done are exact, ``wait_staging_ready`` waits
for it, and ``prepare_cuda(background=True)`` registers it with CUDA off the caller's path."""

import os

import numpy as np
import pytest
import torch

import shmckpt


def test_a_save_right_after_the_constructor_is_exact_and_ready_follows(root):
    # 512 MiB in 1 MiB chunks: 8 allocation batches of 64 MiB, 7 of them in the background.
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=512 << 20, chunk_size=1 << 20))
    name = ck.shm_name
    g = torch.Generator().manual_seed(24)
    state = {
        "w": torch.randn(40 << 20 >> 2, generator=g),  # 40 MiB
        "a": np.frombuffer(os.urandom(70 << 20), dtype=np.uint8),  # 70 MiB
        "step": 7,
    }
    ck.save(1, state).wait()
    back = ck.load(1)
    assert torch.equal(back["w"], state["w"])
    assert np.array_equal(back["a"], state["a"])
    assert back["step"] == 7
    ck.wait_staging_ready()
    assert ck.staging_ready() is True
    ck.close()
    assert not os.path.exists(os.path.join("/dev/shm", name))
    with pytest.raises(shmckpt.errors.ShmckptError):
        ck.wait_staging_ready()


def test_close_right_after_the_constructor_removes_the_arena(root):
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=1 << 30, chunk_size=1 << 20))
    name = ck.shm_name
    ck.close()
    assert not os.path.exists(os.path.join("/dev/shm", name))


@pytest.mark.gpu
def test_prepare_cuda_in_the_background_then_a_device_save_is_exact(root):
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=512 << 20, chunk_size=1 << 20))
    assert ck.prepare_cuda(background=True) is None
    x = torch.randn(1 << 20, device="cuda")
    y = torch.randint(0, 255, (3, 1 << 20), device="cuda", dtype=torch.uint8)
    ck.save(1, {"x": x, "y": y}).wait()
    ck.wait_staging_ready()
    assert ck.staging_ready() is True
    back = ck.load(1)
    assert torch.equal(back["x"], x.cpu())
    assert torch.equal(back["y"], y.cpu())
    ck.close()
