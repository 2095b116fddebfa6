"""benches/train/cadence_overhead.py (issue 38, item 2): the tiny CPU configuration end to
end in a subprocess. It checkpoints what the trainer has after its first steps, weights
and AdamW moments (built before any step, the state held the weights alone: the H200 run
of 2026-12-04 measured 2.73 GiB instead of 8.2), every save lands in memory and the disk
takes some. No timing is asserted."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

BENCH = REPO / "benches" / "train"


def test_the_tiny_run_checkpoints_weights_and_moments(tmp_path):
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--tiny", "--iters", "4", "--out", str(out), "--dir", str(tmp_path / "ck")]
    # The interpreter's own path (the installed package, as the other bench tests do).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(BENCH / "cadence_overhead.py"), *args], check=True, env=env, timeout=300)
    res = json.loads((out / "cadence.json").read_text())

    paths = [str(BENCH), str(REPO / "benches" / "common")]
    sys.path[:0] = paths
    try:
        from train_model import SIZES, Trainer
    finally:
        del sys.path[: len(paths)]
    model = Trainer(dict(SIZES["tiny"]), "cpu", "auto", 1234).model
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    # Per parameter: the weight, exp_avg, exp_avg_sq (fp32, its size) and the step counter
    # (a one-element fp32 tensor).
    assert res["meta"]["tensors"] == 4 * len(params)
    assert res["meta"]["state_bytes"] == 3 * weights + 4 * len(params)
    assert [(c["step_ms_target"], c["every"]) for c in res["configs"]] == [(5.0, 1), (5.0, 2)]
    for c in res["configs"]:
        assert c["rounds"] == 2
        # Every save was waited for (a tiered segment per round); the disk took some.
        assert c["saves"] == 2 * -(-4 // c["every"])
        assert 1 <= c["disk_saves"] <= c["saves"]
    # One checkpointer for both configurations: step numbers go on (1 after the warm-up's
    # 0), never restart into steps the root still holds.
    a, b = (c["steps"] for c in res["configs"])
    assert a == [1, a[0] + res["configs"][0]["saves"] - 1]
    assert b == [a[1] + 1, a[1] + res["configs"][1]["saves"]]
    assert torch is not None
