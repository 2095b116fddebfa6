"""``latest()`` and ``list()`` see every tier ``load("latest")`` reads (memory, the local
disk, the bucket): one rule, the engine's (``Engine::resolve_step``), so the idiom
``if ckpt.latest() is not None: ckpt.load("latest")`` resumes from the bucket after the
local root was lost."""

import shutil

import pytest

import shmckpt

from test_remote import moto, open_ck, s3, same, state  # noqa: F401  (fixtures)


def test_latest_and_list_agree_with_load_after_the_local_root_is_lost(s3, root):
    _, bucket = s3
    url = f"s3://{bucket}/run1"
    with open_ck(root, url) as ck:
        for step in (1, 2):
            h = ck.save(step, state(step))
            h.wait()
            h.wait_remote()
        assert ck.latest() == ck.latest(source="local") == ck.latest(source="remote") == 2
        assert ck.list(tiers=True) == [(1, ["disk", "bucket"]), (2, ["disk", "bucket"])]

    shutil.rmtree(root)
    root.mkdir()
    with open_ck(root, url) as ck:
        # The documented idiom: the bucket's newest step, the one load("latest") loads.
        assert ck.latest() == 2
        assert ck.latest(source="remote") == 2
        assert ck.latest(source="local") is None
        same(ck.load("latest"), state(2))
        assert ck.last_load_source == ("remote", None)
        assert ck.list() == [1, 2] and ck.list(remote=True) == [1, 2] and ck.list(source="remote") == [1, 2]
        assert ck.list(source="local") == []
        assert ck.list(tiers=True) == [(1, ["bucket"]), (2, ["bucket"])]
        # Every listed step loads (from the tier listed).
        same(ck.load(1), state(1))
        # Saved again on the disk: the disk's newest is the latest, for both.
        h = ck.save(3, state(3))
        h.wait()
        h.wait_remote()
        assert ck.latest() == 3
        same(ck.load("latest"), state(3))
        assert ck.last_load_source[0] in ("memory", "disk")
        assert ck.list(tiers=True) == [(1, ["bucket"]), (2, ["bucket"]), (3, ["disk", "bucket"])]


def test_latest_and_list_without_a_bucket(root):
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20)) as ck:
        assert ck.latest() is None and ck.list() == [] and ck.list(tiers=True) == []
        with pytest.raises(shmckpt.NotFound):
            ck.load("latest")
        ck.save(4, state(4)).wait()
        assert ck.latest() == ck.latest(source="local") == 4
        assert ck.list() == [4] and ck.list(tiers=True) == [(4, ["disk"])]
        with pytest.raises(shmckpt.ConfigError, match="no remote tier"):
            ck.latest(source="remote")
        with pytest.raises(shmckpt.ConfigError, match="no remote tier"):
            ck.list(remote=True)
        with pytest.raises(ValueError, match="source must be None, 'local' or 'remote', not 'disk'"):
            ck.latest(source="disk")
        with pytest.raises(ValueError, match="source must be"):
            ck.list(source="bucket")
