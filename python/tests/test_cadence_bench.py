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
import zygote

BENCH = REPO / "benches" / "train"


def test_the_tiny_run_checkpoints_weights_and_moments(tmp_path):
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--tiny", "--iters", "4", "--out", str(out), "--dir", str(tmp_path / "ck"),
            "--compare-tuning", '{"copy_ahead": 0}', "--compare-tuning", '{"blocking_sync": true}', "--compare-engine"]
    # The interpreter's own path (the installed package, as the other bench tests do).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    zygote.run([sys.executable, str(BENCH / "cadence_overhead.py"), *args], check=True, env=env, timeout=300)
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
    assert res["meta"]["compare_tuning"] == [{"copy_ahead": 0}, {"blocking_sync": True}]
    for c in res["configs"]:
        assert c["rounds"] == 2
        # Every save was waited for (a tiered segment per round); the disk took some.
        assert c["saves"] == 2 * -(-4 // c["every"])
        assert 1 <= c["disk_saves"] <= c["saves"]
        # The other checkpointers (every device copy queued at once; blocking waits) saved
        # as often, in the same rounds, each into its own root (their steps numbered with
        # the first's).
        for name, tuning in (("compare", '{"copy_ahead": 0}'), ("compare2", '{"blocking_sync": true}')):
            cmp = c[name]
            assert cmp["tuning"] == tuning
            assert cmp["saves"] == c["saves"] and 1 <= cmp["disk_saves"] <= cmp["saves"]
            assert len(cmp["overhead_per_round"]) == len(c["overhead_per_round"]) == 2
        # The engine-only saves (tuples built once, straight into Engine.save) too.
        eng = c["engine"]
        assert eng["saves"] == c["saves"] and 1 <= eng["disk_saves"] <= eng["saves"]
        assert len(eng["overhead_per_round"]) == 2 and eng["stall_ms_median"] is not None
        # Per segment: every step timed, and the GC's collections counted (each of the
        # oldest generation with its step, length and thread).
        for cond in ("baseline", "tiered", "compare", "compare2", "engine"):
            segs = c["segments"][cond]
            assert len(segs) == 2 and all(len(sg["steps_ms"]) == 4 for sg in segs)
            for sg in segs:
                assert len(sg["gc_collections"]) == 3 and min(sg["gc_collections"]) >= 0
                assert len(sg["gc_full"]) <= sg["gc_collections"][2]
                assert all(0 <= f["step"] < 4 and f["ms"] >= 0 and f["thread"] for f in sg["gc_full"])
    # The same checkpointers for both configurations: step numbers go on (1 after the
    # warm-up's 0), never restart into steps the roots still hold.
    a, b = (c["steps"] for c in res["configs"])
    assert a == [1, a[0] + 4 * res["configs"][0]["saves"] - 1]
    assert b == [a[1] + 1, a[1] + 4 * res["configs"][1]["saves"]]
    table = (out / "cadence.md").read_text()
    assert table.count('({"copy_ahead": 0})') == 2, table
    assert table.count('({"blocking_sync": true})') == 2, table
    assert table.count("(engine only)") == 2, table
    assert torch is not None


def test_the_probe_times_every_step_of_each_mode_on_cpu(tmp_path):
    """benches/train/cadence_probe.py: the tiny CPU configuration, two modes, one kept
    round of three steps, the forward a calibrated run of tiny ops (``--launch-bound``):
    one row per step of each mode, one report per save (none for
    the baseline ``off``), its table in the markdown. No timing is asserted."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--state", "tiny", "--steps", "3", "--rounds", "1", "--modes", "off,none,at-call,all-queued",
            "--window-ms", "2", "--launch-bound", "--dir", str(tmp_path / "ck"), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-W", "error::DeprecationWarning", str(BENCH / "cadence_probe.py"), *args],
                   check=True, env=env, timeout=300)
    res = json.loads((out / "cadence_probe.json").read_text())
    assert {m: len(r) for m, r in res["rows"].items()} == {"off": 3, "none": 3, "at-call": 3, "all-queued": 3}
    assert {m: len(s) for m, s in res["saves"].items()} == {"off": 0, "none": 3, "at-call": 3, "all-queued": 3}
    assert all(r["call"] is None and r["engine"] is None for r in res["rows"]["off"])
    # Every save's engine call is timed, deferred or not; at the call it is inside it.
    assert all(r["engine"] > 0 and r["call"] > 0 for r in res["rows"]["none"])
    assert all(r["engine"] > 0 and r["call"] >= r["engine"] for r in res["rows"]["at-call"])
    assert all(s["staging"] >= s["backpressure"] >= 0 for m in ("none", "at-call", "all-queued") for s in res["saves"][m])
    table = (out / "cadence_probe.md").read_text().splitlines()
    assert any("forward+backward 2 ms (launches)" in line for line in table), table[:4]
    modes = [line.split("|")[1].strip() for line in table if line.startswith(("| o", "| n", "| a"))]
    assert modes == ["off", "none", "at-call", "all-queued"]


def test_the_trace_reports_each_step_with_its_host_ranges(tmp_path):
    """benches/train/cadence_trace.py on CPU (tiny model, 2 rounds of 2 steps per mode): one
    row per traced step, in the order the rounds ran them (round 0 without saves first,
    round 1 with them), each step's host ranges read back from the profiler's trace (a
    CPU trace has no kernels or copies); only the steps with a save have a save call, and
    the guard's wait ran inside the optimizer step. No timing is asserted."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--state", "tiny", "--steps", "2", "--rounds", "2", "--out", str(out), "--dir", str(tmp_path / "ck")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    zygote.run([sys.executable, str(BENCH / "cadence_trace.py"), *args], check=True, env=env, timeout=300)
    res = json.loads((out / "trace_steps.json").read_text())
    order = [(r["round"], r["step"]) for r in res["rows"]]
    assert order == [
        (0, "step:none:0"), (0, "step:none:1"), (0, "step:save:0"), (0, "step:save:1"),
        (1, "step:save:0"), (1, "step:save:1"), (1, "step:none:0"), (1, "step:none:1"),
    ]
    for r in res["rows"]:
        saved = r["step"].startswith("step:save:")
        assert ("save_call_ms" in r) == saved, r
        for name in ("fwd_bwd", "opt_step", "guard_wait", "sync"):
            assert r[f"{name}_ms"] >= 0, (name, r)
        # Inside the step, in the loop's order.
        assert 0 <= r["fwd_bwd_at_ms"] <= r["opt_step_at_ms"] <= r["guard_wait_at_ms"] <= r["sync_at_ms"] <= r["host_ms"], r
        assert "kernels_from_ms" not in r and "copies" not in r, r
    assert set(res["summary"]) == {"none@0", "save@0"} and "save_call_ms" in res["summary"]["save@0"]
    assert "save_call_ms" not in res["summary"]["none@0"]


def test_the_trace_saves_every_n_steps_at_the_step_end(tmp_path):
    """``--every 2 --call-at end``: in a saving block only every second step calls save,
    after its optimizer step (the guard's wait of the next step then holds the save); the
    summary has one entry per position in the cycle, the save's call only at position 0."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--state", "tiny", "--steps", "4", "--rounds", "1", "--every", "2", "--call-at", "end",
            "--out", str(out), "--dir", str(tmp_path / "ck")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    zygote.run([sys.executable, str(BENCH / "cadence_trace.py"), *args], check=True, env=env, timeout=300)
    res = json.loads((out / "trace_steps.json").read_text())
    assert (res["meta"]["every"], res["meta"]["call_at"], res["meta"]["snapshot"]) == (2, "end", "none")
    saving = [r for r in res["rows"] if r["step"].startswith("step:save:")]
    assert [r["step"] for r in saving] == [f"step:save:{i}" for i in range(4)]
    assert ["save_call_ms" in r for r in saving] == [True, False, True, False]
    for r in saving[::2]:
        assert r["opt_step_at_ms"] <= r["save_call_at_ms"] <= r["sync_at_ms"], r
    assert set(res["summary"]) == {"none@0", "none@1", "save@0", "save@1"}
    assert "save_call_ms" in res["summary"]["save@0"] and "save_call_ms" not in res["summary"]["save@1"]


def test_the_tiny_run_calls_save_at_the_step_end(tmp_path):
    """``--call-at end``: each save is called after its step's optimizer step is queued
    (before the step's synchronization); every save is still made, waited for and counted,
    the engine-only condition's too, and the placement is recorded."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--tiny", "--iters", "4", "--call-at", "end", "--compare-engine",
            "--out", str(out), "--dir", str(tmp_path / "ck")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    zygote.run([sys.executable, str(BENCH / "cadence_overhead.py"), *args], check=True, env=env, timeout=300)
    res = json.loads((out / "cadence.json").read_text())
    assert [(c["every"], c["call_at"]) for c in res["configs"]] == [(1, "end"), (2, "end")]
    for c in res["configs"]:
        assert c["rounds"] == 2
        assert c["saves"] == 2 * -(-4 // c["every"])
        assert 1 <= c["disk_saves"] <= c["saves"]
        assert c["engine"]["saves"] == c["saves"]
        assert len(c["overhead_per_round"]) == len(c["engine"]["overhead_per_round"]) == 2
        # Every step and save of every segment, per condition: one segment per round.
        seg = c["segments"]
        assert sorted(seg) == ["baseline", "engine", "tiered"]
        for cond, segs in seg.items():
            assert [x["round"] for x in segs] == [0, 1]
            assert all(len(x["steps_ms"]) == 4 and all(t > 0 for t in x["steps_ms"]) for x in segs)
            want = 0 if cond == "baseline" else -(-4 // c["every"])
            assert [len(x["saves"]) for x in segs] == [want, want]
        tiered = [sv for x in seg["tiered"] for sv in x["saves"]]
        assert sum(sv["disk"] for sv in tiered) == c["disk_saves"]
        assert all(sv["staging_ms"] >= 0 and sv["backpressure_ms"] >= 0 for sv in tiered)


def test_the_gc_probe_counts_collections_and_times_every_iteration(tmp_path):
    """benches/train/gc_probe.py end to end, small: every round reports the collections of
    the three generations over its iterations and their times. The probe's point (no
    collection of the oldest generation from the saves) is asserted by
    ``test_deferred.py::test_preparing_the_next_save_promotes_nothing_to_the_oldest_generation``;
    no timing is asserted."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    args = ["--params", "40", "--iters", "12", "--warmup", "4", "--rounds", "2", "--disk-every", "3",
            "--dir", str(tmp_path / "ck"), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    zygote.run([sys.executable, str(BENCH / "gc_probe.py"), *args], check=True, env=env, timeout=300)
    res = json.loads((out / "gc_probe.json").read_text())
    assert res["args"]["iters"] == 12 and len(res["rounds"]) == 2
    for r in res["rounds"]:
        assert len(r["collections"]) == 3 and all(c >= 0 for c in r["collections"])
        assert 0 < r["iter_ms_median"] <= r["iter_ms_p99"] <= r["iter_ms_max"]
        assert 0 <= r["iters_over_100ms"] <= 12
    assert not (tmp_path / "ck").exists()  # each round's root removed
