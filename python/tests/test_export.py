"""shmckpt.export: Hugging Face safetensors shards from a checkpoint (docs/export.md).

The multi-process tests train a tiny transformers model over gloo (DDP; FSDP2 through DCP;
column shards as tensor parallelism lays them out), export, and load the export with
from_pretrained: the logits must equal the in-memory model's exactly."""

import json
import os
import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import shmckpt
from shmckpt import errors

from conftest import remove_arenas_of, shmckpt_bin
from ranks_support import run_ranks

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "export_worker.py"


def _have_transformers():
    try:
        import transformers  # noqa: F401

        return True
    except ImportError:
        return False


needs_transformers = pytest.mark.skipif(
    not _have_transformers() and not os.environ.get("SHMCKPT_REQUIRE_TRANSFORMERS"),
    reason="transformers is not installed (scripts/test.sh installs it)",
)


def spawn(scenario, world, workdir, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run_ranks(WORKER, scenario, world, workdir, env=env, timeout=timeout)
    with open(workdir / f"result-{scenario}.json") as f:
        return json.load(f)


def _check(res):
    assert res["equal_logits"], res
    assert res["equal_weights"], res
    assert res["names"] == res["state_names"]
    # 20 KB shards: several files, then the index.
    assert len(res["files"]) > 3 and res["files"][-1] == "model.safetensors.index.json"
    n = len(res["files"]) - 1
    assert res["files"][:-1] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


@needs_transformers
def test_ddp_checkpoint_exports_to_from_pretrained(tmp_path):
    res = spawn("ddp", 2, tmp_path)
    _check(res)


@needs_transformers
def test_fsdp2_and_column_sharded_dcp_checkpoints_export_to_from_pretrained(tmp_path):
    res = spawn("fsdp2", 2, tmp_path)
    assert res["sharded_rank_files"]
    _check(res["fsdp"])
    _check(res["tp"])


def _special_floats():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=g) * torch.logspace(-45, 38, 4096).float()
    bits = torch.randint(0, 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), 65504.0, 65520.0, 1e-8, -3e-45, 1.0 + 2**-8, 1.0 + 2**-11, 3.4e38]
    )
    return torch.cat([x, bits.view(torch.float32), specials])


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), (torch.float16, torch.float16)])
def test_casts_match_torch_bit_for_bit(tmp_path, dtype, torch_dtype):
    x = _special_floats()
    ids = torch.arange(7, dtype=torch.int64)
    with shmckpt.Checkpointer(
        tmp_path / "ck", tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20)
    ) as ck:
        ck.save(1, {"model": {"w": x, "ids": ids}, "optim": {"m": x}}).wait()
    rep = shmckpt.export(tmp_path / "ck", tmp_path / "hf", dtype=dtype)
    assert rep.tensors == 2 and rep.files == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    got = load_file(str(tmp_path / "hf" / rep.files[0]))
    assert sorted(got) == ["ids", "w"]
    assert got["w"].dtype == torch_dtype
    # Every non-NaN value bit for bit; NaN stays NaN (its payload is not kept: torch's
    # own vector and scalar paths disagree on it, 0xffff vs 0x7fc0 for bf16).
    nan = torch.isnan(x)
    assert 0 < int(nan.sum()) < 100
    want = x.to(torch_dtype).view(torch.int16)
    assert torch.equal(got["w"].view(torch.int16)[~nan], want[~nan])
    assert bool(torch.isnan(got["w"][nan]).all())
    assert torch.equal(got["ids"], ids)


def test_rename_callable_and_errors(tmp_path):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with shmckpt.Checkpointer(
        tmp_path / "ck", tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20)
    ) as ck:
        ck.save(2, {"model": {"a.weight": w, "b.bias": w[0].clone()}, "optimizer": {"m": w + 1}}).wait()
    names = []

    def rename(n):
        names.append(n)
        return None if n == "b.bias" else "decoder." + n

    rep = shmckpt.export(tmp_path / "ck" / "step-2", tmp_path / "hf", rename=rename)
    assert sorted(names) == ["a.weight", "b.bias"]
    assert rep.step == 2 and rep.tensors == 1 and rep.bytes == 48
    got = load_file(str(tmp_path / "hf" / rep.files[0]))
    assert list(got) == ["decoder.a.weight"] and torch.equal(got["decoder.a.weight"], w)
    # An existing export is refused, then replaced on request.
    with pytest.raises(errors.UnsafePath):
        shmckpt.export(tmp_path / "ck", tmp_path / "hf")
    rep = shmckpt.export(tmp_path / "ck", tmp_path / "hf", include_optimizer=True, overwrite=True)
    assert sorted(load_file(str(tmp_path / "hf" / rep.files[0]))) == ["model.a.weight", "model.b.bias", "optimizer.m"]
    with pytest.raises(ValueError):
        shmckpt.export(tmp_path / "ck", tmp_path / "x", format="gguf")
    with pytest.raises(errors.ConfigError):
        shmckpt.export(tmp_path / "ck", tmp_path / "x", max_shard_size="5XB")
    assert not (tmp_path / "x").exists()


def test_cli_exports_and_refuses_a_damaged_checkpoint(tmp_path):
    exe = shmckpt_bin()
    if exe is None:
        pytest.skip("no shmckpt command line (cargo build --bin shmckpt, or SHMCKPT_BIN)")
    w = torch.randn(64, 32)
    with shmckpt.Checkpointer(
        tmp_path / "ck", tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20)
    ) as ck:
        ck.save(4, {"model": {"model.embed.weight": w}, "optim": {"m": w}}).wait()
    out = tmp_path / "hf"
    p = subprocess.run(
        [exe, "export", str(tmp_path / "ck"), str(out), "--strip-prefix", "model.", "--dtype", "bf16", "--json"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["step"] == 4 and rep["tensors"] == 1 and rep["bytes"] == 64 * 32 * 2
    got = load_file(str(out / rep["files"][0]))
    assert torch.equal(got["embed.weight"].view(torch.int16), w.to(torch.bfloat16).view(torch.int16))
    # A flipped byte of the weight: the CLI fails naming it, and nothing appears.
    step = tmp_path / "ck" / "step-4"
    manifest = json.loads((step / "manifest.json").read_text())
    f = manifest["files"][0]
    t = next(t for t in f["tensors"] if t["name"] == "model.model.embed.weight")
    path = step / f["file"]
    data = bytearray(path.read_bytes())
    data[f["data_start"] + t["data_offsets"][0] + 100] ^= 1
    path.write_bytes(bytes(data))
    p = subprocess.run([exe, "export", str(tmp_path / "ck"), str(tmp_path / "hf2")], capture_output=True, text=True)
    assert p.returncode != 0
    assert "model.model.embed.weight" in p.stderr and "checksum" in p.stderr.lower()
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]
    with pytest.raises(errors.ChecksumError) as e:
        shmckpt.export(tmp_path / "ck", tmp_path / "hf2")
    assert e.value.tensor == "model.model.embed.weight"
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]


def test_export_from_the_kept_arena_while_training_runs(tmp_path):
    """``memory:ROOT``: the image flash restore keeps in /dev/shm, exported while the
    checkpointer is still open, equals the export from the disk byte for byte."""
    root = tmp_path / "ck"
    g = torch.Generator().manual_seed(5)
    state = {"model": {"w": torch.randn(300, 70, generator=g), "b": torch.arange(9)}, "optim": {"m": torch.ones(4)}}
    ck = shmckpt.Checkpointer(
        root, keep_in_memory=True, tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=1 << 20)
    )
    try:
        ck.save(3, state).wait()
        mem = shmckpt.export(f"memory:{root}", tmp_path / "m", rename=lambda n: "x." + n, max_shard_size=50_000)
        disk = shmckpt.export(root, tmp_path / "d", rename=lambda n: "x." + n, max_shard_size=50_000)
        assert mem.source == f"memory:{root}/step-3" and mem.step == 3
        assert mem.files == disk.files and len(mem.files) == 3
        for f in mem.files:
            assert (tmp_path / "m" / f).read_bytes() == (tmp_path / "d" / f).read_bytes(), f
        got = {k: v for f in mem.files[:-1] for k, v in load_file(str(tmp_path / "m" / f)).items()}
        assert sorted(got) == ["x.b", "x.w"]
        assert torch.equal(got["x.w"], state["model"]["w"]) and torch.equal(got["x.b"], state["model"]["b"])
        ck.close()
    finally:
        remove_arenas_of(root, "kept")
    with pytest.raises(errors.NotFound):
        shmckpt.export(f"memory:{root}", tmp_path / "gone")
    assert not (tmp_path / "gone").exists()
