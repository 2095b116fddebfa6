"""benches/replicas/repl_overhead.py (issue 25: what replication costs a training loop):
its analysis on made-up segments with known answers, its segment lengths, and its tiny CPU
mode end to end in a subprocess (a trainer and a partner rank over gloo): every condition
alternated, every checkpoint's durable and k-safe times and the partner's, every
replicated step k-safe on both ranks, nothing left on disk or in /dev/shm."""

import argparse
import json
import os
import sys

import pytest

from conftest import REPO
import zygote

BENCH = REPO / "benches" / "replicas" / "repl_overhead.py"
CONDITIONS = ["baseline", "nb", "nb-repl"]


def modules():
    for d in (REPO / "benches" / "common", REPO / "benches" / "train", BENCH.parent):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    import repl_overhead
    import repl_report

    return repl_overhead, repl_report


def seg(rnd, cond, walls, load=None, step_ms=10.0):
    """A segment whose step i starts at i * step_ms with wall time walls[i]."""
    rows = [[i * step_ms, w, None, 0.5, 0.4, 0, 1] for i, w in enumerate(walls)]
    return {"round": rnd, "cond": cond, "ok": True, "steps": rows, "load": load or {}}


def test_report_counts_the_call_the_first_steps_and_the_steps_during_the_load():
    _, rr = modules()
    # done() first seen at 31 ms, after the commit at 25 ms: the load ends there
    nb = {"stall_s": 0.005, "end_ms": 31.0, "committed_ms": 25.0, "end_s": 0.129, "durable_s": 0.129, "step": 3, "partner": {"durable_s": 0.13, "ksafe_s": None, "start_lag_s": 0.001}}
    repl = {
        "stall_s": 0.010, "end_ms": 45.0, "committed_ms": 25.0, "end_s": 1.0, "durable_s": 0.5, "ksafe_s": 1.0, "step": 4,
        "replication": {"k_safe": True, "transfer_seconds": 0.25},
        "partner": {"durable_s": 0.45, "ksafe_s": 0.99, "k_safe": True, "start_lag_s": 0.002},
    }
    segs = []
    for rnd in (0, 1):
        segs.append(seg(rnd, "baseline", [99.0, 10.0, 10.0, 10.0, 10.0]))
        # the first step (left out of the step statistics) 30 ms, then 3 x 12 ms before its end
        segs.append(seg(rnd, "nb", [30.0, 12.0, 12.0, 12.0, 10.0], nb))
        # durable at 25 ms, k-safe at 45 ms: steps 1-4 during the load, 3-4 during replication
        segs.append(seg(rnd, "nb-repl", [40.0, 11.0, 11.0, 13.0, 13.0, 10.0], repl))
    res = {"meta": {"conditions": CONDITIONS, "skip_first": 1}, "segments": segs}
    s = rr.summarize(res)
    assert res["summary"] is s and set(s["replication"]) == {"nb", "nb-repl"}
    a, b = s["replication"]["nb"]["per_segment"]
    assert (a["round"], b["round"]) == (0, 1) and dict(a, round=1) == b and a["ref_ms"] == 10.0
    # call 5 + first step 30 - 10; later steps started before 31 ms: 3 x 12 over 10 each
    assert (a["call_ms"], a["first_extra_ms"], a["cost_ms"]) == pytest.approx((5.0, 20.0, 25.0))
    assert (a["during_steps"], a["during_extra_ms"], a["total_extra_ms"]) == pytest.approx((3, 6.0, 31.0))
    assert a["overhead_pct"] == pytest.approx(100 * 31.0 / (129.0 - 31.0))
    assert a["cost_pct"] == pytest.approx(100 * 25.0 / (129.0 - 25.0))
    # no replication: no steps "between durable and k-safe" (the step at 30 ms is after the commit)
    assert a["ksafe_s"] is None and a["durable_to_ksafe_s"] is None and a["repl_steps"] == 0 and a["repl_ratio"] is None
    assert a["covered"] and a["k_safe"] is None and a["partner_durable_s"] == 0.13
    r, r1 = s["replication"]["nb-repl"]["per_segment"]
    assert dict(r, round=1) == r1
    assert (r["cost_ms"], r["during_steps"], r["during_extra_ms"]) == pytest.approx((40.0, 4, 8.0))
    assert r["overhead_pct"] == pytest.approx(100 * 48.0 / (1000.0 - 48.0))
    assert (r["repl_steps"], r["repl_ratio"], r["durable_to_ksafe_s"]) == pytest.approx((2, 1.3, 0.5))
    assert r["k_safe"] is True and r["partner_k_safe"] is True and r["transfer_s"] == 0.25 and r["covered"]
    rec = s["replication"]["nb-repl"]
    assert rec["segments"] == 2 and rec["covered"] == 2 and rec["k_safe"] == [True, True]
    assert rec["ksafe_s"] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 2}
    assert s["replication"]["nb"]["k_safe"] is None and s["replication"]["nb"]["ksafe_s"] is None
    # a load that outlasts its segment's steps is flagged
    short = seg(2, "nb-repl", [40.0, 11.0], dict(repl, end_ms=45.0))
    assert rr.segment_cost(short, 1, {1: 10.0, 2: 10.0})["covered"] is False
    md = rr.markdown(dict(res, summary=s))
    lines = md.splitlines()
    assert sum(x.startswith("| nb-repl |") for x in lines) == 5  # overhead, loads, steps, cost, pressure
    assert sum(x.startswith("| nb |") for x in lines) == 5 and sum(x.startswith("| baseline |") for x in lines) == 4
    assert "True/True, True/True" in md


def test_segments_last_their_loads_warm_up_times_the_factor_within_bounds():
    ro, _ = modules()
    a = argparse.Namespace(iters=None, seg_factor=1.25, min_iters=20, max_iters=600, conds=CONDITIONS)
    assert ro.segment_iters(a, {"nb": 6.0, "nb-repl": 16.0}, 0.137) == {"baseline": 55, "nb": 55, "nb-repl": 146}
    a.max_iters = 100
    assert ro.segment_iters(a, {"nb": 0.1, "nb-repl": 16.0}, 0.137) == {"baseline": 20, "nb": 20, "nb-repl": 100}
    a.iters = 7
    assert ro.segment_iters(a, {"nb": 6.0, "nb-repl": 16.0}, 0.137) == {"baseline": 7, "nb": 7, "nb-repl": 7}


def test_tiny_cpu_run_measures_every_condition_and_replicates_every_step(tmp_path):
    pytest.importorskip("torch")
    out, ckdir = tmp_path / "out", tmp_path / "ck"
    ckdir.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--out", str(out), "--dir", str(ckdir)]
    r = zygote.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert os.listdir(ckdir) == []  # the run's roots are gone
    data = json.loads((out / "repl.json").read_text())
    m = data["meta"]
    assert m["conditions"] == CONDITIONS and m["device"] == "cpu"
    assert (m["seg_iters"], m["skip_first"], m["rounds_done"]) == ({"baseline": 6, "nb": 6, "nb-repl": 6}, 1, 2)
    assert data["failed"] == {} and data["skipped"] == []
    nbytes = m["state_bytes"]
    # the warm-ups (steps 1, 2) sized nothing here (--iters), but ran: durable, and k-safe
    assert m["warmup"]["nb"]["step"] == 1 and m["warmup"]["nb-repl"]["replication"]["k_safe"] is True
    segs = data["segments"]
    assert [s["cond"] for s in segs[:3]] == CONDITIONS and [s["cond"] for s in segs[3:]] == ["nb", "nb-repl", "baseline"]
    assert [s["round"] for s in segs] == [0, 0, 0, 1, 1, 1]
    steps = []
    for s in segs:
        assert s["ok"] and len(s["steps"]) == 6
        for row in s["steps"]:
            assert len(row) == 7 and row[1] > 0 and row[2] is None  # no GPU time on CPU
        ld = s["load"]
        if s["cond"] == "baseline":
            assert ld == {}
            continue
        steps.append(ld["step"])
        assert ld["stall_s"] > 0 and ld["bytes"] > nbytes and 0 < ld["durable_s"] <= ld["end_s"]
        peer = ld["partner"]
        assert peer["ok"] is True and peer["durable_s"] > 0 and peer["call_s"] > 0
        if s["cond"] == "nb":
            assert "ksafe_s" not in ld and "replication" not in ld and peer["ksafe_s"] is None and peer["k_safe"] is False
            assert ld["end_s"] >= ld["durable_s"]  # the commit, or done() first seen after a step
        else:
            rep = ld["replication"]
            assert rep["k_safe"] is True and rep["holders"] == {"0": [1], "1": [0]} and rep["problems"] == []
            assert rep["bytes_sent"] == ld["bytes"] and rep["transfer_seconds"] > 0
            assert ld["ksafe_s"] >= ld["durable_s"] and ld["end_s"] == ld["ksafe_s"]
            assert peer["k_safe"] is True and peer["ksafe_s"] >= peer["durable_s"]
    assert steps == [3, 4, 5, 6]  # one step counter: both ranks saved each step once
    summ = data["summary"]
    assert list(summ["conditions"]) == CONDITIONS
    for c in CONDITIONS:
        assert summ["conditions"][c]["segments"] == 2 and summ["conditions"][c]["all"]["steps"] == 10
    rp = summ["replication"]
    assert set(rp) == {"nb", "nb-repl"}
    assert rp["nb-repl"]["k_safe"] == [True, True] and rp["nb-repl"]["ksafe_s"]["n"] == 2 and rp["nb-repl"]["ksafe_s"]["min"] > 0
    assert rp["nb-repl"]["partner_ksafe_s"]["min"] > 0 and rp["nb"]["ksafe_s"] is None
    for c in ("nb", "nb-repl"):
        assert rp[c]["segments"] == 2 and rp[c]["cost_ms"]["n"] == 2 and rp[c]["overhead_pct"]["n"] == 2
    md = (out / "repl.md").read_text()
    assert "| nb-repl | 2 |" in md and "True/True, True/True" in md
    # what the run put in /dev/shm (kept arenas of both ranks, replicas) is gone
    from shmckpt.replicas import list_replicas

    tags = {v["replica_tag"] for v in m["shm"].values()}
    assert len(tags) == 2 and not [x for x in list_replicas() if x["root_tag"] in tags]
    for v in m["shm"].values():
        assert v["kept"] == f"shmckpt.keep-{v['replica_tag']}.r0"
        for q in (0, 1):
            assert not os.path.lexists(f"/dev/shm/shmckpt.keep-{v['replica_tag']}.r{q}")
