"""Replica divergence check (``Checkpointer(check_replicas=group)``, docs/guarantees.md):
2 and 3 ranks over gloo save identical replicated tensors, then one rank's ``model.w``
with one bit flipped; the check names that tensor and rank and the step is not committed
(``on_divergence="raise"``), committed with a warning (``"warn"``) or as a callback
decides on every rank. Rank-specific tensors (``rng.rank{r}``, a shard whose shape differs
per rank) are never compared."""

import json
import pathlib
import socket
import subprocess
import sys

import pytest

import shmckpt
from shmckpt import _shmckpt

HERE = pathlib.Path(__file__).resolve().parent
WORKER = str(HERE / "divergence_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(tmp_path, world, flip):
    port = str(free_port())
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(tmp_path / "ck"), str(r), str(world), port, str(outs[r]), str(flip)])
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
