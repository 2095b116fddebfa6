"""CUDA tests (marker ``gpu``): skipped without a GPU; ``SHMCKPT_REQUIRE_GPU=1`` makes a
missing GPU a failure. Run: ``SHMCKPT_REQUIRE_GPU=1 pytest python/tests -m gpu``."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import shmckpt

from test_state import assert_same, file_of, raw

pytestmark = pytest.mark.gpu


def cpu_copy(state):
    """A deep copy with every tensor cloned to the host (the snapshot to compare with)."""
    if isinstance(state, dict):
        return type(state)((k, cpu_copy(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(cpu_copy(v) for v in state)
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return copy.deepcopy(state)


class Block(torch.nn.Module):
    def __init__(self, d=64, vocab=100):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            [torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True) for _ in range(2)]
        )
        self.norm = torch.nn.BatchNorm1d(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def step(model, opt, g):
    x = torch.randint(0, 100, (4, 16), device="cuda", generator=g)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_transformer_adamw_non_blocking_under_guard_restores_bit_identical(root):
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    model = Block().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20)) as ck:
        ck.guard(opt)
        for _ in range(3):
            step(model, opt, g)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
        snap = cpu_copy(state)
        h = ck.save(3, state, blocking=False)
        step(model, opt, g)  # training continues: forward changes BN stats, step waits
        step(model, opt, g)
        h.wait()
        # A fresh model and optimizer (with state to write into) restored in place.
        torch.manual_seed(1)
        m2 = Block().cuda()
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
        step(m2, o2, torch.Generator(device="cuda").manual_seed(5))
        r = ck.load_into({"model": m2.state_dict(), "optim": o2.state_dict()}, step=3)
        assert r.missing_keys == [] and r.unexpected_keys == []
        assert_same(snap["model"], cpu_copy(m2.state_dict()))
        assert_same(snap["optim"]["state"], cpu_copy(o2.state_dict()["state"]))
        back = ck.load(3, map_location="cuda:0")
        assert back["model"]["head.weight"].device.type == "cuda"
        assert_same(snap, cpu_copy(back))


def test_save_allocates_no_device_memory(root):
    torch.manual_seed(0)
    x = torch.randn(1024, 1024, device="cuda")
    state = {"a": x, "t": x.t(), "slice": x[::3, 5:9], "b": torch.ones(7, device="cuda", dtype=torch.bfloat16)}
    torch.cuda.synchronize()
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20)) as ck:
        ck.prepare_cuda([torch.cuda.current_device()])
        before = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        ck.save(1, state).wait()
        assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == before
        h = ck.save(2, state, blocking=False)
        h.wait()
        assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == before
        for s in (1, 2):
            back = ck.load(s)
            for k, v in state.items():
                assert raw(back[k]) == raw(v), (s, k)


def test_copies_are_ordered_after_the_current_stream(root):
    s = torch.cuda.Stream()
    x = torch.zeros(4 << 20, device="cuda")
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20)) as ck:
        with torch.cuda.stream(s):
            y = torch.randn(2048, 2048, device="cuda")
            for _ in range(20):  # keep the stream busy
                y = y @ y / 2048
            x.fill_(7.0)
            ck.save(1, {"x": x}).wait()
        assert torch.all(ck.load(1)["x"] == 7.0)


@pytest.mark.parametrize(
    "copy_ahead,latches,blocking",
    [(0, None, None), (128 << 10, None, None), (None, None, None), (0, True, None), (128 << 10, True, None), (None, True, None), (128 << 10, None, True), (None, True, True)],
)
def test_guarded_saves_of_many_tensors_keep_their_bytes_whatever_the_copies_queued_ahead(root, copy_ahead, latches, blocking):
    """Guarded non-blocking saves of 300 tensors over ~110 staging chunks of 64 KiB, the
    optimizer stepping right after each call and the state read back on the host right
    after the step (the interpreter's lock held while the device waits): each save holds
    the state of its call, with the device copies all queued at once (0), two chunks ahead
    (128 KiB) or the default (256 MiB), the step waiting for them on the host until the
    last ones are queued (the default) or on a stream latch (``stream_latches=True``), the
    engine's waits for its copies spinning (the default) or sleeping
    (``blocking_sync=True``)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1 + 37 * i, device="cuda")) for i in range(300)]
    opt = torch.optim.SGD(params, lr=0.5)
    tuning = shmckpt.Tuning(staging_capacity=32 << 20, chunk_size=64 << 10, copy_ahead=copy_ahead, stream_latches=latches, blocking_sync=blocking)
    with shmckpt.Checkpointer(root, tuning=tuning) as ck:
        assert ck._shared.engine.stream_latches is (latches is True)
        assert ck._shared.engine.blocking_sync is (blocking is True)
        ck.guard(opt)
        snaps = {}
        for step_no in range(1, 5):
            for p in params:
                p.grad = torch.full_like(p, float(step_no))
            state = {f"p{i}": p for i, p in enumerate(params)}
            snaps[step_no] = cpu_copy(state)
            ck.save(step_no, state, blocking=False)
            opt.step()  # overwrites every tensor of the save once its copies are done
        ck.wait()
        for step_no, snap in snaps.items():
            back = ck.load(step_no)
            assert sorted(back) == sorted(snap)
            for k, v in snap.items():
                assert raw(back[k]) == raw(v), (step_no, k)


def test_interchange_with_safetensors_on_cuda(root):
    torch.manual_seed(0)
    model = Block().cuda()
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20)) as ck:
        ck.save(1, {"model": model.state_dict()}).wait()
    files = load_file(file_of(root, 1), device="cuda")
    for k, v in model.state_dict().items():
        assert torch.equal(files["model." + k], v), k


def test_mixed_cpu_and_cuda_load_into(root):
    state = {
        "w": torch.arange(12.0, device="cuda").reshape(3, 4),
        "step": torch.tensor(5.0),
        "n": torch.arange(3),
        "empty": torch.empty(0, 3, device="cuda"),
    }
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=16 << 20)) as ck:
        ck.save(1, state).wait()
        dest = {
            "w": torch.zeros(4, 3, device="cuda").t(),
            "step": torch.tensor(0.0),
            "n": torch.zeros(3, dtype=torch.int64),
            "empty": torch.empty(0, 3, device="cuda"),
        }
        ck.load_into(dest)
        back = ck.load(1, map_location="cuda:0")
    for k in state:
        assert raw(dest[k]) == raw(state[k]), k
        assert back[k].device.type == "cuda" and raw(back[k]) == raw(state[k]), k


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_over_nccl(root, tmp_path):
    from test_processes import WORKER, free_port

    port = free_port()
    outs = [tmp_path / f"out{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, WORKER, "nccl", str(root), str(r), "2", str(port), str(outs[r])])
        for r in range(2)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0]
    for r in range(2):
        res = json.loads(outs[r].read_text())
        assert res["ok"] == [True] * 4 and res["world_in_manifest"] == 2
