"""shmckpt.megatron on a GPU: a tiny megatron-core GPT trained with Adam, saved
asynchronously through Megatron's AsyncCallsQueue mid-training, loaded into a fresh
model bit-exact; a save changes no device memory.

Needs a CUDA GPU and megatron-core (GPU tests skip without a GPU; SHMCKPT_REQUIRE_GPU=1
makes that a failure, SHMCKPT_REQUIRE_MEGATRON=1 a missing megatron-core). No download:
the model is built from megatron-core's local layer spec."""

import importlib
import json
import os

import pytest

if os.environ.get("SHMCKPT_REQUIRE_MEGATRON") == "1":
    importlib.import_module("megatron.core")  # a failure, not a skip
else:
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed (pip install megatron-core; SHMCKPT_REQUIRE_MEGATRON=1 fails instead)"
    )

from test_megatron import spawn  # noqa: E402


@pytest.mark.gpu
def test_async_save_during_training_on_gpu(tmp_path):
    (r,) = spawn("gpu_train", 1, tmp_path, timeout=400)
    # The save call allocated and reserved no device memory (no CUDA IPC, no staging
    # copy on the device, no empty_cache needed).
    # (The first save, at step 1, may reserve for Megatron's own planning collectives,
    # which stage pickled bytes on the device under NCCL; it allocates nothing that stays.)
    before, after = r["reserved_before_after_save_3"]
    assert after == before, r
    for it in (1, 3):
        before, after = r[f"allocated_before_after_save_{it}"]
        assert after == before, r
    # Offloading the model while the save was in flight freed all of its parameters.
    freed, param_bytes = r["freed_by_offload_vs_param_bytes"]
    assert freed >= param_bytes, r
    assert r["differs_before_load"] is True
    assert r["bit_exact"] is True, r
    assert r["tensors"] == 29
    assert r["iteration"] == 3
    # Every stored tensor went straight from the file to the device.
    assert r["last_read"]["device_items"] > 0 and r["last_read"]["host_items"] == 0, r["last_read"]
    assert len(r["losses"]) == 8
    print(json.dumps({k: v for k, v in r.items() if k != "losses"}))
