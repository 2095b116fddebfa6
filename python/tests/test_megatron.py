"""shmckpt.megatron: Megatron-Core's dist_checkpointing (``--async-save``,
``torch_dist``-style planning) through shmckpt, on CPU with gloo.

Multi-process tests spawn real ranks (tests/megatron_worker.py), check every exit status
and read what each rank verified. They skip, visibly, when megatron-core is not installed
(``SHMCKPT_REQUIRE_MEGATRON=1`` makes that a failure: CI installs it)."""

import importlib
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys

import pytest
import torch

if os.environ.get("SHMCKPT_REQUIRE_MEGATRON") == "1":
    importlib.import_module("megatron.core")  # a failure, not a skip
else:
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed (pip install megatron-core; CI sets SHMCKPT_REQUIRE_MEGATRON=1)"
    )

import safetensors.torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import shmckpt.megatron as smg  # noqa: E402
from shmckpt import errors  # noqa: E402
from shmckpt.dcp import ShmckptReader  # noqa: E402

from conftest import shmckpt_bin  # noqa: E402
from ranks_support import run_ranks  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "megatron_worker.py"
#: What megatron_worker.py imports at its top (~3.5 CPU-s a process): its ranks fork from a
#: server that imported these once (zygote.py).
MEGATRON = (
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "shmckpt.megatron",
)
sys.path.insert(0, str(HERE))
import megatron_worker as mw  # noqa: E402

LAYOUT_NAMES = sorted(mw.LAYOUT)


def spawn(scenario, world, workdir, timeout=240):
    """Run ``world`` ranks of ``scenario``; every one must exit 0. Returns their results."""
    run_ranks(WORKER, scenario, world, workdir, timeout=timeout, preload=MEGATRON)
    res = []
    for r in range(world):
        with open(os.path.join(workdir, f"result-{scenario}-{world}-{r}.json")) as f:
            res.append(json.load(f))
    return res


def _expect_loaded(got, rank, world, objects=True):
    exp = {}
    for name in LAYOUT_NAMES:
        shape, dtype, axis = mw.LAYOUT[name]
        local = list(shape)
        if axis is not None:
            local[axis] //= world
        exp[name] = [str(dtype), local, True]
    exp["common"] = {"iteration": 7, "args": {"lr": 0.5, "name": "tiny"}}
    if objects:
        exp["rng"] = {"rank": rank, "seed": 1234 + rank}
    assert got == exp


#: megatron-core 0.19's layout: no strategy registry, the common state handed to the
#: strategy (shmckpt publishes it as common.pt with the commit, not before).
NEW = smg._NEW_LAYOUT
#: What is in the checkpoint directory before the sharded save commits: Megatron 0.16's
#: common.pt (written by rank 0 before the sharded save), nothing on 0.19.
EARLY_FILES = [] if NEW else ["common.pt"]
#: Megatron's metadata.json (0.19 writes only the sharded backend).
METADATA_JSON = (
    {"sharded_backend": "shmckpt_dist", "sharded_backend_version": 1}
    if NEW
    else {
        "sharded_backend": "shmckpt_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
)

CKPT_FILES = [
    ".metadata",
    "common.pt",
    "manifest.json",
    "metadata.json",
    "rank-00000-of-00002.safetensors",
    "rank-00001-of-00002.safetensors",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two async saves on 2 ranks through Megatron's AsyncCallsQueue (the second
    scheduled while the first is pending; tensors changed right after each async_save
    returned), finalized, loaded back by dist_checkpointing.load."""
    work = tmp_path_factory.mktemp("megatron")
    return work, spawn("async_queue", 2, work)


def test_async_save_through_megatrons_queue_loads_back_bit_exact(saved):
    work, res = saved
    for rank, r in enumerate(res):
        # Nothing of the sharded save is in the directory before finalize (only
        # Megatron 0.16's common.pt, written synchronously by rank 0).
        assert r["files_before_finalize_0"] == EARLY_FILES
        assert r["files_before_finalize_1"] == EARLY_FILES
        # Both finalized, in order (NVRx 0.7's queue returns each request's own call_idx,
        # which it never sets: 0 for every call).
        assert r["finalized"] == ([0, 0] if r["request"][0] == "nvrx" else [0, 1])
        assert r["files"] == CKPT_FILES
        assert r["metadata_json"] == METADATA_JSON
        # The request is of the queue's class: Megatron's on 0.16, NVRx's on 0.19 with
        # NVRx installed (its default), Megatron's on 0.19 without it.
        assert r["request"] == mw.expected_request()
        # 0.16 finds shmckpt's load strategy from metadata.json; 0.19 has no registry
        # (the test passes ShmckptLoadShardedStrategy to load).
        assert r["load_strategy"] == ("TorchDistLoadShardedStrategy" if NEW else "ShmckptLoadShardedStrategy")
        # The values at async_save, not the ones written into the tensors afterwards.
        _expect_loaded(r["loaded_0"], rank, 2)
        _expect_loaded(r["loaded_1"], rank, 2)
    # Only the engines' roots stay in the spool (no step directories, no trash).
    spool = work / "ckpt" / ".shmckpt-dcp"
    assert sorted(os.listdir(spool)) == ["rank-00000", "rank-00001"]
    for rd in os.listdir(spool):
        for root in os.listdir(spool / rd):
            left = [p for p in os.listdir(spool / rd / root) if not p.startswith(".")]
            assert left == [], left


def test_megatron_checkpoint_is_a_shmckpt_checkpoint(saved):
    """The rank files, manifest and .metadata are shmckpt's: the CLI verifies every
    checksum, DCP loads the tensors through ShmckptReader under Megatron's keys, and each
    rank file is plain safetensors holding that rank's shards."""
    work, _ = saved
    d = work / "ckpt" / "iter_0000002"
    exe = shmckpt_bin()
    if exe is None:
        pytest.skip("no shmckpt command line (cargo build --bin shmckpt, or SHMCKPT_BIN)")
    out = subprocess.run([exe, "verify", str(d)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert [f["file"] for f in manifest["files"]] == CKPT_FILES[4:]
    # DCP through shmckpt's reader (single process, whole tensors).
    state = {n: torch.zeros(mw.LAYOUT[n][0], dtype=mw.LAYOUT[n][1]) for n in LAYOUT_NAMES}
    dcp.load(state, storage_reader=ShmckptReader(d), no_dist=True)
    for n in LAYOUT_NAMES:
        g = mw.global_tensor(n, *mw.LAYOUT[n][:2])
        assert torch.equal(state[n].view(torch.uint8), g.view(torch.uint8)), n
    # Plain safetensors per rank: rank 0 holds its shards and the replicated bias (main
    # replica), rank 1 its shards only.
    names = {}
    for k in range(2):
        f = safetensors.torch.load_file(str(d / f"rank-{k:05d}-of-00002.safetensors"))
        names[k] = sorted(n for n in f if not n.startswith("rng_state"))
        for n in names[k]:
            e = mw.expected_local(n, k, 2)
            assert torch.equal(f[n].view(torch.uint8), e.contiguous().view(torch.uint8)), (k, n)
    assert names[0] == LAYOUT_NAMES
    assert names[1] == sorted(n for n in LAYOUT_NAMES if mw.LAYOUT[n][2] is not None)


@pytest.mark.parametrize("world", [1, 4])
def test_saved_on_2_ranks_loads_on_another_world_size(saved, world):
    work, _ = saved
    res = spawn("reshard_load", world, work)
    for rank, r in enumerate(res):
        _expect_loaded(r["loaded"], rank, world, objects=False)


def test_synchronous_save_runs_the_same_request(tmp_path):
    res = spawn("sync", 2, tmp_path)
    for rank, r in enumerate(res):
        assert r["returned"] == "None"
        assert r["files"] == CKPT_FILES
        _expect_loaded(r["loaded"], rank, 2)


def test_a_failed_rank_fails_finalize_everywhere_and_commits_nothing(tmp_path):
    res = spawn("fail", 2, tmp_path)
    for r in res:
        assert r["error"] == "CheckpointException"
        assert r["failed_ranks"] == [1]
        # Neither shmckpt's files nor Megatron's metadata.json: not a checkpoint.
        assert r["files"] == EARLY_FILES


def test_tiny_gpt_saved_async_on_2_ranks_loads_into_a_fresh_model_bit_exact(tmp_path):
    """A megatron-core GPT (local layer spec, no TransformerEngine) on CPU, data
    parallel over 2 gloo ranks: the main replica (rank 0) writes the weights, rank 1 an
    empty file; the weights changed after async_save returned do not leak into the
    checkpoint; a fresh GPT of another seed loads it bit-exact."""
    res = spawn("gpt_cpu", 2, tmp_path)
    for r in res:
        assert r["differs_before_load"] is True
        assert r["tensors"] == 29
        assert r["bit_exact"] is True
        assert r["iteration"] == 5
    manifest = json.loads((tmp_path / "ckpt" / "iter_0000005" / "manifest.json").read_text())
    counts = [len(f["tensors"]) for f in manifest["files"]]
    assert counts[1] == 0 and counts[0] > 0


def _wait_in_child(reader, fd, pipe_id, owner):
    try:
        smg._wait_durable(reader, fd, pipe_id, owner)
    except errors.SaveFailed:
        os._exit(3)
    os._exit(0)


@pytest.mark.parametrize("how", ["ok", "failed", "trainer_gone"])
def test_async_fn_in_a_forked_child_follows_the_trainer(how):
    """The request's async_fn, run in a forked child as Megatron's TemporalAsyncCaller
    does: returns when the trainer reports durable, fails when it reports a failure, and
    fails (instead of waiting forever) when the trainer's end of the pipe goes away."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    st = os.fstat(writer.fileno())
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_wait_in_child, args=(reader, writer.fileno(), (st.st_dev, st.st_ino), os.getpid()))
    p.start()
    reader.close()
    if how == "ok":
        writer.send_bytes(b"ok")
    elif how == "failed":
        writer.send_bytes(b"IoError: disk full")
    writer.close()
    p.join(30)
    assert p.exitcode == {"ok": 0, "failed": 3, "trainer_gone": 3}[how]


def _persistent_worker(queue, done):
    """What Megatron's persistent worker (PersistentAsyncCaller.async_loop) does with
    each request, minus its torch.cuda.set_device: take it from the queue, run its
    async_fn; report each outcome."""
    for _ in range(2):
        req = queue.get()
        done.put("got")
        try:
            req.async_fn(*req.async_fn_args, **req.async_fn_kwargs)
            done.put("ok")
        except errors.SaveFailed as e:
            done.put(f"SaveFailed: {e}")


def test_request_travels_to_a_spawned_persistent_worker():
    """Requests as Megatron's persistent worker receives them (pickled through a
    spawn-context queue; the pipe's read end is duplicated into the worker when the
    queue's feeder thread pickles it): the first one's async_fn returns once the trainer
    reports durable; the second's fails when the trainer's end closes without a report."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    ctx = multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_persistent_worker, args=(queue, done))
    p.start()
    got = []
    for how in ("ok", "trainer_gone"):
        reader, writer = multiprocessing.Pipe(duplex=False)
        st = os.fstat(writer.fileno())
        queue.put(AsyncRequest(smg._wait_durable, (reader, writer.fileno(), (st.st_dev, st.st_ino), os.getpid()), []))
        assert done.get(timeout=180) == "got"
        if how == "ok":
            writer.send_bytes(b"ok")
        writer.close()
        got.append(done.get(timeout=60))
        reader.close()  # as retrieve_write_results does, after the worker reported
    p.join(30)
    assert p.exitcode == 0
    assert got == ["ok", "SaveFailed: shmckpt.megatron: the trainer went away before this rank's file was durable"]


def test_load_strategy_refuses_a_torch_dist_checkpoint(tmp_path):
    """A checkpoint of Megatron's own torch_dist writer is not shmckpt's: a clear error."""
    from torch.distributed.checkpoint import FileSystemWriter

    d = tmp_path / "tdist"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=FileSystemWriter(str(d)), no_dist=True)
    with pytest.raises(errors.CorruptError, match="not written by ShmckptWriter"):
        ShmckptReader(d).set_up_storage_reader(ShmckptReader(d).read_metadata(), True)
    with pytest.raises(FileNotFoundError, match="no DCP metadata"):
        smg.ShmckptLoadShardedStrategy().load_tensors_metadata(tmp_path / "missing")


def test_importing_registers_the_backend():
    if NEW:
        # megatron-core 0.19 has no registry of default strategies: nothing to register.
        assert smg.register() is False
        return
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy

    save = get_default_strategy(StrategyAction.SAVE_SHARDED, "shmckpt_dist", 1)
    load = get_default_strategy(StrategyAction.LOAD_SHARDED, "shmckpt_dist", 1)
    assert type(save) is smg.ShmckptSaveShardedStrategy and (save.backend, save.version) == ("shmckpt_dist", 1)
    assert type(load) is smg.ShmckptLoadShardedStrategy


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "0.18.1rc0", "1.0.0"])
def test_an_unsupported_megatron_core_is_refused_by_name(tmp_path, version):
    """Another megatron-core release than 0.16.x or 0.19.x: importing shmckpt.megatron
    raises ImportError naming the installed version (and the supported ones) instead
    of failing later on a moved module."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text(f"__version__ = {version!r}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    out = subprocess.run(
        [sys.executable, "-c", "import shmckpt.megatron"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        f"ImportError: shmckpt.megatron supports megatron-core 0.16.x and 0.19.x; "
        f"megatron-core {version} is installed ({core})"
    ), out.stderr


def test_the_installed_megatron_core_is_a_supported_one():
    from megatron.core import package_info

    assert smg.MEGATRON_VERSION == package_info.__version__
    assert smg.MEGATRON_VERSION.split(".")[:2] in (["0", "16"], ["0", "19"])
    assert smg._NEW_LAYOUT is (smg.MEGATRON_VERSION.split(".")[1] == "19")


@pytest.mark.parametrize("how", ["nvrx", "mcore", None])
def test_the_request_is_of_the_queue_the_async_strategy_names(how):
    """``async_strategy`` picks the AsyncRequest class: NVRx's for "nvrx" on 0.19 where
    NVRx is installed (its persistent worker runs only its own class), Megatron's
    otherwise; an unknown name is refused before anything is staged."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    want = AsyncRequest
    if NEW and how == "nvrx" and mw.expected_request()[1] == "nvidia_resiliency_ext":
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest as NvrxRequest

        want = NvrxRequest
    assert smg._request_class(how) is want
    with pytest.raises(TypeError, match="async_strategy 'bogus' is not supported"):
        smg._request_class("bogus")
