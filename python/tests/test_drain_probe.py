"""benches/train/drain_probe.py (issue 24: what slows training steps while a save drains):
its analysis on made-up steps with known answers, and its tiny CPU mode end to end in a
subprocess (every condition, its loads' records, the outputs, nothing left on disk)."""

import json
import os
import sys

import pytest

from conftest import REPO
import zygote

TRAIN = REPO / "benches" / "train"
CONDITIONS = ["baseline", "shm", "shm-w1", "shm-buffered", "shm-nb", "shm-snap", "shm-snap1", "rawdisk", "rawdisk-thread", "crc", "membw", "gil"]
PART_KEYS = {"steps", "median_ms", "ci95_ms", "p90_ms", "ratio", "gpu_ms_median", "gpu_ratio", "launch_ms_median", "launch_ratio", "cpu_ms_median", "nivcsw_per_step", "nvcsw_per_step"}


def report_module():
    for d in (TRAIN, REPO / "benches" / "common"):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    import drain_report

    return drain_report


def seg(rnd, cond, walls, end_ms=None, step_ms=10.0):
    """A segment whose step i starts at i * step_ms with wall time walls[i]."""
    rows = [[i * step_ms, w, w - 1.0, 0.5, 0.4, 0, 1] for i, w in enumerate(walls)]
    return {"round": rnd, "cond": cond, "ok": True, "steps": rows, "load": {} if end_ms is None else {"end_ms": end_ms}}


def test_report_splits_at_the_load_end_and_compares_with_the_adjacent_baselines():
    dr = report_module()
    segs = []
    # baseline: 10 ms in round 0 and 2, 12 ms in round 1 (drift); the load: 11 ms until
    # its end at 40 ms (steps 0..3), then the round's baseline time
    for rnd, b in ((0, 10.0), (1, 12.0), (2, 10.0)):
        segs.append(seg(rnd, "baseline", [99.0] + [b] * 8))
        segs.append(seg(rnd, "shm", [99.0] + [b * 1.1] * 3 + [b] * 5, end_ms=40.0))
    res = {"meta": {"conditions": ["baseline", "shm"], "skip_first": 1}, "segments": segs}
    s = dr.summarize(res)
    assert s["control_split_ms"] == 40.0
    shm, base = s["conditions"]["shm"], s["conditions"]["baseline"]
    assert shm["segments"] == 3 and shm["rounds"] == [0, 1, 2]
    # steps 1..3 start at 10, 20, 30 ms < 40 ms: during; steps 4..8: after
    assert (shm["during"]["steps"], shm["after"]["steps"], shm["all"]["steps"]) == (9, 15, 24)
    # the baseline split at the same place (its control): 3 + 5 steps per segment
    assert (base["during"]["steps"], base["after"]["steps"]) == (9, 15)
    # round 0's reference: mean of rounds 0 and 1 = 11; round 1's: (10 + 12 + 10) / 3
    during = shm["during"]["ratio"]["per_segment"]
    assert during == pytest.approx([11.0 / 11.0, 13.2 / (32.0 / 3), 11.0 / 11.0])
    assert shm["after"]["ratio"]["per_segment"] == pytest.approx([10.0 / 11.0, 12.0 / (32.0 / 3), 10.0 / 11.0])
    # the baseline's own ratio leaves its round out: 10 / 12, 12 / 10, 10 / 12
    assert base["all"]["ratio"]["per_segment"] == pytest.approx([10.0 / 12.0, 1.2, 10.0 / 12.0])
    assert shm["during"]["median_ms"] == 11.0 and shm["all"]["p90_ms"] == 12.0 * 1.1
    assert shm["during"]["gpu_ms_median"] == 10.0 and shm["during"]["launch_ratio"] == 1.0
    # the first (left-out) step of each segment against the adjacent baselines: 99 ms
    # over 11, 32 / 3 and 11 ms (GPU: 98 over 10, 29 / 3 and 10)
    fs = shm["first_steps"]
    assert fs["extra_wall_ms"] == pytest.approx({"median": 88.0, "min": 88.0, "max": 99.0 - 32.0 / 3, "n": 3})
    assert fs["extra_gpu_ms"] == pytest.approx({"median": 88.0, "min": 88.0, "max": 98.0 - 29.0 / 3, "n": 3})
    assert fs["per_checkpoint_ms"] == fs["extra_wall_ms"]  # no save call in these loads
    assert shm["all"]["nvcsw_per_step"] == 1.0
    assert shm["during_over_after"]["median"] == pytest.approx(1.1) and shm["during_over_after"]["segments"] == 3
    assert base["during_over_after"]["median"] == 1.0
    # order statistics: 24 samples, ranks 7 and 18 (1-based) of the sorted walls
    walls = sorted(r[1] for x in segs if x["cond"] == "shm" for r in x["steps"][1:])
    assert shm["all"]["ci95_ms"] == [walls[6], walls[17]] == [10.0, 12.0]
    assert dr.median_ci([1.0] * 5) is None
    lo, hi = dr.boot_median_ci([1.0, 2.0, 3.0])
    assert 1.0 <= lo <= 2.0 <= hi <= 3.0
    md = dr.markdown(dict(res, summary=s, smi={"why": "not on CUDA"}))
    assert sum(line.startswith("| shm |") for line in md.splitlines()) == 3  # steps, system, cost


def test_tiny_cpu_run_reports_every_condition(tmp_path):
    pytest.importorskip("torch")
    out, ckdir = tmp_path / "out", tmp_path / "ck"
    ckdir.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(TRAIN / "drain_probe.py"), "--device", "cpu", "--tiny", "--out", str(out), "--dir", str(ckdir)]
    r = zygote.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert os.listdir(ckdir) == []  # the run's checkpoint directory is gone
    data = json.loads((out / "drain.json").read_text())
    m = data["meta"]
    assert m["conditions"] == CONDITIONS
    assert (m["seg_iters"], m["skip_first"], m["rounds_done"]) == (5, 1, 2)
    assert data["failed"] == {} and data["skipped"] == []
    assert data["smi"] == {"why": "not on CUDA"}
    nbytes = m["state_bytes"]
    segs = [s for s in data["segments"] if not s.get("extra")]
    assert sorted(s["cond"] for s in segs) == sorted(CONDITIONS * 2)
    # round 0 starts with the baseline, round 1 (reversed) ends with it
    assert segs[0]["cond"] == "baseline" and segs[-1]["cond"] == "baseline"
    for s in segs:
        assert s["ok"] and len(s["steps"]) == 5
        for row in s["steps"]:
            assert len(row) == 7 and row[1] > 0 and row[2] is None  # no GPU time on CPU
        ld = s["load"]
        if s["cond"].startswith("shm"):
            assert ld["bytes"] > nbytes and ld["stall_s"] > 0 and ld["end_ms"] >= ld["committed_ms"]
            assert len(ld["report"]["retired"]) == 1  # keep_last=1: the previous step
            if s["cond"] == "shm-buffered":
                assert ld["report"]["direct_io"] is False
            # host tensors: no device snapshot, whatever the variant asked
            assert ld["snapshot"] == {"snapshot_bytes": 0, "snapshot_batched": False}
        elif s["cond"].startswith("rawdisk"):
            assert ld["bytes"] == (nbytes + 4095) // 4096 * 4096
        elif s["cond"] == "crc":
            assert ld["bytes"] == nbytes
        elif s["cond"] == "membw":
            assert ld["bytes"] > 0 and ld["bytes"] % (nbytes // 2) == 0
        elif s["cond"] == "gil":
            assert ld["wakes"] >= 1
        else:
            assert ld == {}
        assert "end_ms" in ld or s["cond"] == "baseline"
        assert s["sys"]["seconds"] > 0 and set(s["sys"]) == {"seconds", "psi_us", "cpu_ticks", "threads_cpu_s"}
    summ = data["summary"]["conditions"]
    assert list(summ) == CONDITIONS
    for c, rec in summ.items():
        assert rec["segments"] == 2
        assert rec["all"]["steps"] == 8 and rec["during"]["steps"] + rec["after"]["steps"] == 8
        for part in ("all", "during", "after"):
            assert set(rec[part]) == PART_KEYS
        a = rec["all"]
        assert a["median_ms"] > 0 and a["p90_ms"] >= a["median_ms"]
        assert a["ci95_ms"][0] <= a["median_ms"] <= a["ci95_ms"][1]
        assert a["ratio"]["median"] > 0 and len(a["ratio"]["per_segment"]) == 2
    md = (out / "drain.md").read_text()
    for c in CONDITIONS:
        assert sum(line.startswith(f"| {c} |") for line in md.splitlines()) == 3, c
