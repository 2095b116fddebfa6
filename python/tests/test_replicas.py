"""Peer replicas (docs/replicas.md): 4 ranks over gloo on one host, simulating 2 machines
with ``node=`` (ranks 0-1 on "m0", 2-3 on "m1"; partners 0->2, 1->3, 2->0, 3->1).

These runs share the host's /dev/shm: "losing" machine 1 removes its ranks' kept arenas,
the replicas it held and its ranks' files under the root, each by its exact name. The
arenas and replicas of each test's own root are removed at its end.
"""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import shmckpt
from shmckpt import _shmckpt
from shmckpt.replicas import remove_replica

from conftest import REPO, free_port, shmckpt_bin
from test_remote import moto, s3  # noqa: F401  (fixtures)
from replica_support import WORLD, droot, kept_name, namespaces_missing, our_replicas, remove_arenas_of, save_rank_step  # noqa: F401 (droot: a fixture)
import zygote

HERE = pathlib.Path(__file__).resolve().parent
WORKER = str(HERE / "replica_worker.py")
DRILL = REPO / "examples" / "replica_drill.py"


def run_world(tmp_path, root, mode, replicas, *steps, tag="run", prefix=None, env=None, codes_want=None):
    """Run the 4 ranks (rank r under the command prefix ``prefix(r)``: e.g. ``nsenter``
    into its machine's mount namespace) to completion; their JSON reports."""
    port = str(free_port())
    outs = [tmp_path / f"{tag}-{mode}-{r}.json" for r in range(WORLD)]
    procs = [
        zygote.spawn(
            (prefix(r) if prefix else [])
            + [sys.executable, WORKER, mode, str(root), str(r), str(WORLD), port, str(outs[r]), str(replicas)]
            + [str(s) for s in steps],
            env=None if env is None else {**os.environ, **env},
        )
        for r in range(WORLD)
    ]
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == (codes_want or [0] * WORLD)
    return [json.loads(o.read_text()) if o.exists() else None for o in outs]


def file_sizes(root, step):
    """Every rank's file size in ``step``'s manifest."""
    m = json.loads((root / f"step-{step}" / "manifest.json").read_text())
    return {f["rank"]: f["bytes"] for f in m["files"]}


def lose_machine_1(root, steps, replica_step=None):
    """Machine 1 (ranks 2, 3) is gone: its kept arenas, the replicas it held (of ranks 0
    and 1, of ``replica_step``, default the last step) and its ranks' files of every step."""
    for r in (2, 3):
        (pathlib.Path("/dev/shm") / kept_name(root, r)).unlink()
    last = max(steps)
    held = last if replica_step is None else replica_step
    for src in (0, 1):
        remove_replica(_shmckpt.replica_name(str(root), src, held))
    m = json.loads((root / f"step-{last}" / "manifest.json").read_text())
    names = {f["rank"]: f["file"] for f in m["files"]}
    for s in steps:
        for r in (2, 3):
            (root / f"step-{s}" / names[r]).unlink()
    assert our_replicas(root) == [(2, held), (3, held)]
    return names


def test_plan_is_a_ring_across_machines():
    assert _shmckpt.replica_plan(["m0", "m0", "m1", "m1"], 1) == [[2], [3], [0], [1]]
    assert _shmckpt.replica_plan(["a", "b", "c", "a", "b", "c"], 2) == [[1, 2], [2, 0], [0, 1], [4, 5], [5, 3], [3, 4]]
    with pytest.raises(shmckpt.ConfigError, match="needs at least 2 machines"):
        _shmckpt.replica_plan(["m0", "m0", "m0", "m0"], 1)


def test_refused_replication_settings_close_the_engine(root):
    """replicas=1 on a world of one machine is a ConfigError, and the engine opened before
    the check is closed (its root lock released), even while the error is still held."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(shmckpt.ConfigError, match="needs at least 2 machines") as held:
            shmckpt.Checkpointer(
                root,
                tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20),
                replicas=shmckpt.Replicas(k=1, node="only"),
            )
        ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20))
        ck.close()
        del held
    finally:
        dist.destroy_process_group()


def test_lost_machine_is_restored_from_peers(tmp_path, droot):
    root = droot
    saved = run_world(tmp_path, root, "save", 1, 1, 2, 3)
    for r, res in enumerate(saved):
        assert res["shm_name"] == kept_name(root, r)
        assert [rep["step"] for rep in res["reports"]] == [1, 2, 3]
        for rep in res["reports"]:
            assert rep["k_safe"] is True
            assert rep["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
            assert rep["problems"] == []
            # Sent from the save's staging chunks, held since its commit: no file read.
            size = file_sizes(root, rep["step"])[r]
            assert rep["bytes_sent"] == size
            assert rep["sent_from"] == {"staging": size, "copied": 0, "file": 0}
    # Only the newest step's replica of each rank is kept.
    assert our_replicas(root) == [(0, 3), (1, 3), (2, 3), (3, 3)]

    names = lose_machine_1(root, [1, 2, 3])
    loaded = run_world(tmp_path, root, "load", 1)
    for r, res in enumerate(loaded):
        assert "error" not in res, res
        assert res["step"] == 3
        assert res["exact"] is True
    assert [res["source"] for res in loaded] == [["memory", None], ["memory", None], ["peer", 0], ["peer", 1]]
    # The lost ranks' files of the loaded step are back: the manifest's size, header and
    # every CRC-32C (read and checked by the same code that checks replicas).
    m = json.loads((root / "step-3" / "manifest.json").read_text())
    for f in m["files"]:
        assert (root / "step-3" / names[f["rank"]]).stat().st_size == f["bytes"]
        assert np.asarray(_shmckpt.replica_read_committed(str(root), 3, f["rank"])).size == f["bytes"]
    for s in (1, 2):
        assert not (root / f"step-{s}" / names[2]).exists()


def test_lost_machine_load_into_from_peers(tmp_path, droot):
    """``load_into`` is collective with replicas, as ``load`` is: machine 1's ranks get
    their files from their partners' replicas, then fill the caller's tensors (every
    CRC-32C checked) bit-exactly."""
    root = droot
    run_world(tmp_path, root, "save", 1, 1, 2)
    lose_machine_1(root, [1, 2])
    loaded = run_world(tmp_path, root, "load", 1, env={"REPLICA_WORKER_LOAD_INTO": "1"})
    for res in loaded:
        assert "error" not in res, res
        assert res["step"] == 2 and res["exact"] is True
    # load_into sets no source of its own; the peer's is said.
    assert [res["source"] for res in loaded] == [None, None, ["peer", 0], ["peer", 1]]


@pytest.mark.parametrize("into", [False, True])
def test_a_file_damaged_inside_is_restored_from_a_peer(tmp_path, droot, into):
    """Rank 2's file of the step has the manifest's size but a flipped byte inside, and
    no kept image serves it: its read fails the checksum, its partner's replica replaces
    the file (written back, checked), and the load (or ``load_into``) is bit-exact."""
    root = droot
    run_world(tmp_path, root, "save", 1, 1, 2)
    (pathlib.Path("/dev/shm") / kept_name(root, 2)).unlink()
    m = json.loads((root / "step-2" / "manifest.json").read_text())
    entry = {f["rank"]: f for f in m["files"]}[2]
    path = root / "step-2" / entry["file"]
    good = path.read_bytes()
    raw = bytearray(good)
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    env = {"REPLICA_WORKER_LOAD_INTO": "1"} if into else None
    loaded = run_world(tmp_path, root, "load", 1, env=env)
    for res in loaded:
        assert "error" not in res, res
        assert res["step"] == 2 and res["exact"] is True
    mem = None if into else ["memory", None]  # load_into sets no source of its own
    assert [res["source"] for res in loaded] == [mem, mem, ["peer", 0], mem]
    assert path.read_bytes() == good  # repaired


def test_replication_runs_in_the_background(tmp_path, droot):
    """Saves return at once and are replicated in order by the replication thread;
    wait_replicated() of any step, in any order (newest first here), returns its report."""
    root = droot
    saved = run_world(tmp_path, root, "save", 1, 1, 2, 3, env={"REPLICA_WORKER_NOWAIT": "1"})
    for res in saved:
        assert [rep["step"] for rep in res["reports"]] == [3, 2, 1]
        for rep in res["reports"]:
            assert rep["k_safe"] is True and rep["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
    assert our_replicas(root) == [(0, 3), (1, 3), (2, 3), (3, 3)]
    lose_machine_1(root, [1, 2, 3])
    loaded = run_world(tmp_path, root, "load", 1)
    assert [res["source"] for res in loaded] == [["memory", None], ["memory", None], ["peer", 0], ["peer", 1]]
    assert all(res["exact"] is True and res["step"] == 3 for res in loaded)


def test_tampered_replica_is_refused(tmp_path, droot):
    root = droot
    run_world(tmp_path, root, "save", 1, 4, 5)
    names = lose_machine_1(root, [4, 5])
    # Damage one byte of the data section of rank 2's replica (held on machine 0).
    bad = pathlib.Path("/dev/shm") / _shmckpt.replica_name(str(root), 2, 5)
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0x01
    bad.write_bytes(bytes(raw))
    with pytest.raises(shmckpt.ChecksumError):
        _shmckpt.replica_load(str(root), 5, 2)

    loaded = run_world(tmp_path, root, "load", 1)
    assert [res.get("source") for res in loaded[:2]] == [["memory", None], ["memory", None]]
    assert loaded[3]["source"] == ["peer", 1] and loaded[3]["exact"] is True
    # Rank 2: no partner holds a replica that passes the checks, and its disk file is gone.
    assert "source" not in loaded[2]
    assert loaded[2]["error"] == "ReplicationError"
    assert names[2] in loaded[2]["message"] and "passes the checks" in loaded[2]["message"]
    assert not (root / "step-5" / names[2]).exists()


@pytest.mark.parametrize("delta", [1, -1])
def test_a_partner_lying_about_its_size_is_refused(tmp_path, droot, delta):
    """Rank 0 announces and sends one byte more (or less) than its committed file of step 1
    holds. Its partner, rank 2, posts no receive for it (before, gloo aborted rank 2 with
    SIGABRT on the larger message, its replica arena left in /dev/shm): every rank exits
    normally with ReplicationError naming both sizes; the other images are held, and no
    replica of rank 0 and no unfinished arena is left behind."""
    root = droot
    saved = run_world(
        tmp_path, root, "save", 1, 1, env={"REPLICA_WORKER_LIE": f"0:{delta}", "REPLICA_WORKER_TIMEOUT": "20"}
    )
    n = file_sizes(root, 1)[0]
    piece = 51 << 20  # 50 ms at the default 1 GiB/s, in whole 1 MiB staging chunks
    why = (
        f"rank 2 refused rank 0's image of step 1 before any byte of it came: rank 0 announced "
        f"{n + delta} bytes in pieces of {piece}, rank 2 expects {n} bytes in pieces of {piece}"
    )
    for res in saved:
        assert res["error"] == "ReplicationError" and res["failed_step"] == 1
        (f,) = res["failures"]
        assert f["message"] == f"step 1 is not 1-safe: held by {{0: []}}; {why}"
    assert our_replicas(root) == [(1, 1), (2, 1), (3, 1)]
    tag = _shmckpt.replica_tag(str(root))
    assert sorted(pathlib.Path("/dev/shm").glob(f"shmckpt-replica.{tag}.*")) == sorted(
        pathlib.Path("/dev/shm") / _shmckpt.replica_name(str(root), q, 1) for q in (1, 2, 3)
    )


def test_replica_of_another_user_is_refused(droot):
    """A replica under the right name but owned by another user is never served, and
    `remove_replica` leaves it alone."""
    if os.geteuid() != 0:
        if os.environ.get("SHMCKPT_REQUIRE_ROOT") == "1":
            pytest.fail("SHMCKPT_REQUIRE_ROOT=1 but not root (chown needs it)")
        pytest.skip("needs root to give a file to another user (SHMCKPT_REQUIRE_ROOT=1 makes this a failure)")
    root = droot
    save_rank_step(root, 0, 2)
    good = np.asarray(_shmckpt.replica_read_committed(str(root), 2, 0)).tobytes()
    name = _shmckpt.replica_store(str(root), 2, 0, good)
    shm = pathlib.Path("/dev/shm") / name
    os.chown(shm, 65534, 65534)
    try:
        with pytest.raises(shmckpt.UnsafePath, match="uid 65534"):
            _shmckpt.replica_load(str(root), 2, 0)
        with pytest.raises(shmckpt.UnsafePath):
            remove_replica(name)
        assert shm.exists()
    finally:
        shm.unlink()


def test_partner_killed_before_replicating(tmp_path, droot):
    """Rank 3 dies once its save of step 2 is durable, before replicating it: every other
    rank's wait_replicated() raises ReplicationError (step 2 is never reported 2-safe), the
    replicas held stay step 1's. After machine 1 is lost, "latest" is step 1, the newest
    step every rank can load (machine 1's ranks from their partners' replicas; nothing of
    step 1 is served for step 2); step 2 is set aside (renamed, its files kept), so the
    resumed run saves step 2 again."""
    root = droot
    saved = run_world(
        tmp_path, root, "save", 1, 1, 2, env={"REPLICA_WORKER_DIE": "3:2"}, codes_want=[0, 0, 0, -9]
    )
    assert saved[3] is None
    for res in saved[:3]:
        assert [rep["step"] for rep in res["reports"]] == [1]
        assert res["reports"][0]["k_safe"] is True
        assert (res["error"], res["failed_step"]) == ("ReplicationError", 2)
    assert our_replicas(root) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").exists()) == [1, 2]

    names = lose_machine_1(root, [1, 2], replica_step=1)
    loaded = run_world(tmp_path, root, "load", 1)
    for res in loaded:
        assert "error" not in res, res
        assert res["step"] == 1 and res["exact"] is True
    # Ranks 0-1 keep step 2 in memory: step 1 comes from their files.
    assert [res["source"][0] for res in loaded[:2]] == ["disk", "disk"]
    assert [res["source"] for res in loaded[2:]] == [["peer", 0], ["peer", 1]]
    assert our_replicas(root) == [(2, 1), (3, 1)]
    assert not (root / "step-2").exists()
    (aside,) = root.glob("step-2.aside-*")
    assert json.loads((aside / "manifest.json").read_text())["step"] == 2
    assert sorted(p.name for p in aside.glob("*.safetensors")) == [names[0], names[1]]
    saved = run_world(tmp_path, root, "save", 1, 2, tag="again")
    for res in saved:
        assert [(rep["step"], rep["k_safe"]) for rep in res["reports"]] == [(2, True)]
    assert aside.is_dir()  # never cleaned by the engines


def test_a_lost_rank_without_a_replica_reads_the_bucket(tmp_path, droot, s3):
    """Machine 1 is lost before the replicas of the last step were stored (they are
    removed here), but the step is in the bucket: "latest" is still that step, and machine
    1's ranks read it from the bucket (the same bytes as the committed manifest says)."""
    root = droot
    bucket = s3[1]
    env = {"REPLICA_WORKER_REMOTE": f"s3://{bucket}/rep"}
    run_world(tmp_path, root, "save", 1, 1, 2, env=env)
    # A manifest.json planted deeper under a step name is no step (the disk's rule):
    # "latest" stays step 2.
    client, _ = s3
    client.put_object(Bucket=bucket, Key="rep/step-99/notes/manifest.json", Body=b'{"step": 99}')
    lose_machine_1(root, [1, 2])
    for src in (2, 3):
        remove_replica(_shmckpt.replica_name(str(root), src, 2))
    loaded = run_world(tmp_path, root, "load", 1, env=env)
    for res in loaded:
        assert "error" not in res, res
        assert res["step"] == 2 and res["exact"] is True
    assert [res["source"] for res in loaded[:2]] == [["memory", None], ["memory", None]]
    assert [res["source"][0] for res in loaded[2:]] == ["remote", "remote"]


def test_cli_lists_and_removes_replicas(droot):
    """`shmckpt shm replicas` lists a replica with its source rank and step, and a dead
    writer's temporary file as unfinished; `shmckpt shm rm NAME` removes either."""
    exe = shmckpt_bin()
    if exe is None:
        pytest.skip("no shmckpt binary (cargo build --bin shmckpt, or SHMCKPT_BIN)")
    root = droot
    save_rank_step(root, 0, 4)
    good = np.asarray(_shmckpt.replica_read_committed(str(root), 4, 0)).tobytes()
    name = _shmckpt.replica_store(str(root), 4, 0, good)
    out = subprocess.run([exe, "shm", "replicas", "--json"], capture_output=True, text=True, check=True)
    mine = [r for r in json.loads(out.stdout) if r["name"] == name]
    assert mine == [
        {
            "name": name,
            "bytes": len(good),
            "owner_uid": os.geteuid(),
            "root_tag": _shmckpt.replica_tag(str(root)),
            "source_rank": 0,
            "step": 4,
        }
    ]
    text = subprocess.run([exe, "shm", "replicas"], capture_output=True, text=True, check=True).stdout
    assert any(line.startswith(name) and "source rank 0  step 4" in line for line in text.splitlines())
    rm = subprocess.run([exe, "shm", "rm", name], capture_output=True, text=True)
    assert rm.returncode == 0, rm.stderr
    assert rm.stdout.strip() == f"removed {name}"
    assert our_replicas(root) == []
    # A temporary file left by a writer that died (pid above the kernel's maximum) is
    # listed as unfinished, never as a replica, and removed by name.
    tmp = f"{name}.tmp{(1 << 22) + 1}"
    with open(f"/dev/shm/{tmp}", "wb") as f:
        f.write(good[:100])
    out = subprocess.run([exe, "shm", "replicas", "--json"], capture_output=True, text=True, check=True)
    assert [r for r in json.loads(out.stdout) if r["name"] == tmp] == [
        {
            "name": tmp,
            "bytes": 100,
            "owner_uid": os.geteuid(),
            "unfinished": True,
            "replica": name,
            "writer_pid": (1 << 22) + 1,
            "writer_alive": False,
        }
    ]
    assert our_replicas(root) == []
    rm = subprocess.run([exe, "shm", "rm", tmp], capture_output=True, text=True)
    assert rm.returncode == 0, rm.stderr
    assert not os.path.exists(f"/dev/shm/{tmp}")


def test_rank_dead_during_load(tmp_path, droot):
    """A rank that dies instead of joining the collective load: the others get
    ReplicationError (not a bare torch error), nothing is restored."""
    root = droot
    run_world(tmp_path, root, "save", 1, 1)
    names = lose_machine_1(root, [1])
    loaded = run_world(tmp_path, root, "load", 1, env={"REPLICA_WORKER_DIE": "3:load"}, codes_want=[0, 0, 0, -9])
    assert loaded[3] is None
    for res in loaded[:3]:
        assert res["error"] == "ReplicationError" and "replication group failed" in res["message"]
    assert not (root / "step-1" / names[2]).exists()


def test_replicas_zero_is_unchanged(tmp_path, droot):
    root = droot
    saved = run_world(tmp_path, root, "save", 0, 1, 2)
    assert [res["wait_replicated"] for res in saved] == ["ConfigError"] * WORLD
    assert our_replicas(root) == []
    loaded = run_world(tmp_path, root, "load", 0)
    for res in loaded:
        assert res["exact"] is True and res["step"] == 2
        assert res["source"] == ["memory", None]
    assert our_replicas(root) == []


def namespaces_or_skip():
    why = namespaces_missing()
    if why is None:
        return
    if os.environ.get("SHMCKPT_REQUIRE_NS") == "1":
        pytest.fail(f"SHMCKPT_REQUIRE_NS=1 but {why}")
    pytest.skip(f"{why} (SHMCKPT_REQUIRE_NS=1 makes this a failure)")


def run_drill(*args):
    """Run the failure drill (examples/replica_drill.py: each simulated machine a mount
    namespace with its own /dev/shm) with small sizes, steps 1-3; it must exit 0, and its
    last line is its JSON report."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(DRILL), "--steps", "3", "--mib", "0.25", "--timeout", "120", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, f"{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    report = json.loads(p.stdout.splitlines()[-1])
    assert report["ok"] is True and report["problems"] == []
    assert (report["namespaces"], report["world"], report["local_world_size"]) == (True, 4, 2)
    assert "PASS: every rank loaded step 3 bit-exactly" in p.stdout
    return report


def assert_drill_saves_and_loads(report):
    """Steps 1-3 1-safe on every rank with the ring's holders; after machine 1 is lost and
    replaced (its fresh /dev/shm empty), every rank loads step 3 bit-exactly, ranks 0-1 from
    their own memory, ranks 2-3 from their partners' replicas, whose files are written back."""
    for r, res in enumerate(report["saved"]):
        assert (res["rank"], res["exit_status"]) == (r, 0)
        assert [rep["step"] for rep in res["reports"]] == [1, 2, 3]
        for rep in res["reports"]:
            assert rep["k_safe"] is True and rep["problems"] == []
            assert rep["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
            # Sent out of the save's staging memory (a view, or a copy where the arena's
            # ring wraps), never read back from the file.
            assert rep["sent_from"]["file"] == 0 and sum(rep["sent_from"].values()) == rep["bytes_sent"] > 0
    assert report["shm_fresh"] == []
    for r, res in enumerate(report["loaded"]):
        assert (res["rank"], res["exit_status"]) == (r, 0)
        assert "error" not in res, res
        assert res["step"] == 3 and res["exact"] is True and res["problems"] == []
    assert [res["source"] for res in report["loaded"]] == [["memory", None], ["memory", None], ["peer", 0], ["peer", 1]]
    assert report["restored_files"] == {"2": True, "3": True}


def entries_digest(files):
    """The drill's digest of a manifest's entries (replica_drill.entries_digest)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def test_drill_private_shm_per_machine(root):
    """The failure drill with a private /dev/shm per machine, run as the script users run
    (examples/replica_drill.py): machine 1 is lost (its namespace, so its /dev/shm, is gone;
    its ranks' files are removed) and replaced by a fresh one; all 4 ranks restart and load
    the latest step bit-exactly."""
    namespaces_or_skip()
    report = run_drill("--root", str(root))
    assert report["mode"] == "shared" and report["roots"] == [str(root), str(root)]
    assert_drill_saves_and_loads(report)
    tag = _shmckpt.replica_tag(str(root))
    rep = lambda q: f"shmckpt-replica.{tag}.r{q}.s3"  # noqa: E731
    # Each machine's /dev/shm after the saves: its ranks' kept arenas, its partners' replicas.
    assert report["shm_after_save"] == {
        "0": sorted([kept_name(root, 0), kept_name(root, 1), rep(2), rep(3)]),
        "1": sorted([kept_name(root, 2), kept_name(root, 3), rep(0), rep(1)]),
    }
    assert [res["shm_name"] for res in report["saved"]] == [kept_name(root, r) for r in range(WORLD)]
    # Nothing in the host's /dev/shm.
    assert our_replicas(root) == []
    assert not any((pathlib.Path("/dev/shm") / kept_name(root, r)).exists() for r in range(WORLD))
    # Machine 1's loss removed exactly its ranks' files of every step.
    m = json.loads((root / "step-3" / "manifest.json").read_text())
    names = {f["rank"]: f["file"] for f in m["files"]}
    assert report["lost"] == {
        "machine": 1, "ranks": [2, 3],
        "removed": [str(root / f"step-{s}" / names[r]) for s in (1, 2, 3) for r in (2, 3)],
    }
    # The lost ranks' files of step 3 are back (size, header and every CRC-32C checked);
    # those of steps 1-2 are not.
    for f in m["files"]:
        assert (root / "step-3" / names[f["rank"]]).stat().st_size == f["bytes"]
        assert np.asarray(_shmckpt.replica_read_committed(str(root), 3, f["rank"])).size == f["bytes"]
    for s in (1, 2):
        assert not (root / f"step-{s}" / names[2]).exists() and not (root / f"step-{s}" / names[3]).exists()


def test_partner_killed_mid_transfer(tmp_path, droot):
    """Replication at 256 KiB/s per rank (pieces of 64 KiB: staging chunks of 64 KiB) with a 5 s group timeout; rank 3
    dies once the first piece of its image of step 2 is sent. Step 2 is never reported
    1-safe: rank 1 (its partner) gets a ReplicationError naming rank 3, every survivor's
    within the timeout; the survivors' save of step 3 completes and its replication is
    skipped at once (ReplicationError saying why). After machine 1 is lost, rank 2 loads
    step 2 bit-exactly from the replica rank 0 stored (that pair's transfer completed), ranks
    0-1 from disk (their kept arenas hold the uncommitted step 3), and
    rank 3 gets ReplicationError: its cut transfer was never stored, and its step 1
    replica is never served for step 2."""
    root = droot
    bw = 256 << 10
    saved = run_world(
        tmp_path, root, "save", 1, 1, 2, 3,
        env={"REPLICA_WORKER_DIE": "3:2:mid", "REPLICA_WORKER_GOON": "1", "REPLICA_WORKER_CHUNK": str(64 << 10),
             "REPLICA_WORKER_BW": str(bw), "REPLICA_WORKER_TIMEOUT": "5"},
        codes_want=[0, 0, 0, -9],
    )
    assert saved[3] is None
    m1 = json.loads((root / "step-1" / "manifest.json").read_text())
    size = {f["rank"]: f["bytes"] for f in m1["files"]}
    for r, res in enumerate(saved[:3]):
        (rep,) = res["reports"]
        assert rep["step"] == 1 and rep["k_safe"] is True and rep["bandwidth"] == bw
        # Paced: the first 64 KiB piece goes at once, the rest no faster than 256 KiB/s.
        assert rep["bytes_sent"] == size[r] and size[r] > 2 * (64 << 10)
        assert rep["transfer_seconds"] >= (size[r] - (64 << 10)) / bw
        # The phases, in order, each ending after the one before; the exchange's phase
        # holds the paced transfer.
        ph = rep["phases"]
        assert list(ph) == ["durable", "committed", "opened", "exchanged", "checked", "agreed"]
        assert all(a <= b for a, b in zip(ph.values(), list(ph.values())[1:]))
        assert ph["exchanged"] - ph["opened"] >= rep["transfer_seconds"] - 0.01
        assert ph["agreed"] <= rep["seconds"]
        assert [f["step"] for f in res["failures"]] == [2, 3]
        f2, f3 = res["failures"]
        assert "step 2 is not 1-safe" in f2["message"]
        assert f2["seconds"] < 5 + 25  # bounded by the group timeout, never hung
        assert "step 3 is not replicated (skipped): replication stopped, since step 2" in f3["message"]
        assert f3["seconds"] < 5  # the save returns, its replication is skipped at once
    assert "partner rank 3" in saved[1]["failures"][0]["message"]
    # Step 3 never committed (rank 3 died); rank 0 and 2 swapped step 2; 1 and 3 did not.
    assert not (root / "step-3" / "manifest.json").exists()
    assert our_replicas(root) == [(0, 2), (1, 1), (2, 2), (3, 1)]

    # Lose machine 1: its kept arenas, the replicas it held, its ranks' files.
    for r in (2, 3):
        (pathlib.Path("/dev/shm") / kept_name(root, r)).unlink()
    remove_replica(_shmckpt.replica_name(str(root), 0, 2))
    remove_replica(_shmckpt.replica_name(str(root), 1, 1))
    m2 = json.loads((root / "step-2" / "manifest.json").read_text())
    for s in (1, 2):
        for f in m2["files"]:
            if f["rank"] in (2, 3):
                (root / f"step-{s}" / f["file"]).unlink()
    loaded = run_world(tmp_path, root, "load", 1)
    # Ranks 0-1 read their disk files: their kept arenas hold step 3, never committed.
    assert [res["source"][0] for res in loaded[:2]] == ["disk", "disk"]
    assert loaded[2]["source"] == ["peer", 0]
    assert all(res["step"] == 2 and res["exact"] is True for res in loaded[:3])
    assert loaded[3]["error"] == "ReplicationError" and "step 2" in loaded[3]["message"]
    assert our_replicas(root) == [(2, 2), (3, 1)]


def test_drill_node_local_roots(tmp_path):
    """The drill with a machine's all (examples/replica_drill.py --node-local): each
    simulated machine has its own /dev/shm and its own root (``node_local_root=True``, no
    shared filesystem): every step commits through the group, each machine's root holding
    its ranks' files and the step's manifest of all 4 ranks. Machine 1 is lost with its
    /dev/shm and its whole root; a fresh machine 1 restarts with an empty root; all 4 ranks
    load step 3 bit-exactly, ranks 2-3 from their partners' replicas (their machine's root
    adopts the manifest from a peer)."""
    namespaces_or_skip()
    base = tmp_path / "roots"
    roots = [base / "m0", base / "m1"]
    report = run_drill("--node-local", "--root", str(base))
    assert report["mode"] == "node-local" and report["roots"] == [str(r) for r in roots]
    assert_drill_saves_and_loads(report)
    # Both roots after the saves (machine 0's is still here to read the entries from).
    after = report["roots_after_save"]
    assert sorted(after) == sorted(str(r) for r in roots)
    files = {}
    for s in (1, 2, 3):
        man = json.loads((roots[0] / f"step-{s}" / "manifest.json").read_text())
        assert man["step"] == s and [f["rank"] for f in man["files"]] == [0, 1, 2, 3]
        files[s] = man["files"]
    for m, root in enumerate(roots):
        listing = after[str(root)]
        assert sorted(listing) == ["step-1", "step-2", "step-3"]
        for s in (1, 2, 3):
            d = listing[f"step-{s}"]
            assert (d["manifest_step"], d["manifest_ranks"]) == (s, [0, 1, 2, 3])
            assert d["manifest_sha256"] == entries_digest(files[s])  # the same entries on both machines
            mine = sorted(f["file"] for f in files[s] if f["rank"] // 2 == m)
            parts = [f"rank-{r:05d}.manifest.json" for r in range(4)]  # as a shared root keeps them
            assert d["files"] == sorted(mine + parts + ["manifest.json"])
    tags = [_shmckpt.replica_tag(str(r)) for r in roots]
    rep = lambda m, q: f"shmckpt-replica.{tags[m]}.r{q}.s3"  # noqa: E731
    assert report["shm_after_save"] == {
        "0": sorted([kept_name(roots[0], 0), kept_name(roots[0], 1), rep(0, 2), rep(0, 3)]),
        "1": sorted([kept_name(roots[1], 2), kept_name(roots[1], 3), rep(1, 0), rep(1, 1)]),
    }
    assert report["lost"] == {"machine": 1, "ranks": [2, 3], "removed": [str(roots[1])]}
    # Machine 1's new root: step 3 with the adopted manifest and its ranks' files.
    man = json.loads((roots[1] / "step-3" / "manifest.json").read_text())
    assert man["files"] == files[3]
    mine = sorted(f["file"] for f in files[3] if f["rank"] >= 2)
    assert sorted(p.name for p in (roots[1] / "step-3").iterdir()) == sorted(mine + ["manifest.json"])
    assert sorted(p.name for p in roots[1].iterdir() if p.name.startswith("step-")) == ["step-3"]


def test_node_local_roots_keep_the_newest_steps(tmp_path):
    """Retention with node-local roots (``keep_last=2``): every step commits through the
    group, and once it is committed on every machine each machine's committing rank
    removes the steps beyond the newest 2 from its root, as the engine does for a shared
    root. After 4 steps each machine's root holds steps 3 and 4 only (no trash left), and
    step 4 loads bit-exactly on every rank."""
    roots = [tmp_path / "m0" / "root", tmp_path / "m1" / "root"]
    template = str(tmp_path / "m{m}" / "root")
    env = {"REPLICA_WORKER_NODE_LOCAL": "1", "REPLICA_WORKER_KEEP_LAST": "2"}
    try:
        saved = run_world(tmp_path, template, "save", 1, 1, 2, 3, 4, env=env)
        for res in saved:
            assert [rep["step"] for rep in res["reports"]] == [1, 2, 3, 4]
            assert all(rep["k_safe"] for rep in res["reports"])
        for root in roots:
            assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["step-3", "step-4"]
            man = json.loads((root / "step-4" / "manifest.json").read_text())
            assert man["step"] == 4 and [f["rank"] for f in man["files"]] == [0, 1, 2, 3]
        loaded = run_world(tmp_path, template, "load", 1, env=env)
        for res in loaded:
            assert "error" not in res, res
            assert res["step"] == 4 and res["exact"] is True
    finally:
        for root in roots:
            remove_arenas_of(root)


CHUNK = 64 << 10


def test_staging_pressure_spills_the_held_image_to_the_file(tmp_path, droot):
    """Chunks of 64 KiB, 4 in the arena, an image of 3 (held for replication at its commit),
    replication at 32 KiB/s (one chunk per piece, 2 s apart). Once the first piece of step
    1 is taken, step 2 is saved: it needs 3 chunks, 1 is free, so the reclaim hook gives back
    the 2 the replication has not taken. The save completes at once (not after the
    replication); step 1's first piece went from staging, the rest from the file; every
    replica of step 1 is exactly its source's file; step 2 goes wholly from staging; the
    drill then restores machine 1 bit-exactly from step 2's replicas."""
    root = droot
    arena = {"REPLICA_WORKER_CHUNK": str(CHUNK), "REPLICA_WORKER_STAGING": str(4 * CHUNK)}
    saved = run_world(
        tmp_path, root, "save", 1,
        env={"REPLICA_WORKER_PRESSURE": "mid", "REPLICA_WORKER_BW": str(32 << 10), **arena},
    )
    for r, res in enumerate(saved):
        s1, s2 = file_sizes(root, 1)[r], file_sizes(root, 2)[r]
        assert 2 * CHUNK < s1 <= 3 * CHUNK and 2 * CHUNK < s2 <= 3 * CHUNK
        rep1, rep2 = res["reports"]
        assert (rep1["step"], rep1["k_safe"], rep2["step"], rep2["k_safe"]) == (1, True, 2, True)
        assert rep1["sent_from"] == {"staging": CHUNK, "copied": 0, "file": s1 - CHUNK}
        assert rep2["sent_from"] == {"staging": s2, "copied": 0, "file": 0}
        # Paced: the last piece of step 1 went 4 s after the first, while step 2 was saved.
        assert rep1["transfer_seconds"] >= 2 * CHUNK / (32 << 10)
        assert res["save2_seconds"] < 2.5
        assert res["replica1_exact"] is True
    assert our_replicas(root) == [(0, 2), (1, 2), (2, 2), (3, 2)]
    lose_machine_1(root, [1, 2])
    loaded = run_world(tmp_path, root, "load", 1, env=arena)
    assert [res["source"] for res in loaded] == [["memory", None], ["memory", None], ["peer", 0], ["peer", 1]]
    assert all(res["step"] == 2 and res["exact"] is True for res in loaded)


def test_held_image_given_back_before_its_replication_is_sent_from_the_file(tmp_path, droot):
    """The arena of the test above; step 1's image is held at its commit, then step 2 is
    saved (and committed) before step 1's replication may begin its exchange: the save
    takes the free chunk and, through the reclaim hook, the 3 held ones, without waiting.
    Step 1 is then sent wholly from the committed file, exactly (every replica equal to
    its source's file). Step 2's image is held in arena chunks 3, 0, 1 (the free one, then
    the ones given back, in order): one piece (1 GiB/s: pieces of 64 MiB at most) over
    chunks that are not consecutive, so copied out of staging, never read from the file."""
    root = droot
    arena = {"REPLICA_WORKER_CHUNK": str(CHUNK), "REPLICA_WORKER_STAGING": str(4 * CHUNK)}
    saved = run_world(tmp_path, root, "save", 1, env={"REPLICA_WORKER_PRESSURE": "before", **arena})
    for r, res in enumerate(saved):
        s1, s2 = file_sizes(root, 1)[r], file_sizes(root, 2)[r]
        rep1, rep2 = res["reports"]
        assert (rep1["step"], rep1["k_safe"], rep2["step"], rep2["k_safe"]) == (1, True, 2, True)
        assert rep1["sent_from"] == {"staging": 0, "copied": 0, "file": s1}
        assert rep2["sent_from"] == {"staging": 0, "copied": s2, "file": 0}
        assert res["replica1_exact"] is True
    lose_machine_1(root, [1, 2])
    loaded = run_world(tmp_path, root, "load", 1, env=arena)
    assert [res["source"][0] for res in loaded] == ["memory", "memory", "peer", "peer"]
    assert all(res["step"] == 2 and res["exact"] is True for res in loaded)


def shm_bytes(root, src, step):
    """The bytes of this user's replica of ``src``'s image of ``step`` of ``root``."""
    return (pathlib.Path("/dev/shm") / _shmckpt.replica_name(str(root), src, step)).read_bytes()


def rank_file_bytes(root, step, rank):
    """The bytes of ``rank``'s committed file of ``step``."""
    m = json.loads((root / f"step-{step}" / "manifest.json").read_text())
    (f,) = [f for f in m["files"] if f["rank"] == rank]
    return (root / f"step-{step}" / f["file"]).read_bytes()


def test_disk_every_replicates_every_save_and_a_lost_machine_loads_the_memory_only_step(tmp_path, droot):
    """disk_every=2 with replicas=1: every save is replicated, the disk saves (1, 3) and
    the memory-only ones (2, 4: sent from a copy of the staging chunks, with the checksums
    computed then); "latest" is the memory-only step 4 while every rank holds it. A
    memory-only step's replica keeps the newest committed step's (3). close() writes step
    4 to disk, byte for byte what the partners hold. Then machine 1 is lost (the replicas
    it held, its ranks' files of every step): "latest" is still step 4, its lost ranks'
    images from the partners' replicas of the memory-only step, exactly."""
    root = droot
    env = {"REPLICA_WORKER_DISK_EVERY": "2", "REPLICA_WORKER_LOAD_AFTER": "1"}
    saved = run_world(tmp_path, root, "save", 1, 1, 2, 3, 4, env=env)
    for r, res in enumerate(saved):
        reps = {rep["step"]: rep for rep in res["reports"]}
        assert sorted(reps) == [1, 2, 3, 4]
        for s in (1, 2, 3, 4):
            rep = reps[s]
            assert (rep["replicated"], rep["k_safe"], rep["skipped"], rep["memory_only"]) == (True, True, None, s % 2 == 0), rep
            assert rep["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
            assert rep["problems"] == []
        for s in (1, 3):
            assert reps[s]["bytes_sent"] == file_sizes(root, s)[r]
        assert res["after"] == {"step": 4, "exact": True, "source": ["memory", None]}, res
    # Step 4's replicas keep step 3's (committed); step 2's went once step 3's were stored.
    assert our_replicas(root) == sorted((q, s) for q in range(WORLD) for s in (3, 4))
    # Step 2 was given up once step 3 committed; close() wrote step 4.
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1", "step-3", "step-4"]
    for r, res in enumerate(saved):
        # What the partners received of the memory-only step is its file, exactly.
        assert res["reports"][3]["bytes_sent"] == file_sizes(root, 4)[r]
        assert shm_bytes(root, r, 4) == rank_file_bytes(root, 4, r)
    # Machine 1 is lost: the replicas it held, its ranks' files of every step.
    for src in (0, 1):
        for s in (3, 4):
            remove_replica(_shmckpt.replica_name(str(root), src, s))
    for s in (1, 3, 4):
        names = {f["rank"]: f["file"] for f in json.loads((root / f"step-{s}" / "manifest.json").read_text())["files"]}
        for r in (2, 3):
            (root / f"step-{s}" / names[r]).unlink()
    loaded = run_world(tmp_path, root, "load", 1, env={"REPLICA_WORKER_DISK_EVERY": "2"})
    for res in loaded:
        assert "error" not in res, res
        assert (res["step"], res["exact"]) == (4, True), res
    assert [res["source"] for res in loaded] == [["disk", None], ["disk", None], ["peer", 0], ["peer", 1]]
    # The lost ranks' files are back, exactly the replicas.
    for r in (2, 3):
        assert rank_file_bytes(root, 4, r) == shm_bytes(root, r, 4)


def kill_after_memory_only_step(tmp_path, root):
    """disk_every=2, replicas=1: steps 1-4 saved and replicated (2 and 4 memory-only), then
    every rank SIGKILLed: close() never writes step 4. Returns each rank's staging arena."""
    env = {"REPLICA_WORKER_DISK_EVERY": "2", "REPLICA_WORKER_KILL_AFTER": "1"}
    saved = run_world(tmp_path, root, "save", 1, 1, 2, 3, 4, env=env, codes_want=[-9] * WORLD)
    for res in saved:
        reps = {rep["step"]: rep for rep in res["reports"]}
        assert (reps[4]["replicated"], reps[4]["k_safe"], reps[4]["memory_only"]) == (True, True, True), reps[4]
        assert reps[4]["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1", "step-3"]
    # Step 4's replicas keep step 3's; each of step 4 has its sender's entry beside it.
    assert our_replicas(root) == sorted((q, s) for q in range(WORLD) for s in (3, 4))
    for q in range(WORLD):
        entry = json.loads(_shmckpt.replica_memory_entry(str(root), 4, q))
        assert (entry["rank"], entry["bytes"]) == (q, len(shm_bytes(root, q, 4)))
    return [res["shm_name"] for res in saved]


def lose_machine_1_uncommitted(root, arenas):
    """Machine 1 (ranks 2, 3) is lost after the kill: its ranks' staging arenas (holding
    step 4), the replicas it held (ranks 0-1's of steps 3 and 4) and its ranks' files."""
    for r in (2, 3):
        (pathlib.Path("/dev/shm") / arenas[r]).unlink()
    for src in (0, 1):
        for s in (3, 4):
            remove_replica(_shmckpt.replica_name(str(root), src, s))
    for s in (1, 3):
        names = {f["rank"]: f["file"] for f in json.loads((root / f"step-{s}" / "manifest.json").read_text())["files"]}
        for r in (2, 3):
            (root / f"step-{s}" / names[r]).unlink()


def test_a_lost_machine_completes_the_commit_of_a_memory_only_step(tmp_path, droot):
    """Issue 38: disk_every=2 with replicas=1, every rank SIGKILLed once the memory-only
    step 4 is replicated (close() never wrote it), then machine 1 is lost with its staging
    arenas, the replicas it held and its ranks' files. On restart ranks 0-1 recover their
    part of step 4 from their arenas into step-4.partial; the load completes the commit:
    ranks 2-3 receive their image from the partners' replicas of the memory-only step
    (checked against the entry kept beside each), write their files and parts, and step 4
    is committed with the one protocol. "latest" is step 4 on every rank, bit-exact, ranks
    2-3 served from the images their partners sent; the committed manifest holds the
    entries the partners kept, and the lost ranks' files are exactly the replicas."""
    root = droot
    arenas = kill_after_memory_only_step(tmp_path, root)
    entries = {q: json.loads(_shmckpt.replica_memory_entry(str(root), 4, q)) for q in (2, 3)}
    images = {q: shm_bytes(root, q, 4) for q in (2, 3)}
    lose_machine_1_uncommitted(root, arenas)
    loaded = run_world(tmp_path, root, "load", 1, env={"REPLICA_WORKER_DISK_EVERY": "2"})
    for res in loaded:
        assert "error" not in res, res
        assert (res["step"], res["exact"]) == (4, True), res
    assert [res["source"] for res in loaded] == [["disk", None], ["disk", None], ["peer", 0], ["peer", 1]]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1", "step-3", "step-4"]
    m = json.loads((root / "step-4" / "manifest.json").read_text())
    assert (m["step"], [f["rank"] for f in m["files"]]) == (4, [0, 1, 2, 3])
    for q in (2, 3):
        assert m["files"][q] == entries[q]
        assert rank_file_bytes(root, 4, q) == images[q]


@pytest.mark.parametrize("how", ["removed", "tampered"])
def test_a_lost_part_without_a_replica_falls_back_to_the_committed_step(tmp_path, droot, how):
    """As above, but no partner holds the lost ranks' images of step 4 (``removed``: their
    replicas of the memory-only step removed too), or rank 2's replica has one data byte
    flipped (``tampered``: refused by its check against the entry kept beside it, while
    rank 3's is good): step 4 cannot be completed, so "latest" is step 3 on every rank,
    bit-exact (ranks 2-3 from their partners' replicas of step 3); step 4 is never
    committed, and the resume from step 3 withdrew the survivors' parts and files of it
    (the run saves step 4 again, and a new save of it must never merge with them)."""
    root = droot
    arenas = kill_after_memory_only_step(tmp_path, root)
    lose_machine_1_uncommitted(root, arenas)
    if how == "removed":
        for src in (2, 3):
            remove_replica(_shmckpt.replica_name(str(root), src, 4))
    else:
        path = pathlib.Path("/dev/shm") / _shmckpt.replica_name(str(root), 2, 4)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    loaded = run_world(tmp_path, root, "load", 1, env={"REPLICA_WORKER_DISK_EVERY": "2"})
    for res in loaded:
        assert "error" not in res, res
        assert (res["step"], res["exact"]) == (3, True), res
    assert [res["source"] for res in loaded] == [["disk", None], ["disk", None], ["peer", 0], ["peer", 1]]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1", "step-3", "step-4.partial"]
    assert sorted(p.name for p in (root / "step-4.partial").iterdir()) == []


def test_a_memory_only_step_given_up_before_its_replication_is_skipped(tmp_path, droot):
    """disk_every=3, memory_steps=1: steps 1 (disk), 2 and 3 (memory-only) are saved before
    any replication may begin; staging step 3 gave step 2 up on every rank. Step 2's
    replication is skipped on every rank, with the reason, and nothing of it is stored;
    step 3 is replicated from its staging chunks, exactly its later file."""
    root = droot
    env = {"REPLICA_WORKER_DISK_EVERY": "3", "REPLICA_WORKER_GATE": "1"}
    saved = run_world(tmp_path, root, "save", 1, 1, 2, 3, env=env)
    for r, res in enumerate(saved):
        reps = {rep["step"]: rep for rep in res["reports"]}
        assert sorted(reps) == [1, 2, 3]
        assert (reps[1]["replicated"], reps[1]["k_safe"], reps[1]["memory_only"]) == (True, True, False)
        assert (reps[2]["replicated"], reps[2]["skipped"], reps[2]["bytes_sent"], reps[2]["holders"]) == (
            False,
            "memory-only step given up before it was sent (ranks [0, 1, 2, 3])",
            0,
            {},
        ), reps[2]
        assert (reps[3]["replicated"], reps[3]["k_safe"], reps[3]["memory_only"]) == (True, True, True), reps[3]
        assert reps[3]["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
    assert our_replicas(root) == sorted((q, s) for q in range(WORLD) for s in (1, 3))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1", "step-3"]
    for r in range(WORLD):
        assert shm_bytes(root, r, 3) == rank_file_bytes(root, 3, r)
        assert shm_bytes(root, r, 1) == rank_file_bytes(root, 1, r)


def test_a_memory_only_step_given_up_mid_replication_is_sent_exactly(tmp_path, droot):
    """disk_every=3, memory_steps=1, chunks of 64 KiB sent at 32 KiB/s: once the first
    piece of the memory-only step 2 is taken, step 3 is saved, which gives step 2 up (its
    chunks back to the pool, free for step 3). Step 2's replication goes on from the copy
    it made and is k-safe; every replica of it holds exactly its source's tensors of step
    2; step 3 is replicated too, exactly its file once close() writes it."""
    root = droot
    env = {
        "REPLICA_WORKER_DISK_EVERY": "3",
        "REPLICA_WORKER_GIVEUP_MID": "1",
        "REPLICA_WORKER_BW": str(32 << 10),
        "REPLICA_WORKER_CHUNK": str(CHUNK),
    }
    saved = run_world(tmp_path, root, "save", 1, env=env)
    for r, res in enumerate(saved):
        # Step 2 was given up by step 3's save, while its replication was sending it.
        assert res["held_after_3"] == [[1, ["disk"]], [3, ["memory"]]], res
        reps = {rep["step"]: rep for rep in res["reports"]}
        assert sorted(reps) == [1, 2, 3]
        for s, mem in ((1, False), (2, True), (3, True)):
            assert (reps[s]["replicated"], reps[s]["k_safe"], reps[s]["memory_only"]) == (True, True, mem), reps[s]
            assert reps[s]["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
        assert reps[2]["transfer_seconds"] >= CHUNK / (32 << 10)
        assert res["replica2_exact"] is True
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1", "step-3"]
    for r in range(WORLD):
        assert shm_bytes(root, r, 3) == rank_file_bytes(root, 3, r)


def test_replicate_every_counts_every_save_alike_on_every_rank():
    """The decision of which saves are replicated (``Replicator._skip_reason``, run on
    every rank with every rank's outcome): every 2nd save with replicate_every=2, disk or
    memory-only alike; ranks that disagree on the disk raise."""
    from shmckpt.replicas import Replicator

    rep = object.__new__(Replicator)
    rep.replicate_every, rep._since_replica = 2, None
    seen = [rep._skip_reason(s, m) for s, m in enumerate([[0, 0], [1, 1], [0, 0], [1, 1], [1, 1], [0, 0], [0, 0]], 1)]
    assert seen == [
        None,
        "replicate_every=2",
        None,
        "replicate_every=2",
        None,
        "replicate_every=2",
        None,
    ]
    with pytest.raises(shmckpt.ReplicationError, match=r"memory-only on ranks \[1\] only"):
        rep._skip_reason(8, [False, True])


def test_refused_cadence_replication_settings(root):
    """replicate_every < 1, and a cadence with node-local roots, are ConfigErrors."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        tuning = shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20)
        # replicate_every < 1: Replicas checks every= when it is built.
        with pytest.raises(shmckpt.ConfigError, match="Replicas.every must be at least 1, not 0"):
            shmckpt.Checkpointer(root, tuning=tuning, replicas=shmckpt.Replicas(k=1, node="only", every=0))
        with pytest.raises(shmckpt.ConfigError, match="disk_every and replicate_every must be 1"):
            shmckpt.Checkpointer(
                root,
                tuning=tuning,
                cadence=shmckpt.Cadence(disk_every=2),
                replicas=shmckpt.Replicas(k=1, node="only", node_local_root=True),
            )
    finally:
        dist.destroy_process_group()
