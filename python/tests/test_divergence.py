"""Replica divergence check (``Checkpointer(check_replicas=group)``, docs/guarantees.md):
2 and 3 ranks over gloo save identical replicated tensors, then one rank's ``model.w``
with one bit flipped; the check names that tensor and rank and the step is not committed
(``on_divergence="raise"``), committed with a warning (``"warn"``) or as a callback
decides on every rank. Rank-specific tensors (``rng.rank{r}``, a shard whose shape differs
per rank) are never compared."""

import json
import pathlib
import subprocess
import sys

import pytest

import shmckpt
from shmckpt import _shmckpt
import zygote
from conftest import free_port

HERE = pathlib.Path(__file__).resolve().parent
WORKER = str(HERE / "divergence_worker.py")


def run_world(tmp_path, world, flip):
    port = str(free_port())
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [
        zygote.spawn([sys.executable, WORKER, str(tmp_path / "ck"), str(r), str(world), port, str(outs[r]), str(flip)])
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize("world,flip,named", [(3, 2, [2]), (2, 1, [0, 1])])
def test_flipped_bit_is_named_and_not_committed(tmp_path, world, flip, named):
    # 3 ranks: the majority names the odd rank; 2 ranks: no majority, both are named.
    reports = run_world(tmp_path, world, flip)
    for step in ("raise_1", "raise_3", "raise_4", "warn_1", "cb_2"):
        assert any(res[step]["dir"] == f"step-{step[-1]}" for res in reports), step
    for rank, res in enumerate(reports):
        # (A report's "dir" is set on the rank that completed the commit only.)
        assert res["raise_1"]["ok"] and res["raise_1"]["divergence"] is None
        assert res["raise_1"]["check_seconds"] >= 0
        err = res["raise_2"]
        assert err["error"] == "ReplicaDivergence"
        assert (err["step"], err["tensor"], err["ranks"]) == (2, "model.w", named)
        assert err["divergences"] == ["model.w"]
        assert err["crc_ranks"] == list(range(world)) and err["distinct_crcs"] == 2
        assert err["committed"] is False
        assert "'model.w' differs on rank(s)" in err["message"]
        # Later identical steps commit, checked at the next save and at ck.wait().
        assert res["raise_3"]["ok"] and res["raise_4"]["ok"]
        assert res["raise_list"] == [1, 3, 4]
        # Nothing of step 2 is left: no partial directory, no file.
        assert res["raise_listing"] == ["step-1", "step-3", "step-4"]

        warn = res["warn_1"]
        assert warn["ok"]
        assert warn["divergence"] == {"tensor": "model.w", "ranks": named, "committed": True}
        assert len(res["warnings"]) == 1
        assert res["warnings"][0].startswith("ReplicaDivergenceWarning: replicas diverge in step 1 (committed anyway): 'model.w' differs on rank(s) " + str(named))
        assert res["warn_list"] == [1]

        # Step 1: rank 0's callback says no: not committed on any rank. Step 2: all yes.
        assert res["cb_seen"] == [[1, "model.w", named], [2, "model.w", named]]
        assert res["cb_1"]["error"] == "ReplicaDivergence" and res["cb_1"]["ranks"] == named
        assert res["cb_1"]["committed"] is False
        assert res["cb_2"]["ok"] and res["cb_2"]["divergence"]["committed"] is True
        assert res["cb_list"] == [2]
        assert res["cb_listing"] == ["step-2"]


def test_compare_names_odd_ranks_only_for_replicated_tensors():
    w = ("model.w", "float32", [2, 3], 11)
    assert _shmckpt.replica_divergence([[w], [w], [w]]) == []
    bad = ("model.w", "float32", [2, 3], 12)
    rng = [("rng.rank0", "float32", [3], 1)], [("rng.rank1", "float32", [3], 2)], [("rng.rank2", "float32", [3], 3)]
    got = _shmckpt.replica_divergence([[w, *rng[0]], [bad, *rng[1]], [w, *rng[2]]])
    assert got == [("model.w", [1], [11, 12, 11], 11)]
    # Same name, another shape on one rank: a shard, not a replica.
    shard = ("model.w", "float32", [4], 12)
    assert _shmckpt.replica_divergence([[w], [shard], [w]]) == []


def test_check_replicas_needs_torch_distributed(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - tests run without a process group
        pytest.skip("a process group is initialized")
    with pytest.raises(shmckpt.ConfigError, match="check_replicas needs torch.distributed"):
        shmckpt.Checkpointer(tmp_path, check_replicas=object())


@pytest.mark.parametrize("world,flip,named", [(3, 2, [2]), (3, 0, [0]), (2, 1, [0, 1])])
def test_dcp_writer_names_a_flipped_replica_and_publishes_nothing(tmp_path, world, flip, named):
    """ShmckptWriter(check_replicas=group): DCP writes a replicated tensor on one rank only
    (rank 0 owns ``model.w`` with async_save), so the flipped copy is checksummed by a
    rank that does not write it (flip 2) or by the engine of the rank that does (flip 0)."""
    from ranks_support import run_ranks

    run_ranks(HERE / "dcp_divergence_worker.py", "dcp", world, tmp_path, str(flip))
    reports = [json.loads((tmp_path / f"result-dcp-{r}.json").read_text()) for r in range(world)]
    for res in reports:
        for name in ("clean", "clean_after"):
            assert res[name] == {"ok": True, "published": True, "exists": True, "warnings": []}, name
        for name in ("save_raise", "async_raise"):
            got = res[name]
            assert (got["ok"], got["published"], got["exists"]) == (False, False, False), name
            # DCP gathers every rank's failure: each is the divergence, naming the tensor.
            assert sorted(got["failures"]) == [str(r) for r in range(world)], name
            for f in got["failures"].values():
                assert f["type"] == "ReplicaDivergence", f
                assert (f["tensor"], f["ranks"], f["divergences"]) == ("model.w", named, ["model.w"])
                assert f["crc_ranks"] == list(range(world)) and f["committed"] is False
                assert f"replicas diverge in checkpoint {tmp_path}/ckpts/{name} (not committed)" in f["message"]
                assert f"'model.w' differs on rank(s) {named}" in f["message"]
        warn = res["async_warn"]
        assert (warn["ok"], warn["published"]) == (True, True)
        assert len(warn["warnings"]) == 1
        assert warn["warnings"][0].startswith(
            f"ReplicaDivergenceWarning: replicas diverge in checkpoint {tmp_path}/ckpts/async_warn (committed anyway): "
            f"'model.w' differs on rank(s) {named}"
        )
        # The refused saves left no rank file in the spool, and nothing was published.
        assert res["spool_rank_files"] == []
        assert res["listing"] == ["async_warn", "clean", "clean_after"]


def test_cli_verify_replicas_names_the_odd_rank(tmp_path):
    """``shmckpt verify --replicas``: three ranks save the same ``model.w``; a byte of rank
    2's copy is flipped and its CRC-32C recomputed in the manifest, so every file still
    verifies; the replica comparison names the tensor, the step and rank 2 (exit 1)."""
    import os

    import numpy as np

    from conftest import shmckpt_bin

    exe = shmckpt_bin()
    if exe is None:
        pytest.skip("no shmckpt command line (cargo build --bin shmckpt, or SHMCKPT_BIN)")
    root = tmp_path / "ck"
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    engines = [
        _shmckpt.Engine(str(root), dict(rank=r, world_size=3, staging_capacity=8 << 20, chunk_size=1 << 20, create_root=True))
        for r in range(3)
    ]
    keep = []
    handles = []
    for r, e in enumerate(engines):
        rng = np.full(16, r, dtype=np.uint8)
        keep += [w, rng]
        tensors = [
            ("model.w", "F32", [64, 32], w.__dlpack__(), w.nbytes, -1),
            (f"rng.{r}", "U8", [16], rng.__dlpack__(), rng.nbytes, -1),
        ]
        handles.append(e.save(5, tensors, {}, [], True))
    for h in handles:
        h.wait()
    for e in engines:
        e.close()

    def verify(*args):
        p = subprocess.run([exe, "verify", str(root), *args], capture_output=True, text=True)
        return p.returncode, p.stdout, p.stderr

    code, out, err = verify("--replicas")
    assert code == 0, err
    assert "replicas agree (1 tensors compared)" in out

    step = root / "step-5"
    manifest_path = step / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    f = next(f for f in manifest["files"] if f["rank"] == 2)
    t = next(t for t in f["tensors"] if t["name"] == "model.w")
    path = step / f["file"]
    data = bytearray(path.read_bytes())
    b, e = f["data_start"] + t["data_offsets"][0], f["data_start"] + t["data_offsets"][1]
    data[b + 777] ^= 0x04
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    good = t["crc32c"]
    a = np.frombuffer(bytes(data[b:e]), dtype=np.uint8)
    t["crc32c"] = bad = _shmckpt.crc32c_of(a.copy().__dlpack__())
    assert bad != good
    os.chmod(manifest_path, 0o644)
    manifest_path.write_text(json.dumps(manifest))

    code, out, err = verify()  # every file matches its manifest
    assert code == 0, err
    code, out, err = verify("--replicas")
    assert code == 1
    assert f"FAIL {step}: replicas diverge in step 5: 1 of 1 replicated tensors differ (\"model.w\")" in out
    assert (
        f'     step 5 tensor "model.w" (F32 [64, 32]): rank(s) [0, 1] hold {good:#010x}, rank(s) [2] hold {bad:#010x}; '
        "differs on rank(s) [2]"
    ) in out
    assert "1 of 1 checkpoints failed verification" in err
    code, out, err = verify("--replicas", "--json", "--step", "5")
    assert code == 1
    rep = json.loads(out)
    assert rep["failed"] == 1
    (c,) = rep["checkpoints"]
    assert c["ok"] is False and "replicas diverge in step 5" in c["error"]
    assert c["replicas"] == {
        "step": 5,
        "compared": 1,
        "divergent": [
            {
                "tensor": "model.w",
                "dtype": "F32",
                "shape": [64, 32],
                "crcs": {"0": good, "1": good, "2": bad},
                "odd": [2],
                "majority": good,
            }
        ],
    }
    # A step that does not exist: 3; a bad flag: 2.
    assert verify("--replicas", "--step", "9")[0] == 3
    assert verify("--replicas", "--bogus")[0] == 2
