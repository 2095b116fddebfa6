"""``shmckpt.lightning.ShmckptCheckpointIO``: Lightning's checkpoints through shmckpt, with
ModelCheckpoint's top-k and ``last``, resumed bit-identically with ``ckpt_path="last"``."""

import collections
import os
import threading

import pytest
import torch

L = pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install lightning)")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import shmckpt  # noqa: E402
from shmckpt.lightning import ShmckptCheckpointIO  # noqa: E402
import zygote  # noqa: E402

MIB = 1 << 20


def raw(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.05, width: int = 16, tag: str = "tiny"):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.losses = []

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.losses.append((self.global_step, loss.detach().clone()))
        # A score that differs per epoch, so that top-k keeps a real choice.
        self.log("score", float((self.current_epoch * 7) % 5), on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=False)


def trainer(tmp, epochs, plugins, callbacks):
    return L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, plugins=plugins, callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp), deterministic=True,
    )


def links(d):
    return {n: os.readlink(os.path.join(d, n)) for n in sorted(os.listdir(d)) if os.path.islink(os.path.join(d, n))}


def test_topk_last_and_resume_continue_bit_identically(tmp_path):
    # Uninterrupted: 6 epochs (24 steps), no checkpoints.
    ref = Net()
    trainer(tmp_path / "ref", 6, [], []).fit(ref, data())

    # Interrupted after 3 epochs, checkpointed every epoch through shmckpt.
    d = tmp_path / "ckpts"
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    waits = []
    orig_wait = shmckpt.SaveHandle.wait

    def recording_wait(self):
        waits.append(threading.current_thread().name)
        return orig_wait(self)

    shmckpt.SaveHandle.wait = recording_wait
    try:
        a = Net()
        mc = ModelCheckpoint(dirpath=str(d), monitor="score", mode="max", save_top_k=2, save_last=True)
        trainer(tmp_path, 3, [io], [mc]).fit(a, data())
    finally:
        shmckpt.SaveHandle.wait = orig_wait
    # Non-blocking: the trainer's thread never waited for a save; the plugin's worker did.
    assert waits and all(n.startswith("shmckpt-lightning") for n in waits), waits
    # Scores by epoch: 0, 2, 4 -> top-2 are epochs 1 and 2; `last` is epoch 2.
    ls = links(d)
    assert sorted(ls) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"], ls
    steps = sorted(int(t.split("-")[1]) for t in ls.values())
    on_disk = sorted(n for n in os.listdir(d) if n.startswith("step-"))
    assert on_disk == [f"step-{s}" for s in steps], (on_disk, ls)  # removed ones are gone
    assert mc.best_model_path == str(d / "epoch=2-step=12.ckpt")

    # Resume from `last` for 3 more epochs: same losses, same weights, bit for bit.
    b = Net(lr=0.05)
    torch.manual_seed(1234)  # a different init, overwritten by the checkpoint
    b.body[0].weight.data.normal_()
    io2 = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    mc2 = ModelCheckpoint(dirpath=str(d), monitor="score", mode="max", save_top_k=2, save_last=True)
    trainer(tmp_path, 6, [io2], [mc2]).fit(b, data(), ckpt_path="last")
    ref_losses = dict((s, raw(v)) for s, v in ref.losses)
    got = [(s, raw(v)) for s, v in a.losses] + [(s, raw(v)) for s, v in b.losses]
    assert [s for s, _ in got] == list(range(24))
    assert all(ref_losses[s] == v for s, v in got), [s for s, v in got if ref_losses[s] != v]
    for (k, v), (k2, v2) in zip(ref.state_dict().items(), b.state_dict().items()):
        assert k == k2 and raw(v) == raw(v2), k
    opt_ref, opt_b = ref.optimizers().optimizer.state_dict(), b.optimizers().optimizer.state_dict()
    for i in opt_ref["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert raw(opt_ref["state"][i][key]) == raw(opt_b["state"][i][key]), (i, key)
    assert ref.lr_schedulers().state_dict() == b.lr_schedulers().state_dict()
    # Epoch scores 0,2,4,1,3,0: top-2 are now epochs 2 and 4.
    ls = links(d)
    assert sorted(ls) == ["epoch=2-step=12.ckpt", "epoch=4-step=20.ckpt", "last.ckpt"], ls
    assert sorted(n for n in os.listdir(d) if n.startswith("step-")) == sorted(ls.values())


def test_checkpoint_dict_round_trips_with_its_types_and_no_pickle(tmp_path):
    saved = {}

    class Capture(ShmckptCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            import copy

            saved[os.path.basename(path)] = copy.deepcopy(checkpoint)
            super().save_checkpoint(checkpoint, path, storage_options)

    io = Capture(tuning=shmckpt.Tuning(chunk_size=MIB))
    d = tmp_path / "ck"
    trainer(tmp_path, 2, [io], [ModelCheckpoint(dirpath=str(d), save_top_k=-1)]).fit(Net(tag="x"), data())
    assert sorted(saved) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    for name, want in saved.items():
        got = io.load_checkpoint(d / name)
        same(want, got, name)
        assert got["hyper_parameters"] == {"lr": 0.05, "width": 16, "tag": "x"}
        assert got["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
        # The file: a safetensors header of JSON (no pickle anywhere), every tensor named.
        step = os.readlink(d / name)
        f = d / step / "rank-00000-of-00001.safetensors"
        head = f.read_bytes()[:4096]
        assert b"pytorch-lightning_version" in head and b"\x80\x04" not in f.read_bytes()[: 8 + int.from_bytes(head[:8], "little")]
    io.teardown()


def same(a, b, path):
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), (path, a, b)


def test_values_the_format_cannot_hold_are_refused_naming_their_key(tmp_path):
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    ck = {"state_dict": collections.OrderedDict(w=torch.ones(2)), "hyper_parameters": {"classes": {"a", "b"}}}
    with pytest.raises(TypeError, match=r"state\['hyper_parameters'\]\['classes'\]"):
        io.save_checkpoint(ck, tmp_path / "x.ckpt")
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == []  # teardown removed the rank lock


def test_overwrite_remove_and_errors(tmp_path):
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    p = tmp_path / "last.ckpt"
    io.save_checkpoint({"w": torch.arange(3.0), "n": 1}, p)
    io.save_checkpoint({"w": torch.arange(4.0), "n": 2}, p)  # overwrites: the first step goes
    got = io.load_checkpoint(p)
    assert got["n"] == 2 and raw(got["w"]) == raw(torch.arange(4.0))
    assert os.readlink(p) == "step-1" and not (tmp_path / "step-0").exists()
    io.remove_checkpoint(p)
    io.teardown()
    assert not os.path.lexists(p) and not (tmp_path / "step-1").exists()
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(p)
    # A link that does not name a step beside it is refused, not followed.
    os.symlink("/etc", tmp_path / "evil.ckpt")
    with pytest.raises(shmckpt.UnsafePath):
        io.load_checkpoint(tmp_path / "evil.ckpt")
    with pytest.raises(shmckpt.UnsafePath, match="shmckpt's own"):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "step-3")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"w": torch.ones(1)}, p, storage_options={})
    with pytest.raises(TypeError, match="keep_last"):
        ShmckptCheckpointIO(keep_last=2)
    # A name close to the 255-byte limit is published (the temporary link name is short).
    long = tmp_path / ("x" * 245 + ".ckpt")
    io.save_checkpoint({"w": torch.arange(5.0)}, long)
    io.teardown()
    assert os.readlink(long) == "step-0" and raw(io.load_checkpoint(long)["w"]) == raw(torch.arange(5.0))
    # A torch.save checkpoint from before the switch still loads.
    torch.save({"w": torch.arange(2.0)}, tmp_path / "old.ckpt")
    assert raw(io.load_checkpoint(tmp_path / "old.ckpt")["w"]) == raw(torch.arange(2.0))
    io.teardown()


def test_ddp_two_processes_resume_from_last_bit_identically(tmp_path):
    """DDP over gloo, 2 processes under torchrun: rank zero saves, every rank loads `last`
    at once (no engine, so no root lock in the way) and continues exactly."""
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "lightning_ddp_worker.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")

    def torchrun(*args):
        p = zygote.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker, *args],
            capture_output=True, text=True, env=env, timeout=300,
        )
        assert p.returncode == 0, p.stderr[-4000:]

    def read(prefix, rank):
        lines = (tmp_path / f"{prefix}.rank{rank}").read_text().splitlines()
        return [ln.split() for ln in lines[:-1]], lines[-1]

    torchrun(str(tmp_path / "ref"), "4", str(tmp_path / "ref"))
    torchrun(str(tmp_path / "run"), "2", str(tmp_path / "a"))
    torchrun(str(tmp_path / "run"), "4", str(tmp_path / "b"), "resume")
    for r in range(2):
        ref_losses, ref_final = read("ref", r)
        a, _ = read("a", r)
        b, final = read("b", r)
        assert [int(s) for s, _ in ref_losses] == list(range(16))
        assert a + b == ref_losses, r  # steps 0-7 then 8-15, every loss bit for bit
        assert final == ref_final, r
    assert read("ref", 0)[1] == read("ref", 1)[1]
    # Epoch scores 0, 2, 4, 1: top-2 are epochs 1 and 2, and `last` is epoch 3.
    assert sorted(links(tmp_path / "run")) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]


def test_a_swapped_step_is_a_corrupt_error_naming_both_steps(tmp_path):
    """A step directory replaced by a copy of another step (a valid checkpoint, every CRC
    right) is refused, never loaded as the step the link names."""
    import shutil

    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    io.save_checkpoint({"w": torch.arange(3.0), "n": 0}, tmp_path / "a.ckpt")
    io.save_checkpoint({"w": torch.arange(4.0), "n": 1}, tmp_path / "b.ckpt")
    io.teardown()
    assert os.readlink(tmp_path / "b.ckpt") == "step-1"
    os.symlink("b.ckpt", tmp_path / "alias.ckpt")  # save_last="link" makes such links
    shutil.rmtree(tmp_path / "step-1")
    shutil.copytree(tmp_path / "step-0", tmp_path / "step-1")
    for name in ("b.ckpt", "alias.ckpt"):
        with pytest.raises(shmckpt.CorruptError, match="manifest is of step 0, the caller's link of step 1"):
            io.load_checkpoint(tmp_path / name)
    assert io.load_checkpoint(tmp_path / "a.ckpt")["n"] == 0  # the real step 0 still loads
    # The extension calls check the step they are given, whatever the directory's name.
    with pytest.raises(shmckpt.CorruptError, match="of step 0, the caller's link of step 1"):
        shmckpt._shmckpt.read_rank_file(str(tmp_path / "step-0"), 0, step=1)
    with pytest.raises(shmckpt.CorruptError, match="of step 0, the caller's link of step 1"):
        shmckpt._shmckpt.rank_file_metadata(str(tmp_path / "step-0"), 0, step=1)
    io.teardown()


def _slow_commits(monkeypatch, seconds=0.3):
    """Every wait for a commit first sleeps: the plugin's worker publishes late, as on a
    loaded machine, and what the trainer sees meanwhile is what a slow disk shows it."""
    import time

    orig_wait = shmckpt.SaveHandle.wait

    def slow_wait(self):
        time.sleep(seconds)
        return orig_wait(self)

    monkeypatch.setattr(shmckpt.SaveHandle, "wait", slow_wait)


def test_model_checkpoint_versions_keep_every_save(tmp_path, monkeypatch):
    """ModelCheckpoint picks NAME-vN by whether NAME exists: the path must exist when
    save_checkpoint returns, or the next save reuses it and the earlier step is lost."""
    _slow_commits(monkeypatch)
    d = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=str(d), filename="test", save_top_k=-1, monitor="epoch")
    t = L.Trainer(
        max_epochs=3, limit_train_batches=1, limit_val_batches=1, plugins=[ShmckptCheckpointIO()],
        callbacks=[mc], accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    t.fit(Net(), data())
    names = ["test.ckpt", "test-v1.ckpt", "test-v2.ckpt"]
    assert sorted(mc.best_k_models) == sorted(str(d / n) for n in names)
    ls = links(d)
    assert sorted(ls) == sorted(names), ls
    io = ShmckptCheckpointIO()
    for epoch, n in enumerate(names):
        got = io.load_checkpoint(d / n)
        assert got["epoch"] == epoch and got["global_step"] == epoch + 1, (n, got["epoch"])
    assert sorted(n for n in os.listdir(d) if n.startswith("step-")) == sorted(ls.values())


def test_a_new_name_exists_when_save_returns_and_an_old_one_keeps_its_step(tmp_path, monkeypatch):
    _slow_commits(monkeypatch, 0.5)
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    p, q = tmp_path / "a.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint({"n": 0, "w": torch.ones(2)}, q)
    io.teardown()
    io.save_checkpoint({"n": 1, "w": torch.ones(2)}, p)
    io.save_checkpoint({"n": 2, "w": torch.ones(2)}, q)
    # Not committed yet: the new name is reserved (a regular file: os.path.exists is true
    # as fsspec's LocalFileSystem sees it), the old one still names its committed step.
    assert os.path.isfile(p) and not os.path.islink(p)
    assert shmckpt._shmckpt.resolve_name(str(tmp_path), "a.ckpt") == (1, "a.ckpt")
    assert os.readlink(q) == "step-0"
    assert shmckpt._shmckpt.linked_steps(str(tmp_path)) == [0, 1]
    # Loading waits for the saves queued before it.
    assert io.load_checkpoint(p)["n"] == 1 and io.load_checkpoint(q)["n"] == 2
    assert links(tmp_path) == {"a.ckpt": "step-1", "last.ckpt": "step-2"}
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".shmckpt-rank")) == [
        "a.ckpt", "last.ckpt", "step-1", "step-2"
    ]
    io.teardown()


def test_a_step_in_flight_is_never_removed_when_an_earlier_save_takes_its_name(tmp_path, monkeypatch):
    """A name emptied by the trainer (Lightning's _link_checkpoint os.remove()s its link
    path) and saved again while the earlier save of that name is unpublished: the
    earlier publish replaces the new reservation, and must not remove the step that
    reservation named (committed by then, published next)."""
    _slow_commits(monkeypatch, 0.5)
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    p = tmp_path / "last.ckpt"
    io.save_checkpoint({"n": 0}, p)
    os.remove(p)
    io.save_checkpoint({"n": 1}, p)
    assert shmckpt._shmckpt.resolve_name(str(tmp_path), "last.ckpt") == (1, "last.ckpt")
    io.teardown()  # raises the first error of a publish
    assert os.readlink(p) == "step-1" and io.load_checkpoint(p)["n"] == 1
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-1"]


def test_a_reservation_left_by_an_ended_process_loads_its_step_or_says_why(tmp_path):
    from shmckpt import _shmckpt

    d = str(tmp_path)
    ck = shmckpt.Checkpointer(d, rank=0, world_size=1)
    ck.save(4, {"n": 4}, metadata={"lightning.path": "kept.ckpt"}).wait()
    ck.close()
    # Committed, not published (the process ended between): the step is loaded.
    assert _shmckpt.reserve_name(d, "kept.ckpt", 4) is True
    assert _shmckpt.reserve_name(d, "kept.ckpt", 9) is False  # an existing name is left
    # Never committed, or committed for another name: NotFound saying so.
    assert _shmckpt.reserve_name(d, "lost.ckpt", 7) is True
    assert _shmckpt.reserve_name(d, "other.ckpt", 4) is True
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    assert io.load_checkpoint(tmp_path / "kept.ckpt")["n"] == 4
    with pytest.raises(shmckpt.NotFound, match="reserved for step 7 by a save that was never committed"):
        io.load_checkpoint(tmp_path / "lost.ckpt")
    with pytest.raises(shmckpt.NotFound, match="was saved for 'kept.ckpt'"):
        io.load_checkpoint(tmp_path / "other.ckpt")
    # A new save takes a step after every step a name names (7 is still reserved).
    io.save_checkpoint({"n": 8}, tmp_path / "new.ckpt")
    io.teardown()
    assert os.readlink(tmp_path / "new.ckpt") == "step-8"
    # Removing a reserved name removes the name; step 4 stays while kept.ckpt names it.
    io.remove_checkpoint(tmp_path / "other.ckpt")
    io.remove_checkpoint(tmp_path / "lost.ckpt")
    io.teardown()
    assert not os.path.lexists(tmp_path / "other.ckpt") and not os.path.lexists(tmp_path / "lost.ckpt")
    assert (tmp_path / "step-4").is_dir() and io.load_checkpoint(tmp_path / "kept.ckpt")["n"] == 4


@pytest.mark.parametrize("end", ["return", "sys.exit(0)"])
def test_a_process_that_saves_and_exits_at_once_publishes_its_save(tmp_path, end):
    """SLURM's auto-requeue saves then ends the process: the save is committed and its
    name published before the interpreter is gone."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys, time, torch, shmckpt
        from shmckpt.lightning import ShmckptCheckpointIO
        orig = shmckpt.SaveHandle.wait
        def slow(self):
            time.sleep(0.5)
            return orig(self)
        shmckpt.SaveHandle.wait = slow
        def main():
            io = ShmckptCheckpointIO()
            io.save_checkpoint({{"w": torch.arange(6.0), "epoch": 3}}, sys.argv[1])
            {end}
        main()
    """)
    p = tmp_path / "hpc_ckpt_1.ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = zygote.run([sys.executable, "-c", script, str(p)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.readlink(p) == "step-0"
    got = ShmckptCheckpointIO().load_checkpoint(p)
    assert got["epoch"] == 3 and raw(got["w"]) == raw(torch.arange(6.0))


def test_names_like_engine_directories_are_a_trainers_to_give(tmp_path):
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    # ModelCheckpoint(filename="step-{step}") makes `step-5.ckpt`: not the engine's step-5.
    io.save_checkpoint({"w": torch.arange(2.0)}, tmp_path / "step-5.ckpt")
    io.teardown()
    assert os.readlink(tmp_path / "step-5.ckpt") == "step-0"
    assert raw(io.load_checkpoint(tmp_path / "step-5.ckpt")["w"]) == raw(torch.arange(2.0))
    for own in ("step-5", "step-5.partial", "step-5.trash", "step-5.aside-1", ".shmckpt-x"):
        with pytest.raises(shmckpt.UnsafePath, match="shmckpt's own"):
            io.save_checkpoint({"w": torch.ones(1)}, tmp_path / own)
    io.teardown()


def test_unknown_settings_and_urls_are_refused(tmp_path, monkeypatch):
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    # Settings are checked at construction: an unknown one is named, the valid ones listed.
    with pytest.raises(TypeError, match=r"unknown setting 'keep_lst'; the settings are staging_capacity, chunk_size"):
        ShmckptCheckpointIO(keep_lst=3)
    with pytest.raises(TypeError, match=r"'keep_last' \(Lightning saves on rank zero"):
        ShmckptCheckpointIO(keep_last=2)
    # URLs are refused, never written as local paths (./s3:/bucket/...).
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for url in ("s3://bucket/run/last.ckpt", "memory://run/last.ckpt", "gcs://b/x.ckpt"):
        scheme = url.split(":")[0]
        with pytest.raises(ValueError, match=f"is a {scheme}:// URL"):
            io.save_checkpoint({"w": torch.ones(1)}, url)
        with pytest.raises(ValueError, match=f"is a {scheme}:// URL"):
            io.load_checkpoint(url)
        with pytest.raises(ValueError, match=f"is a {scheme}:// URL"):
            io.remove_checkpoint(url)
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == before
    # file:// is a local path.
    io.save_checkpoint({"w": torch.arange(3.0)}, f"file://{tmp_path}/f.ckpt")
    assert raw(io.load_checkpoint(f"file://{tmp_path}/f.ckpt")["w"]) == raw(torch.arange(3.0))
    io.teardown()
    assert os.path.islink(tmp_path / "f.ckpt")
    # shmckpt:// (the plugin's own format, shmckpt.fs) is a local path too.
    assert raw(io.load_checkpoint(f"shmckpt://{tmp_path}/f.ckpt")["w"]) == raw(torch.arange(3.0))
    io.teardown()


# -- outside a Trainer: load_from_checkpoint, torch.load, the converter ---------------------


def trained_run(tmp_path):
    """A Net (non-default hyper-parameters) trained 2 epochs through the plugin with
    ModelCheckpoint(save_top_k=1, save_last=True); returns (model, dirpath)."""
    model = Net(lr=0.02, width=12, tag="run")
    d = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=str(d), save_last=True, save_top_k=1, monitor="score", mode="max")
    trainer(tmp_path, 2, [ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))], [mc]).fit(model, data())
    return model, d


def same_model(got, want):
    assert type(got) is type(want)
    assert dict(got.hparams) == dict(want.hparams)
    w = want.state_dict()
    assert list(got.state_dict()) == list(w)
    for k, v in got.state_dict().items():
        assert v.dtype == w[k].dtype and torch.equal(v, w[k]), k


def test_lightnings_own_loaders_read_a_plugin_checkpoint_through_shmckpt_urls(tmp_path):
    import fsspec

    from shmckpt.fs import ShmckptFileSystem
    from shmckpt.lightning import load_from_checkpoint

    trained, d = trained_run(tmp_path)
    last = str(d / "last.ckpt")
    assert os.readlink(last).startswith("step-")
    assert trained.hparams.lr == 0.02  # the defaults would not show a lost hyper-parameter

    # Lightning's own LightningModule.load_from_checkpoint, unchanged, through fsspec.
    same_model(Net.load_from_checkpoint(f"shmckpt://{last}"), trained)
    # The helper (the same through a stream), with a hyper-parameter override.
    same_model(load_from_checkpoint(Net, last), trained)
    assert load_from_checkpoint(Net, last, lr=0.5).hparams.lr == 0.5
    # The step directory itself reads too.
    same_model(Net.load_from_checkpoint(f"shmckpt://{d}/{os.readlink(last)}"), trained)

    # torch.load of the stream, weights_only=True (no pickle beyond tensors and plain values).
    with fsspec.open(f"shmckpt://{last}", "rb") as f:
        ckpt = torch.load(f, weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["global_step"] == 8
    assert ckpt["hyper_parameters"] == {"lr": 0.02, "width": 12, "tag": "run"}
    assert ckpt.keys() == ShmckptCheckpointIO().load_checkpoint(last).keys()
    for k, v in trained.state_dict().items():
        assert torch.equal(ckpt["state_dict"][k], v), k

    # Trainer.fit(ckpt_path=shmckpt://...) resumes through Lightning's own TorchCheckpointIO
    # (fsspec exists + open), and through the plugin (a local path to it).
    for plugins in ([], [ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))]):
        t = trainer(tmp_path / f"resume{len(plugins)}", 3, plugins, [])
        m = Net(lr=0.02, width=12, tag="run")
        t.fit(m, data(), ckpt_path=f"shmckpt://{last}")
        assert [s for s, _ in m.losses] == [8, 9, 10, 11]  # epochs 0-1 restored, epoch 2 run

    # The filesystem: checkpoints are files, shmckpt's own names are not listed.
    fs = fsspec.filesystem("shmckpt")
    assert isinstance(fs, ShmckptFileSystem)
    names = sorted(os.path.basename(n) for n in fs.ls(f"shmckpt://{d}", detail=False))
    assert names == sorted(os.listdir(d)) and not [n for n in names if n.startswith(".")]
    info = fs.info(f"shmckpt://{last}")
    assert info["type"] == "file" and info["step"] == int(os.readlink(last)[5:]) and info["size"] > 0
    assert fs.exists(f"shmckpt://{last}") and not fs.exists(f"shmckpt://{d}/nope.ckpt")
    # Read-only: never written as a local path.
    with pytest.raises(PermissionError, match="shmckpt:// is read-only"):
        fsspec.open(f"shmckpt://{d}/new.ckpt", "wb").open()
    assert not os.path.lexists(d / "new.ckpt")
    # A directory that is no checkpoint says so (not a bare IsADirectoryError).
    with pytest.raises(IsADirectoryError, match="not a checkpoint of ShmckptCheckpointIO"):
        Net.load_from_checkpoint(f"shmckpt://{d}")
    with pytest.raises(FileNotFoundError):
        load_from_checkpoint(Net, d / "nope.ckpt")


def test_to_torch_file_converts_for_torch_load_and_plain_paths(tmp_path):
    from shmckpt.lightning import to_torch_file

    trained, d = trained_run(tmp_path)
    last = d / "last.ckpt"
    out = tmp_path / "export" / "model.ckpt"
    out.parent.mkdir()
    assert to_torch_file(last, out) == str(out)
    assert os.path.isfile(out) and not os.path.islink(out)
    assert sorted(os.listdir(out.parent)) == ["model.ckpt"]  # no temporary left
    # A plain torch.save file: torch.load and load_from_checkpoint with a plain path.
    ckpt = torch.load(out, weights_only=True)
    for k, v in trained.state_dict().items():
        assert torch.equal(ckpt["state_dict"][k], v), k
    same_model(Net.load_from_checkpoint(str(out)), trained)
    # The converted file is the same dict the plugin loads, optimizer state included.
    same(ckpt, ShmckptCheckpointIO().load_checkpoint(last), "ckpt")
    # Converting over the plugin's own link is refused (the link is the plugin's).
    with pytest.raises(ValueError, match="link or a directory"):
        to_torch_file(last, last)
    with pytest.raises(ValueError, match="link or a directory"):
        to_torch_file(last, d)
    assert os.path.islink(last)


def test_a_damaged_checkpoint_is_refused_by_load_from_checkpoint(tmp_path):
    from shmckpt.lightning import load_from_checkpoint

    trained, d = trained_run(tmp_path)
    sdir = d / os.readlink(d / "last.ckpt")
    (f,) = [p for p in sdir.iterdir() if p.suffix == ".safetensors"]
    b = bytearray(f.read_bytes())
    b[-1] ^= 0x01  # the last byte of the last tensor
    f.write_bytes(bytes(b))
    with pytest.raises(shmckpt.ChecksumError):
        load_from_checkpoint(Net, d / "last.ckpt")
    with pytest.raises(shmckpt.ChecksumError):
        Net.load_from_checkpoint(f"shmckpt://{d}/last.ckpt")


def test_the_wheel_registers_the_shmckpt_protocol_with_fsspec():
    """The entry point (python/pyproject.toml, fsspec.specs): a process that never imports
    shmckpt.lightning resolves shmckpt:// (as Lightning's get_filesystem does)."""
    import subprocess
    import sys

    code = (
        "import sys, fsspec; cls = fsspec.get_filesystem_class('shmckpt'); "
        "print(cls.__module__, cls.__name__, 'shmckpt.lightning' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["shmckpt.fs", "ShmckptFileSystem", "False"]


def test_fit_and_teardown_leave_only_checkpoints_in_dirpath(tmp_path):
    """After fit (Lightning tears the plugin down), dirpath holds the names
    ModelCheckpoint kept and the steps they name: no rank lock, no reservation, no
    temporary link. The lock exists while the engine is open, and one held by someone
    else at teardown is left to them."""
    import fcntl

    seen = []

    class Look(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            # Lightning runs ModelCheckpoint last: epoch 0's save has not happened yet.
            seen.append(sorted(n for n in os.listdir(d) if n.startswith(".")) if d.exists() else None)

    d = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=str(d), save_last=True, save_top_k=2, monitor="score", mode="max")
    trainer(tmp_path, 3, [ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))], [mc, Look()]).fit(Net(), data())
    assert seen == [None, [".shmckpt-rank-0.lock"], [".shmckpt-rank-0.lock"]]  # the open engine's
    ls = links(d)
    assert sorted(ls) == sorted(os.path.basename(p) for p in (*mc.best_k_models, mc.last_model_path))
    assert sorted(os.listdir(d)) == sorted({*ls, *ls.values()})
    # Lightning's own listing of the directory (fsspec) shows the same names.
    import fsspec

    assert sorted(os.path.basename(p) for p in fsspec.filesystem("file").ls(str(d), detail=False)) == sorted(
        os.listdir(d)
    )
    # The removal takes the lock as an engine would: a held lock is left to its holder.
    from shmckpt.lightning import _remove_rank_lock

    lock = tmp_path / ".shmckpt-rank-0.lock"
    io = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "x.ckpt")
    io._drain()
    _remove_rank_lock(str(tmp_path))  # the open engine holds it
    assert lock.exists()
    io.teardown()
    assert not lock.exists()
    shmckpt.Checkpointer(str(tmp_path), tuning=shmckpt.Tuning(staging_capacity=MIB, chunk_size=MIB)).close()
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a probe (shmckpt shm / recover)
        _remove_rank_lock(str(tmp_path))
        assert lock.exists()
    finally:
        os.close(fd)
    _remove_rank_lock(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ckpts", "step-0", "x.ckpt"]


def test_a_second_plugin_loads_what_the_first_is_still_publishing_and_pickling(tmp_path, monkeypatch):
    """Lightning's own tests save with one Trainer and load with the next at once: the
    second plugin waits for the first's publish instead of reading its reservation."""
    import pickle
    import time

    orig_wait = shmckpt.SaveHandle.wait

    def slow_wait(self):
        time.sleep(0.5)  # the commit is slow: the name stays reserved meanwhile
        return orig_wait(self)

    monkeypatch.setattr(shmckpt.SaveHandle, "wait", slow_wait)
    first = ShmckptCheckpointIO(tuning=shmckpt.Tuning(chunk_size=MIB))
    p = tmp_path / "checkpoint.ckpt"
    first.save_checkpoint({"w": torch.arange(4.0), "n": 7}, p)
    assert os.path.isfile(p) and not os.path.islink(p)  # reserved, not published yet
    got = ShmckptCheckpointIO().load_checkpoint(p)
    assert got["n"] == 7 and raw(got["w"]) == raw(torch.arange(4.0)) and os.path.islink(p)
    # torch.save(trainer) pickles the plugin: a copy is a new plugin with its settings.
    copy = pickle.loads(pickle.dumps(first))
    assert copy._settings == first._settings == {"chunk_size": MIB, "keep_in_memory": False}
    assert copy._cks == {} and copy._queued == []
    first.teardown()
