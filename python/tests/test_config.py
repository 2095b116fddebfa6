"""Grouped settings (``shmckpt.config``): each group checks its fields when built, the flat
keywords of earlier versions map onto the groups in one place (with a DeprecationWarning),
an unknown keyword names the closest valid one, and the engine gets one dict."""

import inspect
import warnings

import pytest
import torch

import shmckpt
from shmckpt import Cadence, ConfigError, RemoteTier, Replicas, Tuning, _shmckpt
from shmckpt.config import LEGACY, apply_legacy, engine_settings
from conftest import SMALL

GROUPS = {"tuning": None, "remote": None, "replicas": None, "cadence": None}


def test_every_flat_keyword_maps_onto_its_group_with_a_deprecation_warning():
    # One value per flat keyword, each different from its group's default.
    flat = {
        "staging_capacity": 64 << 20,
        "chunk_size": 1 << 20,
        "writer_threads": 3,
        "queue_depth": 7,
        "copy_threads": 2,
        "direct_io": False,
        "max_inflight_saves": 5,
        "remote_keep_last": 4,
        "remote_max_pending": 3,
        "remote_part_size": 8 << 20,
        "remote_concurrency": 9,
        "remote_request_timeout": 12.5,
        "remote_complete_timeout": 99.0,
        "remote_every": 2,
        "node": "m7",
        "replica_group": "the-group",
        "replica_bandwidth": 1e6,
        "replica_timeout": 42.0,
        "node_local_root": True,
        "disk_every": 3,
        "disk_interval_s": 30.0,
        "memory_steps": 2,
        "replicate_every": 4,
    }
    assert set(flat) == set(LEGACY)
    with pytest.warns(DeprecationWarning, match=r"chunk_size= -> Tuning\(chunk_size=\.\.\.\)") as rec:
        got = apply_legacy("Checkpointer", dict(GROUPS, remote="s3://b/p", replicas=2), flat, [])
    assert len(rec) == 1
    assert got == {
        "tuning": Tuning(
            staging_capacity=64 << 20,
            chunk_size=1 << 20,
            writer_threads=3,
            queue_depth=7,
            copy_threads=2,
            direct_io=False,
            max_inflight_saves=5,
        ),
        "remote": RemoteTier(
            "s3://b/p",
            keep_last=4,
            max_pending=3,
            part_size=8 << 20,
            concurrency=9,
            request_timeout=12.5,
            complete_timeout=99.0,
            every=2,
        ),
        "replicas": Replicas(
            k=2, node="m7", group="the-group", bandwidth=1e6, timeout=42.0, node_local_root=True, every=4
        ),
        "cadence": Cadence(disk_every=3, disk_interval_s=30.0, memory_steps=2),
    }
    # The engine's one dict: the groups flattened to its keys.
    assert engine_settings(got["tuning"], got["remote"], got["cadence"], rank=1) == {
        "staging_capacity": 64 << 20,
        "chunk_size": 1 << 20,
        "writer_threads": 3,
        "queue_depth": 7,
        "copy_threads": 2,
        "direct_io": False,
        "max_inflight_saves": 5,
        "remote": "s3://b/p",
        "remote_keep_last": 4,
        "remote_max_pending": 3,
        "remote_part_size": 8 << 20,
        "remote_concurrency": 9,
        "remote_request_timeout": 12.5,
        "remote_complete_timeout": 99.0,
        "remote_every": 2,
        "disk_every": 3,
        "disk_interval_s": 30.0,
        "memory_steps": 2,
        "rank": 1,
    }


def test_no_flat_keyword_no_warning_and_shorthands():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = apply_legacy("Checkpointer", dict(GROUPS, remote="s3://b/p", replicas=1), {}, [])
    assert got == {"tuning": None, "remote": RemoteTier("s3://b/p"), "replicas": Replicas(k=1), "cadence": None}
    assert apply_legacy("Checkpointer", dict(GROUPS, replicas=0), {}, [])["replicas"] is None


def test_flat_checkpointer_keywords_open_the_same_engine_as_the_grouped_form(root):
    with pytest.warns(DeprecationWarning, match="Checkpointer: flat keyword arguments are deprecated"):
        old = shmckpt.Checkpointer(root / "old", staging_capacity=SMALL, chunk_size=1 << 20, writer_threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = shmckpt.Checkpointer(root / "new", tuning=Tuning(staging_capacity=SMALL, chunk_size=1 << 20, writer_threads=2))
    with old, new:
        assert old.staging_capacity == new.staging_capacity == SMALL
        assert old._engine.chunk_size == new._engine.chunk_size == 1 << 20
        for ck in (old, new):
            ck.save(1, {"w": torch.arange(10, dtype=torch.int16)}).wait()
            assert ck.load(1)["w"].tolist() == list(range(10))


def test_an_unknown_keyword_names_the_closest_valid_one(root):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'keep_lst' \(did you mean 'keep_last'\?\)"):
        shmckpt.Checkpointer(root, keep_lst=3)
    with pytest.raises(TypeError, match=r"'writer_thread' \(did you mean 'writer_threads'\?\)"):
        shmckpt.Checkpointer(root, writer_thread=3)
    with pytest.raises(TypeError, match=r"'zzz'$"):
        shmckpt.Checkpointer(root, zzz=1)


def test_groups_check_their_fields_when_built():
    cases = [
        (lambda: Tuning(writer_threads=0), "Tuning.writer_threads must be between 1 and 256, not 0"),
        (lambda: Tuning(chunk_size=True), "Tuning.chunk_size must be an int, not True"),
        (lambda: Tuning(direct_io=1), "Tuning.direct_io must be True or False, not 1"),
        (lambda: Tuning(copy_ahead=-1), "Tuning.copy_ahead must be at least 0, not -1"),
        (lambda: Tuning(stream_latches=0), "Tuning.stream_latches must be True or False, not 0"),
        (lambda: Tuning(blocking_sync="yes"), "Tuning.blocking_sync must be True or False, not 'yes'"),
        (lambda: RemoteTier("s3://b/p", concurrency=257), "RemoteTier.concurrency must be between 1 and 256, not 257"),
        (lambda: RemoteTier("s3://b/p", part_size=1 << 20), "RemoteTier.part_size must be between"),
        (lambda: RemoteTier("s3://b/p", complete_timeout=float("nan")), "RemoteTier.complete_timeout must be a positive"),
        (lambda: Replicas(k=-1), "Replicas.k must be at least 0, not -1"),
        (lambda: Replicas(timeout=0), "Replicas.timeout must be a positive"),
        (lambda: Replicas(every=0), "Replicas.every must be at least 1, not 0"),
        (lambda: Cadence(memory_steps=0), "Cadence.memory_steps must be between 1 and 256, not 0"),
        (lambda: Cadence(memory_steps=257), "Cadence.memory_steps must be between 1 and 256, not 257"),
        (lambda: Cadence(disk_every=0), "Cadence.disk_every must be at least 1, not 0"),
        (lambda: Cadence(disk_every="sometimes"), "Cadence.disk_every must be a number >= 1 or \"auto\""),
    ]
    for make, msg in cases:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            make()
    assert Replicas(every=1).every == 1
    with pytest.raises(AttributeError):
        Tuning().chunk_size = 1  # type: ignore[misc]  # frozen


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_one_place_for_each_setting(root):
    with pytest.raises(ConfigError, match=r"chunk_size= and tuning=Tuning\(\.\.\.\) both given"):
        shmckpt.Checkpointer(root, tuning=Tuning(writer_threads=2), chunk_size=1 << 20)
    # A tier's flat setting without the tier had no effect: still has none, said.
    with pytest.warns(UserWarning, match=r"remote_keep_last=3 has no effect: the remote tier is off"):
        c = shmckpt.Checkpointer(root, tuning=Tuning(staging_capacity=SMALL), remote_keep_last=3)
    assert c.remote is None
    c.close()
    # A flat setting at its default, without its tier, was accepted before: still is.
    shmckpt.Checkpointer(root, tuning=Tuning(staging_capacity=SMALL), remote_every=1, node_local_root=False).close()


def test_the_engine_takes_one_dict_and_refuses_unknown_keys(root):
    with pytest.raises(TypeError, match=r'unknown engine setting "chunk_sise"'):
        _shmckpt.Engine(str(root), {"chunk_sise": 1 << 20})
    e = _shmckpt.Engine(str(root), {"staging_capacity": SMALL, "chunk_size": 1 << 20, "keep_last": None})
    try:
        assert e.describe()[1] == SMALL and e.chunk_size == 1 << 20
        assert e.copy_ahead == 256 << 20  # the default
        assert e.stream_latches is False  # the default
        assert e.blocking_sync is False  # the default
    finally:
        e.close()
    # Tuning.copy_ahead reaches the engine, 0 (every copy queued at once) included.
    for ahead in (0, 3 << 20):
        with shmckpt.Checkpointer(root / f"ahead{ahead}", tuning=Tuning(staging_capacity=SMALL, copy_ahead=ahead)) as c:
            assert c._shared.engine.copy_ahead == ahead
    # Tuning.stream_latches reaches the engine.
    with shmckpt.Checkpointer(root / "latches", tuning=Tuning(staging_capacity=SMALL, stream_latches=True)) as c:
        assert c._shared.engine.stream_latches is True
    # Tuning.blocking_sync reaches the engine.
    with shmckpt.Checkpointer(root / "blocking", tuning=Tuning(staging_capacity=SMALL, blocking_sync=True)) as c:
        assert c._shared.engine.blocking_sync is True
    assert list(inspect.signature(_shmckpt.Engine).parameters) == ["root", "config"]


def test_the_checkpointer_is_one_class_with_grouped_parameters():
    assert [c.__name__ for c in shmckpt.Checkpointer.__mro__] == ["Checkpointer", "object"]
    params = list(inspect.signature(shmckpt.Checkpointer).parameters)
    assert params == [
        "root",
        "keep_last",
        "rank",
        "world_size",
        "keep_in_memory",
        "recover_on_open",
        "remote",
        "replicas",
        "cadence",
        "tuning",
        "check_replicas",
        "on_divergence",
        "shm_name",
        "legacy",
    ]


def test_the_integrations_take_one_tuning(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    from shmckpt.dcp import ShmckptWriter

    t = Tuning(chunk_size=1 << 20, writer_threads=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grouped = ShmckptWriter(tmp_path / "a", tuning=t)
    with pytest.warns(DeprecationWarning, match=r"ShmckptWriter: flat keyword arguments are deprecated"):
        flat = ShmckptWriter(tmp_path / "b", chunk_size=1 << 20, writer_threads=3)
    assert grouped._opts == flat._opts == t
    with pytest.raises(TypeError, match=r"'chunk_sizes' \(did you mean 'chunk_size'\?\)"):
        ShmckptWriter(tmp_path / "c", chunk_sizes=1)
    lightning = pytest.importorskip("shmckpt.lightning")
    io = lightning.ShmckptCheckpointIO(tuning=t, keep_in_memory=True)
    assert io._settings == {"chunk_size": 1 << 20, "writer_threads": 3, "keep_in_memory": True}
