"""Deferred capture (issue 38, the save call's cost): a non-blocking save of the same tensors
(the same storages) as the last one, all of them in a guarded optimizer, reads only the containers at
the call; the tensors' metadata, the layout and the engine's call follow on the submitting
thread. Every save still stores exactly the state of its call (round trips compared byte
for byte), its errors are raised by the next save or wait (never by the optimizer's step),
and any change of what made the deferral safe (the guard, the optimizer's state, the
tensors' storages) makes the next save a capture at the call again."""

import collections
import itertools
import threading

import pytest
import torch

import shmckpt
from shmckpt.errors import SaveFailed, StepExists

from layout_support import ckpt, snapshot  # noqa: F401 (ckpt: fixture)
from test_state import assert_same, raw


def trainer(n=6, seed=38):
    """A model, its AdamW optimizer after one step (its state exists) and the state a
    trainer saves at every step: references to the parameters and moments."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        model(torch.randn(3, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    state = {"model": dict(model.named_parameters()), "optim": {}, "epoch": 0}
    for i, st in enumerate(opt.state.values()):
        state["optim"][str(i)] = dict(st)
    return model, opt, step, state


def test_a_repeated_guarded_save_stores_the_state_of_its_call(ckpt):
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    first = ckpt.save(1, state, blocking=False)
    assert not first._deferred  # nothing to compare with yet
    first.wait()
    for s in range(2, 6):
        state["epoch"] = s  # a plain value: read at the call
        want = snapshot(state)
        gate = threading.Event()
        if ckpt._saver.submitter is not None:  # from step 3: the capture surely runs late
            ckpt._saver.submitter.submit(gate.wait)
        h = ckpt.save(s, state, blocking=False)
        assert h._deferred
        # The containers change right after the call, before the capture ran: not this
        # save's. The optimizer's step waits for the capture, then changes every tensor in
        # place.
        state["epoch"] = -1
        state["late"] = torch.ones(3)
        state["optim"]["0"] = {"replaced": torch.zeros(2)}
        gate.set()
        step()
        h.wait()
        assert_same(want, ckpt.load(s))
        del state["late"]
        state["optim"]["0"] = dict(opt.state[next(iter(opt.state))])


def test_a_state_dict_made_anew_at_every_save_is_deferred(ckpt):
    """``model.state_dict()`` gives new detached tensors at every call and
    ``opt.state_dict()`` new containers: the same storages as the last save, so the save
    is deferred, and stores the values of its call."""
    model, opt, step, _ = trainer()
    ckpt.guard(opt)

    def state(epoch):
        return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": epoch}

    ckpt.save(1, state(1), blocking=False).wait()
    for s in (2, 3, 4):
        sd = state(s)
        want = snapshot(sd)
        h = ckpt.save(s, sd, blocking=False)
        assert h._deferred
        step()
        h.wait()
        assert_same(want, ckpt.load(s))


def test_a_frozen_parameter_is_saved_as_frozen(ckpt):
    """A change of a tensor's metadata on the same object (``requires_grad_``) is read by
    the deferred capture: the skeleton follows it."""
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    ckpt.save(1, state, blocking=False).wait()
    p = state["model"]["0.weight"]
    p.requires_grad_(False)
    want = snapshot(state)
    h = ckpt.save(2, state, blocking=False)
    assert h._deferred
    step()
    h.wait()
    back = ckpt.load(2)
    assert_same(want, back)
    assert isinstance(back["model"]["0.weight"], torch.nn.Parameter)
    assert back["model"]["0.weight"].requires_grad is False
    assert back["model"]["0.bias"].requires_grad is True


def test_a_failed_deferred_save_is_raised_by_the_next_save_not_the_optimizer_step(ckpt):
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    ckpt.save(1, state, blocking=False).wait()
    ckpt.save(2, state, blocking=False).wait()
    h = ckpt.save(2, state, blocking=False)  # committed already: the engine refuses it
    assert h._deferred
    step()  # the guard waits for the capture and does not raise its error
    with pytest.raises(StepExists):
        ckpt.save(3, state, blocking=False)  # reported once, here; nothing saved
    want = snapshot(state)
    h3 = ckpt.save(3, state, blocking=False)
    step()
    h3.wait()
    assert_same(want, ckpt.load(3))
    with pytest.raises(StepExists):
        h.wait()  # the handle keeps its error
    ckpt.wait()  # reported already: nothing left to raise


def test_a_failed_deferred_save_is_raised_by_wait(ckpt):
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    ckpt.save(1, state, blocking=False).wait()
    ckpt.save(1, state, blocking=False)
    with pytest.raises(StepExists):
        ckpt.wait()
    ckpt.wait()


def test_what_made_the_deferral_safe_changes_and_the_save_is_captured_at_the_call(ckpt):
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    ckpt.save(1, state, blocking=False).wait()
    assert ckpt.save(2, state, blocking=False)._deferred
    step()
    ckpt.wait()
    # A tensor replaced in the containers by a copy (other memory): not the last save's.
    state["model"]["0.bias"] = state["model"]["0.bias"].detach().clone()
    want = snapshot(state)
    h = ckpt.save(3, state, blocking=False)
    assert not h._deferred
    state["model"]["0.bias"].add_(1.0)  # not the optimizer's: copied at the call
    h.wait()
    assert_same(want, ckpt.load(3))
    state["model"]["0.bias"] = model[0].bias
    # The optimizer's state replaced (load_state_dict makes new tensors): the state's old
    # moments are no longer guarded, so they are copied at the call.
    opt.load_state_dict(opt.state_dict())
    want = snapshot(state)
    h = ckpt.save(4, state, blocking=False)
    assert not h._deferred
    step()
    h.wait()
    assert_same(want, ckpt.load(4))
    # A guard removed: every tensor copied at the call.
    ckpt.unguard(opt)
    want = snapshot(state)
    h = ckpt.save(5, state, blocking=False)
    assert not h._deferred
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    h.wait()
    assert_same(want, ckpt.load(5))


def test_a_tensor_found_unguarded_at_the_capture_fails_that_save_only(ckpt):
    """The guard's fingerprint misses a parameter given other memory (``p.data = ...``): a
    view of its old memory in the state still matches the last save's storage, so the save
    is deferred, and its capture finds that memory no longer guarded (the next forward may
    change it): ``SaveFailed`` at the next save, never wrong bytes; that save and the
    following ones are captured at their call."""
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    ckpt.save(1, state, blocking=False).wait()
    p = model[0].weight
    state["model"]["0.weight"] = p.detach()  # a view of the parameter's memory
    ckpt.save(2, state, blocking=False).wait()
    with torch.no_grad():
        p.data = p.data.clone()  # the parameter's memory replaced; the view keeps the old
    h = ckpt.save(3, state, blocking=False)
    assert h._deferred
    step()  # the guard does not raise the capture's error
    with pytest.raises(SaveFailed, match="no longer in a guarded optimizer") as e:
        ckpt.save(4, state, blocking=False)
    assert e.value.step == 3
    for s in (4, 5):
        want = snapshot(state)
        h = ckpt.save(s, state, blocking=False)
        assert not h._deferred
        state["model"]["0.weight"].add_(1.0)  # unguarded: copied at the call
        step()
        h.wait()
        assert_same(want, ckpt.load(s))
    assert 3 not in ckpt.list()


def test_a_state_with_an_unguarded_tensor_is_never_deferred(ckpt):
    model, opt, step, state = trainer()
    state["buffer"] = torch.arange(4.0)  # not the optimizer's
    ckpt.guard(opt)
    for s in (1, 2, 3):
        want = snapshot(state)
        h = ckpt.save(s, state, blocking=False)
        assert not h._deferred
        state["buffer"].add_(1.0)  # right after the call: not this save's
        step()
        h.wait()
        assert_same(want, ckpt.load(s))


@pytest.mark.parametrize("kind", [dict, collections.OrderedDict, list, tuple])
def test_the_call_time_containers_are_rebuilt_exactly(ckpt, kind):
    """A layout miss in a deferred capture (a tensor's metadata changed since the last save)
    flattens the containers as the call's walk read them: every container type, key order
    and plain value type (-0.0, big ints, bools, None, str)."""
    model, opt, step, state = trainer(n=2)
    ps = list(model.parameters())
    values = [-0.0, 2**70, True, None, "s", 1.5, float("inf")]
    if kind in (list, tuple):
        inner = kind(ps + values)
    else:
        inner = kind((f"k{i}", v) for i, v in enumerate(ps + values))
    state = {"x": inner, 7: {"nested": kind([ps[0]]) if kind in (list, tuple) else kind(a=ps[0])}}
    ckpt.guard(opt)
    ckpt.save(1, state, blocking=False).wait()
    ps[1].requires_grad_(False)  # a miss at the next capture
    want = snapshot(state)
    h = ckpt.save(2, state, blocking=False)
    assert h._deferred
    step()
    h.wait()
    assert_same(want, ckpt.load(2))


@pytest.mark.gpu
@pytest.mark.parametrize("snapshot_mode", [None, "device"])
def test_a_deferred_cuda_save_copies_after_the_work_queued_before_its_call(root, snapshot_mode):
    """The capture runs later on another thread, but the engine's copies are ordered by
    events recorded on the trainer's stream at the call: an in-place update queued behind a
    long kernel before the call is in the checkpoint, the optimizer's step after it is not
    (the guard makes it wait on the device)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(1 << 20, device="cuda")) for _ in range(8)]
    opt = torch.optim.SGD(ps, lr=0.5, momentum=0.9)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()  # the momentum buffers exist
    state = {"p": ps, "m": [opt.state[p]["momentum_buffer"] for p in ps]}
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=256 << 20)) as ck:
        ck.prepare_cuda([torch.cuda.current_device()])
        ck.guard(opt)
        ck.save(1, state, blocking=False, snapshot=snapshot_mode).wait()
        for s in (2, 3, 4):
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time
            with torch.no_grad():
                for p in ps:
                    p.add_(float(s))  # queued behind the kernel, before the call
            want = [t.detach().cpu() for t in state["p"]]  # synchronizes: the expected values
            torch.cuda._sleep(50_000_000)
            with torch.no_grad():
                for p in ps:
                    p.mul_(3.0)  # queued before the call too
            want = [w * 3.0 for w in want]
            wm = [t.detach().cpu() for t in state["m"]]
            torch.cuda._sleep(50_000_000)  # the device is busy at the call
            h = ck.save(s, state, blocking=False, snapshot=snapshot_mode)
            assert h._deferred
            opt.step()  # after the guard's wait: not in the checkpoint
            h.wait()
            back = ck.load(s)
            assert [raw(t) for t in back["p"]] == [raw(w) for w in want]
            assert [raw(t) for t in back["m"]] == [raw(w) for w in wm]


def _shrink(v):
    v.resize_(v.shape[0] - 1, v.shape[1])  # same storage and address, fewer rows


def _other_dtype(v):
    v.data = v.view(torch.int32)  # same storage, address and shape, another dtype


def _other_offset(v):
    v.set_(v.untyped_storage(), 8, (v.shape[0] - 1, v.shape[1]), v.stride())  # same storage


def _transposed(v):
    v.t_()  # same storage and address, other shape and strides


def _requires_grad(v):
    v.requires_grad_(True)


@pytest.mark.parametrize("change", [_shrink, _other_dtype, _other_offset, _transposed, _requires_grad])
def test_a_deferred_capture_rereads_every_tensor_changed_in_place(ckpt, change):
    """A view of a guarded parameter changed in place between two saves keeps its storage:
    the save is still deferred (the call compares only the storages), and its capture reads
    the tensors' metadata, finds the change (shape, dtype, offset, strides, requires_grad)
    and does not reuse the layout or its plan: the checkpoint holds exactly the view's
    values, dtype and shape at the call. The next save reuses the new layout; it is deferred
    again unless the view is no longer contiguous (then copied at its call)."""
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    view = model[0].weight.detach()  # a view of guarded memory
    state["model"]["0.weight"] = view
    ckpt.save(1, state, blocking=False).wait()
    h = ckpt.save(2, state, blocking=False)
    assert h._deferred
    h.wait()
    lay, plan = ckpt._layout, ckpt._layout.plan
    assert plan is not None
    step()
    change(view)
    want = snapshot(state)
    h = ckpt.save(3, state, blocking=False)
    assert h._deferred
    step()  # waits for the capture, then changes the parameters
    h.wait()
    got = ckpt.load(3)
    assert_same(want, got)
    assert got["model"]["0.weight"].dtype == view.dtype and tuple(got["model"]["0.weight"].shape) == tuple(view.shape)
    assert ckpt._layout is not lay and ckpt._layout.plan is not plan
    want = snapshot(state)
    lay, plan = ckpt._layout, ckpt._layout.plan
    h = ckpt.save(4, state, blocking=False)
    assert h._deferred is view.is_contiguous()
    step()
    h.wait()
    assert_same(want, ckpt.load(4))
    assert ckpt._layout is lay  # same metadata: reused
    if view.is_contiguous():
        assert ckpt._layout.plan is plan


def test_a_negative_view_of_guarded_memory_is_stored_by_value(ckpt):
    """A negative view of a guarded parameter (its storage: the save is deferred) has the
    parameter's memory but not its values: the capture reads the negative bit, does not
    reuse the plan, and stores the negated values."""
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    w = model[0].weight
    state["model"]["0.weight"] = w.detach()  # a plain tensor, as the negative view
    ckpt.save(1, state, blocking=False).wait()
    assert ckpt.save(2, state, blocking=False)._deferred
    ckpt.wait()
    state["model"]["0.weight"] = torch._neg_view(w.detach())
    assert state["model"]["0.weight"].is_neg()
    want = snapshot(state)
    h = ckpt.save(3, state, blocking=False)
    assert h._deferred
    step()
    h.wait()
    got = ckpt.load(3)
    assert_same(want, got)
    assert raw(got["model"]["0.weight"]) == raw(-want["model"]["0.weight"].neg())


def test_a_tensor_given_another_guarded_storage_is_captured_at_its_call(ckpt):
    """A view given the memory of another guarded tensor (``set_``) between two saves: the
    same containers, but not the last save's storages (the addresses the call compares):
    captured at its call, with the bytes of its new memory (now an alias of that tensor)."""
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    a = model[0].bias.detach()
    b = model[1].bias
    state["model"]["0.bias"] = a
    ckpt.save(1, state, blocking=False).wait()
    assert ckpt.save(2, state, blocking=False)._deferred
    ckpt.wait()
    a.set_(b.untyped_storage(), b.storage_offset(), b.shape, b.stride())
    want = raw(b.detach().clone())
    h = ckpt.save(3, state, blocking=False)
    assert not h._deferred  # another storage at the call
    step()
    h.wait()
    got = ckpt.load(3)["model"]
    assert got["0.bias"].dtype == torch.float32 and tuple(got["0.bias"].shape) == (8,)
    assert raw(got["0.bias"]) == want and raw(got["1.bias"]) == want


def test_empty_and_aliased_tensors_are_deferred_and_stored_exactly(ckpt):
    """A plan whose tuples are not all the leaves' own memory in order (an empty parameter:
    no memory; the same parameter twice: an alias, no tuple) is reused by deferred saves,
    each storing exactly its call's values."""
    torch.manual_seed(5)
    ps = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.empty(0, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    def step():
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()

    step()
    state = {"p": list(ps), "again": ps[0], "m": [opt.state[p]["momentum_buffer"] for p in ps], "epoch": 0}
    ckpt.guard(opt)
    ckpt.save(1, state, blocking=False).wait()
    plans = set()
    for s in (2, 3, 4):
        state["epoch"] = s
        want = snapshot(state)
        h = ckpt.save(s, state, blocking=False)
        assert h._deferred
        step()
        h.wait()
        assert_same(want, ckpt.load(s))
        plan = ckpt._layout.plan
        assert plan is not None and not plan.dense  # the empty tensor has no memory
        plans.add(id(plan))
    assert len(plans) == 1


def test_capsules_fall_back_per_tensor_when_a_dtype_cannot_be_exported(ckpt, monkeypatch):
    """``_util.capsules`` makes every capsule in one ``map`` and, when one dtype cannot be
    exported (here bfloat16, refused by a patched ``to_dlpack`` as an older torch would),
    makes each capsule as ``capsule`` does (that one as its bytes): the same bytes stored."""
    from shmckpt import _util

    real = _util._to_dlpack
    refused = []

    def to_dlpack(x):
        if x.dtype == torch.bfloat16:
            refused.append(x.shape)
            raise BufferError("bfloat16 is not supported")
        return real(x)

    monkeypatch.setattr(_util, "_to_dlpack", to_dlpack)
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(4, generator=g), "h": torch.randn(6, generator=g).to(torch.bfloat16), "b": torch.randn(2, 3, generator=g)}
    for s in (1, 2):
        want = snapshot(state)
        ckpt.save(s, state, blocking=False).wait()
        assert_same(want, ckpt.load(s))
        state["h"].add_(1.0)
    assert refused  # the fallback ran


class _Recorder:
    """The checkpointer's engine, recording each ``save`` call: (step, provisional, the
    calling thread's name, the error it raised or None)."""

    def __init__(self, engine):
        self._engine = engine
        self.calls = []
        self.handles = []  # the engine's handles of the saves that started

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def save(self, step, *args, **kw):
        who = (step, kw.get("provisional", False), threading.current_thread().name)
        try:
            h = self._engine.save(step, *args, **kw)
        except Exception as e:
            self.calls.append(who + (type(e).__name__,))
            raise
        self.calls.append(who + (None,))
        self.handles.append(h)
        return h


def submitted(ck):
    """Wait until what the checkpointer's submitting thread was given so far has run (it
    runs its work in order)."""
    ck._saver.submitter.submit(lambda: None).result()


@pytest.mark.parametrize("cadence", [None, shmckpt.Cadence(disk_every=3)], ids=["disk", "memory"])
def test_a_deferred_save_starts_at_its_call_and_commits_once_checked(root, cadence):
    """From the third save on, a deferred save is handed to the engine at its call, on the
    submitting thread, as a provisional save of the last save's plan; the guard's wait
    checks it and confirms it: one engine save per step, committed (to disk or the memory
    tier) with the values of its call, and not listed before the check (though staged)."""
    model, opt, step, state = trainer()
    kw = {} if cadence is None else {"cadence": cadence}
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20), **kw) as ck:
        ck.guard(opt)
        ck.save(1, state, blocking=False).wait()
        ck.save(2, state, blocking=False).wait()
        rec = _Recorder(ck._engine)
        ck._engine = rec
        for s in range(3, 9):
            state["epoch"] = s
            want = snapshot(state)
            h = ck.save(s, state, blocking=False)
            assert h._deferred and h._settle is not None
            submitted(ck)
            assert rec.calls[-1][:2] == (s, True) and rec.calls[-1][3] is None, rec.calls
            assert rec.calls[-1][2].startswith("shmckpt-submit")
            rec.handles[-1].wait_staged()  # (the engine's handle: no check runs)
            assert s not in [t for t, _ in ck.list(tiers=True)], "listed before its check"
            step()  # the guard checks and confirms it, then the step changes the tensors
            assert h._settle is None
            rep = h.wait()
            assert rep["memory_only"] == (cadence is not None and (s - 1) % 3 != 0)  # disk: 1, 4, 7
            assert_same(want, ck.load(s))
        assert [c[0] for c in rec.calls] == list(range(3, 9)), rec.calls


def test_a_speculative_save_whose_metadata_changed_is_refused_and_saved_again(ckpt):
    """A change the engine cannot see at the call (the bytes, dtype and shape are the
    plan's, the Parameter's ``requires_grad`` is not) is found by the check: the
    provisional save is refused and the capture saved in its place, once: the step holds
    the state of the call, frozen parameter included, and is committed once."""
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    for s in (1, 2):
        ckpt.save(s, state, blocking=False).wait()
        step()
    rec = _Recorder(ckpt._engine)
    ckpt._engine = rec
    state["model"]["0.weight"].requires_grad_(False)
    want = snapshot(state)
    h = ckpt.save(3, state, blocking=False)
    assert h._settle is not None  # started from the plan
    step()
    h.wait()
    assert [(c[0], c[1], c[3]) for c in rec.calls] == [(3, True, None), (3, False, None)]
    back = ckpt.load(3)
    assert_same(want, back)
    assert back["model"]["0.weight"].requires_grad is False
    assert ckpt.list() == [1, 2, 3]
    # The next save starts from the new layout's plan and is confirmed.
    want = snapshot(state)
    h = ckpt.save(4, state, blocking=False)
    assert h._settle is not None
    step()
    h.wait()
    assert [(c[0], c[1]) for c in rec.calls[2:]] == [(4, True)]
    assert_same(want, ckpt.load(4))


@pytest.mark.parametrize("prepared", [False, True], ids=["tuples", "prepared"])
def test_a_tensor_the_plan_no_longer_describes_is_never_saved_as_the_plan_says(ckpt, prepared):
    """A guarded view reshaped in place (``resize_`` to fewer elements: the same storage)
    no longer has the plan's shape. Built at the call's start, its tuple is refused by the
    engine (nothing started). Prepared by the last save's check (its capsule taken before
    the change), the provisional save starts, and its check finds the change and refuses
    it. Either way the check (in the guard's hook) saves its capture in its place: the
    step holds the view as it is at the call, committed once."""
    model, opt, step, state = trainer()
    ckpt.guard(opt)
    view = model[0].weight.detach()
    state["model"]["0.weight"] = view
    for s in (1, 2, 3):
        ckpt.save(s, state, blocking=False).wait()
        step()
    assert (ckpt._saver.prepared is not None) is True
    if not prepared:
        ckpt._saver.drop_prepared()
    rec = _Recorder(ckpt._engine)
    ckpt._engine = rec
    view.resize_(4, 8)
    want = snapshot(state)
    h = ckpt.save(4, state, blocking=False)
    assert h._deferred and h._settle is not None
    step()
    h.wait()
    refused = None if prepared else "ValueError"
    assert [(c[0], c[1], c[3]) for c in rec.calls] == [(4, True, refused), (4, False, None)]
    assert rec.calls[0][2].startswith("shmckpt-submit")
    assert rec.calls[1][2] == threading.current_thread().name  # in the guard's hook
    assert ckpt.list() == [1, 2, 3, 4]
    got = ckpt.load(4)
    assert_same(want, got)
    assert tuple(got["model"]["0.weight"].shape) == (4, 8)


def test_an_unchecked_speculative_save_is_checked_by_the_next_save_wait_or_close(root):
    """With no optimizer step after the call, the check runs at the next save (which reads
    the layout it sets), at ``wait``, or at ``close``: each step is committed with the
    state of its call."""
    model, opt, step, state = trainer()
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20))
    ck.guard(opt)
    for s in (1, 2):
        ck.save(s, state, blocking=False).wait()
        step()
    want3 = snapshot(state)
    h3 = ck.save(3, state, blocking=False)
    assert h3._settle is not None
    h4 = ck.save(4, state, blocking=False)  # checks step 3 first
    assert h3._settle is None and h4._settle is not None
    h4.wait()
    h3.wait()
    step()
    want5 = snapshot(state)
    h5 = ck.save(5, state, blocking=False)
    assert h5._settle is not None
    ck.close()
    assert h5._settle is None
    with shmckpt.Checkpointer(root) as again:
        assert again.list() == [1, 2, 3, 4, 5]
        assert_same(want3, again.load(3))
        assert_same(want3, again.load(4))
        assert_same(want5, again.load(5))


def test_prepared_tensors_are_dropped_when_the_guard_changes(root):
    """The tensors prepared for the next deferred save keep its storages referenced: they
    are given back by ``unguard``, by the guarded optimizer's ``load_state_dict`` or end,
    by a save that does not use them and by ``close``."""
    steps = itertools.count(1)

    def setup(ck):
        model, opt, step, state = trainer()
        ck.guard(opt)
        for _ in range(3):
            ck.save(next(steps), state, blocking=False).wait()
            step()
        prepared = ck._saver.prepared
        assert prepared is not None and not prepared[1].taken
        return model, opt, step, state, prepared[1]

    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20)) as ck:
        model, opt, step, state, p = setup(ck)
        ck.unguard(opt)
        assert p.taken and ck._saver.prepared is None
        model, opt, step, state, p = setup(ck)
        opt.load_state_dict(opt.state_dict())
        assert p.taken and ck._saver.prepared is None
        model, opt, step, state, p = setup(ck)
        del opt, step
        import gc

        gc.collect()
        assert p.taken and ck._saver.prepared is None
        model, opt, step, state, p = setup(ck)
        ck.save(next(steps), {"other": torch.ones(2)}, blocking=False).wait()
        assert p.taken and ck._saver.prepared is None
        model, opt, step, state, p = setup(ck)
    assert p.taken


def test_the_gc_pause_ends_when_the_last_thread_leaves_it():
    """``_gc_paused`` is entered by the trainer's thread (the guard's check) and the
    submitting thread (the next save's start) at once: collections resume when the last
    one leaves, not the first (the other's objects still alive would be promoted), and a
    GC its caller disabled stays disabled."""
    import gc

    from shmckpt._util import _gc_paused

    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def other():
        with _gc_paused():
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=other)
    with _gc_paused():
        assert not gc.isenabled()
        t.start()
        assert inside.wait(30)
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(30)
    assert gc.isenabled()
    # Both the other way round: the first in leaves last.
    inside.clear(), leave.clear()
    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(30)
    with _gc_paused():
        assert not gc.isenabled()
        leave.set()
        t.join(30)
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def _promoted_to_oldest(run):
    """Objects ``run()`` left in CPython's oldest generation after a collection of the
    middle one moved them there (each such collection, ~1 per save here without the pause,
    promotes what the young generations hold at that moment)."""
    import gc

    young: list = []
    promoted = collections.Counter()

    def on_gc(phase, info):
        if info["generation"] != 1:
            return
        if phase == "start":
            young[:] = gc.get_objects(0) + gc.get_objects(1)
        else:
            old = {id(o) for o in gc.get_objects(2)}
            promoted.update(type(o).__name__ for o in young if id(o) in old)
            young.clear()

    gc.collect()
    gc.callbacks.append(on_gc)
    try:
        run()
    finally:
        gc.callbacks.remove(on_gc)
    return promoted


def test_preparing_the_next_save_promotes_nothing_to_the_oldest_generation(root):
    """The guard's hook prepares the next deferred save's engine tuples (a few objects per
    tensor, dropped once the engine took them) with the cyclic GC paused. Collected while
    they lived, ~2.6 objects per tensor per save were promoted to the oldest generation,
    and CPython then collected the trainer's whole heap every ~20 saves, holding the
    interpreter (155 ms for 337,000 objects on the development VM)."""
    torch.manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(400)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    state = {"model": {str(i): p for i, p in enumerate(params)}, "optim": opt.state_dict()}
    tensors = len(params) * 4  # each parameter, its two moments and its step
    steps = itertools.count(1)
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20)) as ck:
        ck.guard(opt)
        for _ in range(4):
            ck.save(next(steps), state, blocking=False)
            opt.step()
        assert ck._saver.prepared is not None  # the hook prepares from here on

        def saves():
            for _ in range(20):
                ck.save(next(steps), state, blocking=False)
                opt.step()
            ck.wait()

        promoted = _promoted_to_oldest(saves)
        assert ck._saver.prepared is not None
        want = snapshot(state)
        last = next(steps)
        h = ck.save(last, state, blocking=False)
        opt.step()
        h.wait()
        assert_same(want, ck.load(last))
    # Before the pause: ~40,000 in these 20 saves, 1,600 tuples at each collection.
    assert sum(promoted.values()) < tensors, promoted.most_common(5)
