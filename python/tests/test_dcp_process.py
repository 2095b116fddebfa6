"""shmckpt.dcp with ``async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``:
the writer pickles to DCP's checkpoint process as its configuration, the staged state as
its plan view (no tensor bytes), and the checkpoint process plans and commits."""

import json
import os
import pathlib
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlan

import shmckpt.dcp.engines as engines
from shmckpt import Tuning, errors
from shmckpt.dcp import ShmckptWriter
from shmckpt.dcp.items import _Save
from shmckpt.dcp.staging import UNREAD, StagedState

from ranks_support import run_ranks

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "dcp_process_worker.py"
CHUNK = 1 << 20


@pytest.fixture(autouse=True)
def _no_received_saves_left():
    """Unpickling a staged state here (as DCP's checkpoint process does) keeps its save in
    this process's session: none may outlive the test."""
    yield
    engines.SESSION.received.clear()


def spawn(scenario, world, workdir, *args, timeout=300):
    env = dict(os.environ)
    env["DCP_RUN"] = scenario
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    run_ranks(WORKER, scenario, world, workdir, *args, env=env, timeout=timeout)
    res = []
    for r in range(world):
        with open(os.path.join(workdir, f"result-{scenario}-{r}.json")) as f:
            res.append(json.load(f))
    return res


def segments_of(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"shmckpt.{pid}.")]


@pytest.mark.parametrize("world", [1, 2])
def test_process_and_thread_saves_load_byte_exact(tmp_path, world):
    res = spawn("saves", world, tmp_path)
    for r in res:
        # 4 DTensors + 6 plain tensors + step, sched, counter n, counter hist
        for name in ("a", "b", "c", "d", "e", "good"):
            assert r[name] == 14, (name, r)
        assert r["failed"] == "CheckpointException" and r["failed_msg"] is True, r
        # The checkpoint process opened no engine; the trainer's one engine staged.
        assert r["bg_segments"] == [] and r["own_segments"] == 1
        # Both processes ended: nothing of theirs is left in /dev/shm.
        assert segments_of(r["bg_pid"]) == []
    ck = tmp_path / "ckpt"
    assert sorted(os.listdir(ck)) == [".shmckpt-dcp", "a", "b", "c", "d", "e", "good"]
    assert sorted(os.listdir(ck / "a")) == [".metadata", "manifest.json"] + [
        f"rank-{k:05d}-of-{world:05d}.safetensors" for k in range(world)
    ]


def test_an_unstaged_save_opens_an_engine_in_the_checkpoint_process_and_frees_it(tmp_path):
    (r0, r1) = spawn("unstaged", 2, tmp_path)
    for r in (r0, r1):
        assert r["u0"] == 14 and r["u1"] == 14
        assert r["bg_segments"] == 1  # its own engine, while the trainer ran
        assert r["roots"] == [True]  # on a root of its own, next to none of the trainer's
        assert segments_of(r["bg_pid"]) == []  # freed at the trainer's exit (SIGTERM)


def test_check_replicas_runs_in_the_trainer_and_raises_in_the_checkpoint_process(tmp_path):
    """ShmckptWriter(check_replicas=group) with the PROCESS checkpointer: rank 1 flips a bit
    of the replicated ``model.w`` (2 ranks: no majority, both named). The check runs when
    the trainer hands the staged state over; DCP's checkpoint process raises the
    ReplicaDivergence on every rank, nothing is published and no rank file is left; warn
    publishes; a save the checkpoint process would stage itself is refused."""
    res = spawn("checked", 2, tmp_path, "1", timeout=400)
    ck = tmp_path / "ckpts"
    for r in res:
        for name in ("clean", "clean_after"):
            assert r[name] == {"ok": True, "published": True, "warnings": []}, (name, r[name])
        got = r["raise"]
        assert (got["ok"], got["published"]) == (False, False), got
        assert sorted(got["failures"]) == ["0", "1"]
        for f in got["failures"].values():
            assert f["type"] == "ReplicaDivergence", f
            assert (f["tensor"], f["ranks"], f["divergences"]) == ("model.w", [0, 1], ["model.w"])
            assert f["crc_ranks"] == [0, 1] and f["committed"] is False
            assert f"replicas diverge in checkpoint {ck}/raise (not committed)" in f["message"]
        warn = r["warn"]
        assert (warn["ok"], warn["published"]) == (True, True), warn
        assert len(warn["warnings"]) == 1 and warn["warnings"][0].startswith(
            f"ReplicaDivergenceWarning: replicas diverge in checkpoint {ck}/warn (committed anyway): "
            "'model.w' differs on rank(s) [0, 1]"
        )
        un = r["unstaged"]
        assert (un["ok"], un["published"]) == (False, False), un
        assert sorted(un["failures"]) == ["0", "1"]
        for f in un["failures"].values():
            assert f["type"] == "SaveFailed" and "the stager must be the ShmckptWriter" in f["message"], f
        assert r["spool_rank_files"] == []
        assert r["listing"] == ["clean", "clean_after", "warn"]


def _state():
    return {
        "w": torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024),
        "t": torch.arange(24, dtype=torch.int16).reshape(4, 6).t(),
        "nested": {"b": torch.ones(3, dtype=torch.bfloat16, requires_grad=True), "lst": [torch.zeros(2), 5]},
        "meta": {"epoch": 3, "tag": "x"},
    }


def test_a_pickled_writer_is_its_configuration(tmp_path):
    w = ShmckptWriter(
        tmp_path / "c", overwrite=False, spool=tmp_path / "sp", tuning=Tuning(chunk_size=CHUNK, writer_threads=3)
    )
    w.stage(_state())
    data = pickle.dumps(w)
    assert len(data) < 2048 and b"Engine" not in data and b"_staged" not in data
    w2 = pickle.loads(data)
    assert (w2.path, w2._overwrite, w2._spool) == (str(tmp_path / "c"), False, str(tmp_path / "sp"))
    assert w2._opts == w._opts and w2._role == "received" and w._role == ""
    assert len(w2._staged) == 0 and w2._session is engines.SESSION and w2._group is None


def test_a_staged_state_pickles_to_its_plan_view_without_tensor_bytes(tmp_path):
    st = _state()
    w = ShmckptWriter(tmp_path / "c", tuning=Tuning(chunk_size=CHUNK))
    staged = w.stage(st)
    assert isinstance(staged, StagedState) and staged["w"] is st["w"]
    assert len(w._staged) == 1
    data = bytes(ForkingPickler.dumps(staged))  # what DCP's pipe to its process sends
    assert len(data) < 16 << 10, len(data)  # 4 MiB of tensors, a few KiB pickled
    assert not any(t.is_shared() for t in (st["w"], st["t"], st["nested"]["b"]))  # not moved to shm
    assert len(w._staged) == 0  # handed over: the trainer's writer forgets it
    view = pickle.loads(data)
    assert type(view) is dict and view["meta"] == {"epoch": UNREAD, "tag": UNREAD}
    for got, src in ((view["w"], st["w"]), (view["t"], st["t"]), (view["nested"]["b"], st["nested"]["b"])):
        assert got.is_meta and (got.shape, got.stride(), got.dtype) == (src.shape, src.stride(), src.dtype)
        assert got.requires_grad == src.requires_grad
    assert view["nested"]["lst"][0].is_meta and view["nested"]["lst"][1] is UNREAD
    (save,) = engines.SESSION.received
    assert save.error is None and save.report["file"].endswith(".safetensors")
    assert set(save.leaves) == {"w", "t", "nested.b", "nested.lst.0"}
    assert save.leaves["w"] is view["w"]


class _FailingHandle:
    def wait(self):
        raise errors.SaveFailed("disk on fire")


class _Planner:
    def __init__(self, state_dict):
        self.state_dict = state_dict


def test_a_save_that_failed_in_the_trainer_raises_from_write_data_in_the_receiver(tmp_path):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    w = ShmckptWriter(tmp_path / "c", tuning=Tuning(chunk_size=CHUNK))
    save = _Save(str(tmp_path / ".shmckpt-dcp"), 7, str(tmp_path / "c"))
    save.handle = _FailingHandle()
    w._staged.append(save)
    staged = StagedState({"w": torch.zeros(3)}, save, w)
    view = pickle.loads(ForkingPickler.dumps(staged))
    receiver = pickle.loads(pickle.dumps(w))
    flat, _ = flatten_state_dict(view)
    with pytest.raises(errors.SaveFailed, match="disk on fire"):
        receiver.write_data(SavePlan([]), _Planner(flat))
    assert len(engines.SESSION.received) == 0


def test_the_thread_checkpointer_never_pickles(tmp_path):
    """THREAD mode is unchanged: the staged state stays the trainer's own leaves."""
    import torch.distributed.checkpoint as dcp
    from shmckpt.dcp import ShmckptReader

    st = _state()
    w = ShmckptWriter(tmp_path / "c", tuning=Tuning(chunk_size=CHUNK))
    dcp.async_save(st, storage_writer=w).result()
    dst = {k: v for k, v in _state().items()}
    dst["w"] = torch.zeros(1024, 1024)
    dcp.load(dst, storage_reader=ShmckptReader(tmp_path / "c"))
    assert torch.equal(dst["w"], st["w"]) and len(engines.SESSION.received) == 0
