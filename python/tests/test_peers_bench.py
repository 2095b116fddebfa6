"""benches/replicas/peers_bench.py (issue 25: shmckpt's peer replicas side by side with
NVRx local checkpointing and torchft's peer transfer): its summary arithmetic on samples
with known answers, and its tiny CPU mode end to end in a subprocess (4 ranks over gloo):
the JSON's structure, every system that ran restored its state byte for byte, every system
that did not is a printed ``SKIP``, nothing left in the directories it was given."""

import json
import os
import sys

import pytest

from conftest import REPO
import zygote

BENCH = REPO / "benches" / "replicas" / "peers_bench.py"
MEASURES = {
    "transport": {"exchange_s", "one_way_s"},
    "torchft": {"transfer_s"},
    "shmckpt": {"save_to_k_safe_s", "peer_restore_s"},
    "nvrx": {"save_to_replicated_s", "peer_restore_s"},
}


def bench_module():
    d = str(BENCH.parent)
    if d not in sys.path:
        sys.path.insert(0, d)
    import peers_bench

    return peers_bench


def test_summary_sets_each_round_against_its_own_transport_limit():
    pb = bench_module()
    assert pb.parse_size("64MiB") == 64 << 20 and pb.parse_size("4GiB") == 4 << 30 and pb.parse_size("1g") == 1 << 30
    res = {
        "image_bytes": 1 << 30,
        "samples": {
            "transport": {"exchange_s": [1.0, 2.0, 4.0], "one_way_s": [0.5, 0.5, 1.0]},
            "shmckpt": {"save_to_k_safe_s": [2.0, 2.0, 2.0], "peer_restore_s": [1.0, 0.5, 4.0]},
        },
    }
    s = pb.summarize(res)
    assert set(s) == {"transport.exchange_s", "transport.one_way_s", "shmckpt.save_to_k_safe_s", "shmckpt.peer_restore_s"}
    # per round: limit / measure = 0.5, 1.0, 2.0
    assert s["shmckpt.save_to_k_safe_s"]["x_transport_exchange"] == {"median": 1.0, "min": 0.5, "max": 2.0}
    # per round: 0.5 / 1.0, 0.5 / 0.5, 1.0 / 4.0
    assert s["shmckpt.peer_restore_s"]["x_transport_one_way"] == {"median": 0.5, "min": 0.25, "max": 1.0}
    assert s["shmckpt.peer_restore_s"]["seconds"] == {"median": 1.0, "min": 0.5, "max": 4.0}
    assert s["transport.exchange_s"]["gib_per_s"] == {"median": 0.5, "min": 0.25, "max": 1.0}


def test_tiny_cpu_run_restores_every_system_exactly(tmp_path):
    pytest.importorskip("torch", reason="the benchmark needs torch")
    out, root, nvdir = tmp_path / "out", tmp_path / "root", tmp_path / "nvrx"
    root.mkdir()
    nvdir.mkdir()
    env = dict(os.environ)
    # The child imports what this process imports (the installed package in CI, the
    # source tree with a dev build here): a source tree without its extension would make
    # shmckpt a SKIP, which this test refuses.
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    p = zygote.run(
        # 2 rounds + the warm-up: machine m1 is lost 3 times, its older files already gone
        [sys.executable, str(BENCH), "--sizes", "32MiB", "--rounds", "2", "--out", str(out),
         "--root", str(root), "--nvrx-dir", str(nvdir), "--timeout", "120"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "peers.json").read_text())
    assert set(res) == {"meta", "runs"} and res["meta"]["rounds"] == 2 and res["meta"]["device"] == "cpu"
    (run,) = res["runs"]
    assert run["image_bytes"] == 32 << 20 and run["size_arg"] == 32 << 20
    ran = set(run["samples"])
    # the transport limit and shmckpt always run here; NVRx needs CUDA
    assert {"transport", "shmckpt"} <= ran
    assert "nvrx" in run["skips"] and "nvrx" not in ran
    assert ran | set(run["skips"]) == set(MEASURES) and not ran & set(run["skips"])
    for name, why in run["skips"].items():
        assert f"SKIP {name}: {why}" in p.stdout
    assert set(run["order"]) == ran
    for name in ran:
        assert run["exact"][name] is True, (name, run["exact"])
        assert set(run["samples"][name]) == MEASURES[name]
        for xs in run["samples"][name].values():
            assert len(xs) == 2 and min(xs) > 0
    for name, keys in MEASURES.items():
        for k in keys:
            assert (f"{name}.{k}" in run["summary"]) == (name in ran)
    row = run["summary"]["shmckpt.peer_restore_s"]
    per_round = [lim / x for lim, x in zip(run["samples"]["transport"]["one_way_s"], run["samples"]["shmckpt"]["peer_restore_s"])]
    assert row["x_transport_one_way"]["median"] == pytest.approx(sum(per_round) / 2)
    md = (out / "peers.md").read_text()
    assert "| shmckpt.save_to_k_safe_s |" in md and "| transport.exchange_s |" in md
    # the work directories it made under --root and --nvrx-dir are gone, and so are
    # shmckpt's kept arenas and replicas of its root in the shared /dev/shm
    assert list(root.iterdir()) == [] and list(nvdir.iterdir()) == []
    left = run["shmckpt_shm"]
    assert len(left["kept"]) == 4 and all(n.startswith("shmckpt.keep-") for n in left["kept"])
    assert not any(os.path.lexists(os.path.join("/dev/shm", n)) for n in left["kept"])
    from shmckpt.replicas import list_replicas

    assert [x for x in list_replicas() if x["root_tag"] == left["replica_tag"]] == []
