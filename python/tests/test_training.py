"""Training state: optimizers, schedulers, RNG, load_into, non-blocking saves under guard."""

import copy
import signal
import time

import numpy as np
import pytest
import torch

import shmckpt

from test_state import assert_same, raw


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def train(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


def make(opt_cls=torch.optim.AdamW, **kw):
    model = Net()
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


@pytest.mark.parametrize(
    "opt_cls,kw",
    [
        (torch.optim.AdamW, {"betas": (0.8, 0.99), "weight_decay": 0.1}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    ],
)
def test_optimizer_scheduler_rng_round_trip_and_resume_bit_exact(ck, opt_cls, kw):
    torch.manual_seed(0)
    model, opt, sched = make(opt_cls, **kw)
    train(model, opt, sched, 3, seed=1)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "step": 3,
    }
    ck.save(3, state).wait()
    back = ck.load(3)
    assert_same(state, back)
    # Resume: a fresh model/optimizer/scheduler restored from the checkpoint continues
    # exactly like the original.
    torch.manual_seed(123)
    m2, o2, s2 = make(opt_cls, **kw)
    m2.load_state_dict(back["model"])
    o2.load_state_dict(back["optim"])
    s2.load_state_dict(back["sched"])
    torch.set_rng_state(back["rng"])
    a = torch.rand(5)
    torch.set_rng_state(state["rng"])
    assert torch.equal(a, torch.rand(5))
    train(model, opt, sched, 2, seed=2)
    train(m2, o2, s2, 2, seed=2)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and raw(v) == raw(v2), k
    assert sched.get_last_lr() == s2.get_last_lr()


def test_load_into_writes_in_place(ck):
    torch.manual_seed(0)
    model, opt, sched = make()
    train(model, opt, sched, 3, seed=1)
    ck.save(3, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
    m2, o2, s2 = make()
    train(m2, o2, s2, 1, seed=9)  # so the optimizer has state tensors to write into
    ptrs = {k: v.data_ptr() for k, v in m2.state_dict().items()}
    r = ck.load_into({"model": m2.state_dict(), "optim": o2.state_dict()})
    assert r.step == 3 and r.missing_keys == [] and r.unexpected_keys == []
    for k, v in m2.state_dict().items():
        assert v.data_ptr() == ptrs[k], k  # same memory
        assert raw(v) == raw(model.state_dict()[k]), k
    for p, p2 in zip(model.parameters(), m2.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert raw(opt.state[p][key]) == raw(o2.state[p2][key])


def test_load_into_lists_every_mismatch(ck, root):
    ck.save(1, {"model": {"a": torch.ones(4), "b": torch.ones(2, 3), "c": torch.ones(1), "d": torch.ones(1)}}).wait()
    dest = {
        "model": {
            "a": torch.zeros(4, dtype=torch.float16),  # dtype
            "b": torch.zeros(3, 2),  # shape
            "c": torch.zeros(1),  # fine
            "e": torch.zeros(1),  # missing from the checkpoint
        }
    }
    before = {k: raw(v) for k, v in dest["model"].items()}
    with pytest.raises(shmckpt.DestinationError) as ei:
        ck.load_into(dest)
    msg = str(ei.value)
    for needle in (
        "model.a: checkpoint has F32 [4], destination is F16 [4]",
        "model.b: checkpoint has F32 [2, 3], destination is F32 [3, 2]",
        "model.e: in the destination, not in the checkpoint",
        "model.d: in the checkpoint, not in the destination",
    ):
        assert needle in msg, msg
    assert "model.c" not in msg
    assert {k: raw(v) for k, v in dest["model"].items()} == before  # nothing written


def test_strict_false_reports_missing_and_unexpected(ck):
    ck.save(1, {"model": {"a": torch.arange(4.0), "old": torch.ones(2)}}).wait()
    dest = {"model": {"a": torch.zeros(4), "new": torch.zeros(3)}}
    r = shmckpt.Checkpointer.load_into(ck, dest, strict=False)
    assert r.missing_keys == ["model.new"] and r.unexpected_keys == ["model.old"]
    assert raw(dest["model"]["a"]) == raw(torch.arange(4.0))
    assert raw(dest["model"]["new"]) == raw(torch.zeros(3))
    # dtype/shape mismatches stay errors with strict=False.
    with pytest.raises(shmckpt.DestinationError):
        ck.load_into({"model": {"a": torch.zeros(5)}}, strict=False)


def test_orig_mod_prefix_of_torch_compile_is_mapped(ck):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(3, 3))
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    ck.save(1, {"model": plain.state_dict()}).wait()
    ck.load_into({"model": compiled.state_dict()})
    assert raw(compiled._orig_mod[0].weight) == raw(plain[0].weight)
    # And the other way round.
    compiled2 = torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    ck.save(2, {"model": compiled2.state_dict()}).wait()
    plain2 = torch.nn.Sequential(torch.nn.Linear(3, 3))
    ck.load_into({"model": plain2.state_dict()}, step=2)
    assert raw(plain2[0].weight) == raw(compiled2._orig_mod[0].weight)


def test_load_into_non_contiguous_destination_and_numpy(ck):
    src = torch.arange(12.0).reshape(3, 4)
    ck.save(1, {"t": src, "n": np.arange(5, dtype=np.int32)}).wait()
    dest_base = torch.zeros(4, 3)
    dest = {"t": dest_base.t(), "n": np.zeros(5, dtype=np.int32)}
    ck.load_into(dest)
    assert torch.equal(dest_base.t(), src)
    assert dest["n"].tolist() == [0, 1, 2, 3, 4]


def test_non_blocking_save_under_guard_is_a_consistent_snapshot(root):
    """BatchNorm running statistics change in the forward pass, before opt.step: they are
    captured at the call; the parameters (guarded) are copied in the background and
    opt.step waits for them."""
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20))
    torch.manual_seed(0)
    model = Net()
    model.big = torch.nn.Linear(1024, 2048)  # 8 MiB of guarded parameters (+16 MiB of state)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ck.guard(opt)
    train(model, opt, None, 2, seed=3)
    for trial in range(3):
        step = 10 + trial
        # Optimizer state (24 MiB) first: the engine stages it before the BN buffers.
        state = {"optim": opt.state_dict(), "model": model.state_dict(), "step": step}
        snap = copy.deepcopy(state)
        h = ck.save(step, state, blocking=False)
        # The trainer goes on at once: forward (changes BN running stats) and backward.
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean() + model.big.weight.sum() * 0
        loss.backward()
        assert not torch.equal(model.bn.running_mean, snap["model"]["bn.running_mean"])
        opt.step()  # waits for staging
        assert h.staged()
        opt.zero_grad()
        rep = h.wait()
        assert rep["step"] == step and h.done()
        back = ck.load(step)
        assert_same(snap, back)
    ck.close()


def test_non_blocking_without_guard_captures_everything(ck):
    t = torch.arange(1000.0)
    arr = np.arange(10)
    h = ck.save(1, {"t": t, "a": arr}, blocking=False)
    t.add_(1)  # changed right after the call
    arr += 1
    h.wait()
    back = ck.load(1)
    assert raw(back["t"]) == raw(torch.arange(1000.0))
    assert back["a"].tolist() == list(range(10))


def test_failed_non_blocking_save_releases_and_raises(ck):
    ck.save(1, {"a": torch.ones(1)}).wait()
    with pytest.raises(shmckpt.StepExists):
        ck.save(1, {"a": torch.ones(1)}, blocking=False)


def test_ctrl_c_during_wait_leaves_the_save_intact(root):
    with shmckpt.Checkpointer(
        root, tuning=shmckpt.Tuning(staging_capacity=288 << 20, chunk_size=1 << 20, writer_threads=1, queue_depth=1)
    ) as c:
        g = torch.Generator().manual_seed(5)
        state = {"w": torch.randint(0, 2**31 - 1, (64 << 20,), dtype=torch.int32, generator=g)}
        old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            h = c.save(1, state, blocking=False)
            signal.setitimer(signal.ITIMER_REAL, 0.005)
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                h.wait()
            assert time.monotonic() - t0 < 5
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert not h.done(), "the save finished before the interrupt: the test proved nothing"
        rep = h.wait()  # the save carried on
        assert rep["step"] == 1
        back = c.load(1)
        assert raw(back["w"]) == raw(state["w"])


def test_gil_is_released_while_staging_and_waiting(root):
    """Another Python thread runs during the engine's save (staging) and wait (writing):
    a call holding the GIL would freeze it for the whole call (0 ticks)."""
    import threading

    from shmckpt import _shmckpt

    e = _shmckpt.Engine(str(root), dict(staging_capacity=160 << 20, chunk_size=1 << 20, writer_threads=1, queue_depth=1))
    w = torch.ones(32 << 20, dtype=torch.int32)  # 128 MiB
    tensors = [("w", "I32", [w.numel()], w.__dlpack__(), w.numel() * 4, -1)]
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    try:
        time.sleep(0.01)
        before = ticks[0]
        h = e.save(1, tensors, {}, [], True)  # one call: staging 128 MiB
        mid = ticks[0]
        h.wait()  # one call: until durable
        after = ticks[0]
    finally:
        stop.set()
        th.join()
        e.close()
    assert mid - before > 100, mid - before
    assert after - mid > 100, after - mid


def run_loop(ck, start, stop, every, model, opt, sched):
    """The training loop of docs/python.md (CPU): save every `every` steps, non-blocking."""
    pending = None
    for step in range(start, stop):
        x = torch.randn(8, 16)  # data from the global RNG, restored on resume
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if ck is not None and step % every == 0:
            if pending is not None:
                pending.wait()
            pending = ck.save(
                step,
                {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "rng": {"cpu": torch.get_rng_state()},
                    "step": step,
                },
                blocking=False,
            )


def test_documented_loop_resumes_bit_exact_after_a_restart(root):
    def fresh(seed):
        torch.manual_seed(seed)
        m = Net()
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30)
        return m, o, s

    # Uninterrupted reference.
    m0, o0, s0 = fresh(0)
    run_loop(None, 0, 30, 5, m0, o0, s0)

    # Run 1: dies after step 17 (last checkpoint: step 15).
    m1, o1, s1 = fresh(0)
    ck = shmckpt.Checkpointer(root, keep_last=2, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20))
    ck.guard(o1)
    run_loop(ck, 0, 18, 5, m1, o1, s1)
    ck.close()

    # Run 2: fresh objects, resume from the newest committed checkpoint.
    m2, o2, s2 = fresh(99)
    with shmckpt.Checkpointer(
        root, keep_last=2, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20)
    ) as ck2:
        assert ck2.list() == [10, 15]
        state = ck2.load("latest")
        m2.load_state_dict(state["model"])
        o2.load_state_dict(state["optim"])
        s2.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"]["cpu"])
        ck2.guard(o2)
        run_loop(ck2, state["step"] + 1, 30, 5, m2, o2, s2)
    for (k, v), (k2, v2) in zip(m0.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and raw(v) == raw(v2), k
