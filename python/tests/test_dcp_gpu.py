"""shmckpt.dcp on CUDA (marker ``gpu``; ``SHMCKPT_REQUIRE_GPU=1`` makes a missing GPU a
failure). One rank with NCCL (plus gloo for DCP's CPU collectives), in a child process:
DTensor shards and plain tensors on the GPU, ``dcp.async_save`` through ShmckptWriter
ordered after the caller's stream (a slow kernel queued just before the save rewrites a
256 MiB tensor: the checkpoint must hold the new values), no device memory allocated by
staging, and a byte-exact ``dcp.load`` into CUDA tensors with ShmckptReader, whole
tensors straight to the device through registered read buffers, ordered after work
queued on the destinations."""

import pytest
import torch

from test_dcp import spawn


@pytest.mark.gpu
def test_dcp_async_save_and_load_on_cuda(tmp_path):
    if not torch.cuda.is_available():  # only reached with SHMCKPT_REQUIRE_GPU=1
        pytest.fail("SHMCKPT_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
    (r,) = spawn("gpu", 1, tmp_path)
    # 4 DTensors + 7 plain tensors (with the 256 MiB one) + step, sched, counter n, hist
    assert r["checks"] == 15
    before, after = r["alloc"]
    assert after == before, f"staging allocated {after - before} bytes of device memory"
    before, after = r["reserved"]
    assert after == before, f"staging reserved {after - before} bytes of device memory"
    # Whole, contiguous CUDA destinations came straight from the file through the
    # registered read buffers (4 DTensor shards, step_t, mask, i32, f16, big, hist); the
    # strided tensor and the values came through host memory (DCP plans no read of the
    # empty tensor).
    assert r["want_device"] == 10
    assert r["last_read"] == {"files": 1, "device_items": 10, "direct_host_items": 0, "host_items": r["items"] - 10}
