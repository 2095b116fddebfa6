"""The save's layout cache (``_layout.py``, issue 24): a state saved again with the same
structure and tensor metadata reuses the last save's layout, also when its plain values
changed (not their types); any change of what flattening or capturing a tensor reads is
detected, and every save stores exactly the values its state held at the call (round trips
compared byte for byte)."""

import collections
import gc
import sys
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import shmckpt
from shmckpt import _layout, _state
from shmckpt.checkpointer import save as save_mod
from shmckpt.checkpointer.handle import SaveHandle
from shmckpt.errors import UnsupportedValue

from conftest import SMALL
from test_state import assert_same, file_of, header, raw


def snapshot(x):
    """A deep copy of a state's values (what a save at this moment must store, as a load
    gives it back)."""
    if isinstance(x, torch.Tensor):
        c = x.detach().resolve_conj().resolve_neg().clone()
        return torch.nn.Parameter(c, requires_grad=x.requires_grad) if isinstance(x, torch.nn.Parameter) else c
    if isinstance(x, np.ndarray):
        return x.astype(x.dtype.newbyteorder("<"))  # stored little-endian, by value
    if isinstance(x, dict):
        return type(x)((k, snapshot(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(snapshot(v) for v in x)
    return x


def save_and_check(ck, step, state, **kw):
    """Save ``state`` as ``step`` and assert its load equals the state's values at the call;
    returns whether the save reused the previous save's layout."""
    before = ck._layout
    want = snapshot(state)
    ck.save(step, state, **kw).wait()
    assert_same(want, ck.load(step))
    return before is not None and ck._layout is before


def base_state():
    g = torch.Generator().manual_seed(24)
    return {
        "w": torch.randn(4, 6, generator=g),
        "b": torch.randn(6, generator=g),
        "n": {"m": torch.arange(10, dtype=torch.int64), "lr": 0.5, "step": 3, "name": "adam"},
    }


@pytest.fixture
def ckpt(root):
    with shmckpt.Checkpointer(root, staging_capacity=SMALL, chunk_size=1 << 20) as c:
        yield c


def test_same_state_reuses_the_layout_and_stores_the_current_bytes(ckpt):
    state = base_state()
    assert not save_and_check(ckpt, 1, state)
    for step in (2, 3):
        state["w"].add_(1.5)  # in place: same metadata, new bytes
        state["n"]["m"].mul_(3)
        assert save_and_check(ckpt, step, state)
    # A new state object of the same structure and tensors (a state_dict built anew).
    again = {"w": state["w"].detach(), "b": state["b"][:], "n": dict(state["n"])}
    state["b"].neg_()
    assert save_and_check(ckpt, 4, again)


def test_a_new_shape_is_detected(ckpt):
    state = base_state()
    save_and_check(ckpt, 1, state)
    state["w"] = torch.randn(6, 4)  # a new tensor, another shape
    assert not save_and_check(ckpt, 2, state)
    # Same memory, other shape (an in-place view change of the same object).
    state["w"].t_()
    assert not save_and_check(ckpt, 3, state)
    assert load_file(file_of(ckpt.root, 3))["w"].shape == (4, 6)
    state["w"].resize_(3, 8)  # same storage size, reshaped in place
    assert not save_and_check(ckpt, 4, state)
    # Only the shape changes (same address, storage and strides): the first 2 rows.
    w = state["w"]
    w.set_(w.untyped_storage(), 0, (2, 8), (8, 1))
    assert not save_and_check(ckpt, 5, state)
    assert load_file(file_of(ckpt.root, 5))["w"].shape == (2, 8)
    # Only the strides change (same address, storage and shape): a transposed reading.
    w.set_(w.untyped_storage(), 0, (4, 6), (6, 1))
    save_and_check(ckpt, 6, state)
    w.set_(w.untyped_storage(), 0, (4, 6), (1, 4))
    assert not save_and_check(ckpt, 7, state)


def test_a_new_dtype_over_the_same_memory_is_detected(ckpt):
    state = base_state()
    save_and_check(ckpt, 1, state)
    w = state["w"]
    ptr = w.data_ptr()
    w.data = w.view(torch.int32)  # same object, same address and shape, another dtype
    assert w.data_ptr() == ptr and w.shape == (4, 6)
    assert not save_and_check(ckpt, 2, state)
    assert load_file(file_of(ckpt.root, 2))["w"].dtype == torch.int32
    w.data = w.view(torch.float32)
    assert not save_and_check(ckpt, 3, state)


def test_a_tensor_given_other_memory_is_detected(ckpt):
    state = base_state()
    save_and_check(ckpt, 1, state)
    w = state["w"]
    other = torch.full((4, 6), 7.0)
    w.set_(other.untyped_storage(), 0, (4, 6), (6, 1))  # same object, other storage
    assert not save_and_check(ckpt, 2, state)
    assert torch.equal(ckpt.load(2)["w"], other)
    w.data = torch.full((4, 6), -1.0)  # .data: another storage again
    assert not save_and_check(ckpt, 3, state)
    # Same storage, another offset into it.
    big = torch.arange(48, dtype=torch.float32)
    state["w"] = big[:24].view(4, 6)
    save_and_check(ckpt, 4, state)
    state["w"].set_(big.untyped_storage(), 24, (4, 6), (6, 1))
    assert not save_and_check(ckpt, 5, state)
    assert torch.equal(ckpt.load(5)["w"], big[24:].view(4, 6))


def test_a_freed_storage_is_refused_at_every_save(ckpt):
    state = base_state()
    save_and_check(ckpt, 1, state)
    state["w"].untyped_storage().resize_(0)  # what FSDP does to a parameter it frees
    with pytest.raises(UnsupportedValue, match="no data in memory"):
        ckpt.save(2, state)
    # A smaller storage, whatever its address.
    state["w"].untyped_storage().resize_(8)
    with pytest.raises(UnsupportedValue, match="storage is smaller"):
        ckpt.save(2, state)
    state["w"].untyped_storage().resize_(4 * 6 * 4)
    state["w"].fill_(2.0)
    save_and_check(ckpt, 2, state)


def test_added_removed_and_renamed_keys_are_detected(ckpt):
    state = base_state()
    save_and_check(ckpt, 1, state)
    state["extra"] = torch.ones(3)
    assert not save_and_check(ckpt, 2, state)
    assert sorted(load_file(file_of(ckpt.root, 2))) == ["b", "extra", "n.m", "w"]
    del state["b"]
    assert not save_and_check(ckpt, 3, state)
    assert sorted(load_file(file_of(ckpt.root, 3))) == ["extra", "n.m", "w"]
    # The same keys in another order: other names at the same places.
    state = {"n": state["n"], "w": state["w"], "extra": state["extra"]}
    assert not save_and_check(ckpt, 4, state)
    # Other names for the same tensors in the same order.
    a, b = torch.zeros(2), torch.ones(2)
    save_and_check(ckpt, 5, {"a": a, "b": b})
    assert not save_and_check(ckpt, 6, {"b": a, "a": b})
    assert not save_and_check(ckpt, 7, {"b": a, "c": b})
    assert torch.equal(load_file(file_of(ckpt.root, 7))["c"], b)
    # An int key where a str key was (same flat name "0", another key type).
    save_and_check(ckpt, 8, {"s": {"0": torch.ones(2)}})
    assert not save_and_check(ckpt, 9, {"s": {0: torch.ones(2)}})
    assert list(ckpt.load(9)["s"]) == [0]
    # Keys equal to the cached ones but of unsupported types are refused, not matched.
    t = torch.ones(2)
    save_and_check(ckpt, 10, {"s": {1: t}})
    for bad in (True, 1.0):
        with pytest.raises(UnsupportedValue, match="not supported"):
            ckpt.save(11, {"s": {bad: t}})


def test_states_nested_too_deeply_are_refused(ckpt):
    for wrap in (lambda x: [x], lambda x: {"k": x}):
        deep = [torch.ones(1)]
        for _ in range(5000):  # far deeper than the recursion limit
            deep = wrap(deep)
        for step in (1, 2):
            with pytest.raises(UnsupportedValue, match="nested deeper"):
                ckpt.save(step, {"d": deep})


def test_aliasing_two_tensors_is_detected(ckpt):
    state = base_state()
    state["c"] = state["w"].clone()
    save_and_check(ckpt, 1, state)
    assert sorted(load_file(file_of(ckpt.root, 1))) == ["b", "c", "n.m", "w"]
    state["c"] = state["w"]  # now the same tensor twice
    assert not save_and_check(ckpt, 2, state)
    back = ckpt.load(2)
    assert back["c"] is back["w"]
    assert sorted(load_file(file_of(ckpt.root, 2))) == ["b", "n.m", "w"]
    state["c"] = state["w"].detach()  # another object over the same memory: still an alias
    assert save_and_check(ckpt, 3, state)
    state["c"] = state["w"].clone()  # apart again
    assert not save_and_check(ckpt, 4, state)
    assert sorted(load_file(file_of(ckpt.root, 4))) == ["b", "c", "n.m", "w"]


def test_plain_value_types_and_containers_are_compared_exactly(ckpt):
    """A plain value of another type at the same place (``True`` is an ``int`` subclass and
    ``== 1``, ``1.0 == 1``) or another container type is a miss."""
    state = base_state()
    save_and_check(ckpt, 1, state)
    step = 2
    for v in (True, 1, 1.0, 1, "1", None, 0, False, None, "x", 0.0, False):
        state["n"]["step"] = v
        assert not save_and_check(ckpt, step, state), v
        assert type(ckpt.load(step)["n"]["step"]) is type(v)
        step += 1
    state["n"] = collections.OrderedDict(state["n"])
    assert not save_and_check(ckpt, step, state)
    state["l"] = [state.pop("b")]
    save_and_check(ckpt, step + 1, state)
    state["l"] = tuple(state["l"])
    assert not save_and_check(ckpt, step + 2, state)


def test_lazy_bits_and_parameter_flags_are_detected(ckpt):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, dtype=torch.complex64, generator=g)
    x = torch.randn(5, generator=g)
    state = {"z": z, "x": x}
    save_and_check(ckpt, 1, state)
    state["z"] = z.conj()  # same memory, shape and strides; the conjugate bit
    assert not save_and_check(ckpt, 2, state)
    assert torch.equal(ckpt.load(2)["z"], z.conj().resolve_conj())
    state["x"] = torch._neg_view(x)  # the negative bit
    assert not save_and_check(ckpt, 3, state)
    assert torch.equal(ckpt.load(3)["x"], -x)
    assert save_and_check(ckpt, 4, state)  # a lazy view is resolved at every save
    state["x"] = torch.nn.Parameter(x)  # the same memory as a Parameter
    assert not save_and_check(ckpt, 5, state)
    assert type(ckpt.load(5)["x"]) is torch.nn.Parameter
    state["x"].requires_grad_(False)
    assert not save_and_check(ckpt, 6, state)
    assert ckpt.load(6)["x"].requires_grad is False
    # A plain tensor marked as a parameter (what isinstance(x, Parameter) answers).
    t = torch.randn(4, generator=g)
    save_and_check(ckpt, 7, {"t": t})
    t._is_param = True
    assert not save_and_check(ckpt, 8, {"t": t})
    assert type(ckpt.load(8)["t"]) is torch.nn.Parameter


def test_arrays_and_strided_tensors_are_captured_at_every_save(ckpt):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    m = torch.arange(24, dtype=torch.float32).view(4, 6)
    state = {"a": a, "s": m.t(), "w": torch.ones(3)}  # a transposed view: copied each save
    save_and_check(ckpt, 1, state)
    a += 1
    m.mul_(2)
    assert save_and_check(ckpt, 2, state)
    state["a"] = a.astype(">f4")  # same values, big-endian: stored little-endian
    assert not save_and_check(ckpt, 3, state)
    assert load_file(file_of(ckpt.root, 3))["a"].dtype == torch.float32
    assert raw(ckpt.load(3)["a"]) == raw(a)


def test_non_blocking_saves_reread_the_guard_at_every_save(ckpt):
    """The layout's capture plan depends on which tensors a guarded optimizer owns: an
    unguarded tensor of a non-blocking save is copied at the call (its later changes are
    not saved), a guarded one is read in the background."""
    p = torch.nn.Parameter(torch.randn(1 << 16))
    opt = torch.optim.SGD([p], lr=0.1)
    state = {"p": p}
    ckpt.guard(opt)
    assert not save_and_check(ckpt, 1, state, blocking=False)
    assert save_and_check(ckpt, 2, state, blocking=False)
    ckpt.unguard(opt)
    want = p.detach().clone()
    h = ckpt.save(3, state, blocking=False)
    with torch.no_grad():
        p.add_(1.0)  # right after the call: the save holds the values at the call
    h.wait()
    assert raw(ckpt.load(3)["p"]) == raw(want)
    ckpt.guard(opt)
    assert save_and_check(ckpt, 4, state, blocking=False)
    # Two guarded optimizers, then one: the other's tensor is copied at the call again.
    q = torch.nn.Parameter(torch.randn(1 << 16))
    opt2 = torch.optim.SGD([q], lr=0.1)
    state = {"p": p, "q": q}
    ckpt.guard(opt2)
    assert not save_and_check(ckpt, 5, state, blocking=False)
    assert save_and_check(ckpt, 6, state, blocking=False)
    ckpt.unguard(opt2)
    want = {"p": p.detach().clone(), "q": q.detach().clone()}
    h = ckpt.save(7, state, blocking=False)
    with torch.no_grad():
        q.add_(1.0)
    h.wait()
    back = ckpt.load(7)
    assert raw(back["q"]) == raw(want["q"]) and raw(back["p"]) == raw(want["p"])


def test_the_layout_keeps_no_tensor_alive(ckpt):
    t = torch.randn(1 << 10)
    ref = weakref.ref(t)
    state = {"t": t}
    save_and_check(ckpt, 1, state)
    assert ckpt._layout is not None
    del state, t
    gc.collect()
    assert ref() is None


def test_uncacheable_states_are_flattened_at_every_save(ckpt):
    class Sub(torch.Tensor):
        pass

    s = torch.arange(3.0).as_subclass(Sub)
    state = {"s": s}
    assert _layout.probe(state) is None
    for step in (1, 2):
        s.add_(1)
        want = raw(s)
        ckpt.save(step, state).wait()
        assert ckpt._layout is None
        assert raw(ckpt.load(step)["s"]) == want

    class D(dict):
        pass

    # A node the cache does not know: flattened, and refused as before.
    with pytest.raises(UnsupportedValue):
        ckpt.save(3, {"d": D(a=torch.ones(1))})
    assert not save_and_check(ckpt, 3, {"t": torch.ones(2)})
    # A sparse tensor: its strides cannot be read (a miss), and flatten refuses it.
    with pytest.raises(UnsupportedValue, match="sparse"):
        ckpt.save(4, {"t": torch.ones(2).to_sparse()})
    save_and_check(ckpt, 4, {"t": torch.full((2,), 3.0)})


@pytest.mark.gpu
def test_cuda_layouts_are_revalidated_under_snapshot_saves(root):
    """The snapshot path (guarded non-blocking saves of CUDA tensors) with the cache: in
    place changes stored, a parameter given new memory detected."""
    torch.manual_seed(24)
    params = [torch.nn.Parameter(torch.randn(1 << 20, device="cuda")) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    state = {"p": params, "o": opt.state_dict()["state"]}
    with shmckpt.Checkpointer(root, staging_capacity=256 << 20) as ck:
        ck.prepare_cuda()
        ck.guard(opt)

        def save(step):
            torch.cuda.synchronize()
            before = ck._layout
            want = snapshot(state)
            h = ck.save(step, state, blocking=False, snapshot="device")
            opt.step()  # the guard: the snapshot, then the step's kernels
            h.wait()
            assert_same(want, ck.load(step))
            return before is not None and ck._layout is before

        assert not save(1)
        assert save(2)  # the step changed the values, not the layout
        plan = ck._layout.plan
        assert plan is not None and plan.devices == [params[0].device.index]  # CUDA tuples kept
        assert save(3)
        assert ck._layout.plan is plan  # and reused
        with torch.no_grad():
            params[1].data = torch.randn(1 << 20, device="cuda")  # same shape, new memory
        assert not save(4)
        assert save(5)


def save_with(ck, step, state, func, mutate, undo=None, **kw):
    """Save ``state`` as ``step`` calling ``mutate()`` once, when ``func`` is first entered
    during the save, and ``undo()`` (if given) when that call returns: what another thread
    changing the state during that save does, at a chosen point. Returns the load of the
    step."""
    code, fired = func.__code__, []
    old = sys.gettrace()

    def back(frame, event, arg):
        if event == "return":
            undo()
        return back

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is code and not fired:
            fired.append(True)
            mutate()
            return back if undo is not None else None
        return None

    sys.settrace(tracer)
    try:
        ck.save(step, state, **kw).wait()
    finally:
        sys.settrace(old)
    assert fired
    return ck.load(step)


def test_a_layout_flattened_from_a_state_changed_meanwhile_is_not_reused(ckpt):
    """A state changed by another thread after the probe and before ``flatten`` read it: that
    save may store either, but its layout (the old metadata's key with the new metadata's
    names, dtypes and skeleton) is never reused by a later save of the old metadata."""
    state = base_state()
    w = state["w"]
    f32 = w.data

    def to_int():
        w.data = f32.view(torch.int32)  # same address, shape and strides; another dtype
        state["n"]["lr"] = 0.25

    save_with(ckpt, 1, state, _state.flatten, to_int)
    w.data = f32  # back to what the save's probe saw
    state["n"]["lr"] = 0.5
    save_and_check(ckpt, 2, state)
    assert load_file(file_of(ckpt.root, 2))["w"].dtype == torch.float32


def test_a_capture_plan_made_while_the_state_changed_is_not_reused(ckpt):
    """A guarded tensor given other memory by another thread while the save captures it:
    the tuple of that save (the other memory's address) is never reused by a later save of
    the tensor's own memory."""
    p = torch.nn.Parameter(torch.arange(8, dtype=torch.float32))
    own = p.data
    other = torch.full((8,), 7.0)  # kept alive: a reuse would read it
    opt = torch.optim.SGD([p], lr=0.1)
    state = {"p": p}
    save_and_check(ckpt, 1, state)  # the layout and a blocking save's plan
    ckpt.guard(opt)

    def swap():
        p.data = other

    save_with(ckpt, 2, state, save_mod._capture, swap, blocking=False)
    p.data = own
    with torch.no_grad():
        p.mul_(3)
    assert save_and_check(ckpt, 3, state, blocking=False)
    assert torch.equal(ckpt.load(3)["p"], torch.arange(8, dtype=torch.float32) * 3)


def test_a_capture_plan_made_while_the_state_changed_and_back_is_not_reused(ckpt):
    """The same as above, the tensor given its own memory back before the save ends (the
    state then looks unchanged): the tuple captured from the other memory is still never
    reused."""
    p = torch.nn.Parameter(torch.arange(8, dtype=torch.float32))
    own = p.data
    other = torch.full((8,), 7.0)
    opt = torch.optim.SGD([p], lr=0.1)
    state = {"p": p}
    save_and_check(ckpt, 1, state)
    ckpt.guard(opt)

    def swap():
        p.data = other

    def swap_back():
        p.data = own

    save_with(ckpt, 2, state, save_mod._capture, swap, swap_back, blocking=False)
    assert p.data_ptr() == own.data_ptr()
    with torch.no_grad():
        p.mul_(3)
    save_and_check(ckpt, 3, state, blocking=False)
    assert torch.equal(ckpt.load(3)["p"], torch.arange(8, dtype=torch.float32) * 3)


def test_leaves_flattened_while_the_state_changed_and_back_are_not_reused(ckpt):
    """Tensors given another dtype, lazy bit or aliasing while ``flatten`` reads them, and
    their old metadata back before the save ends: the leaves flattened meanwhile (their
    dtypes, lazy bits, aliases) are never reused by a later save."""
    g = torch.Generator().manual_seed(5)
    w, z = torch.randn(4, 6, generator=g), torch.randn(3, dtype=torch.complex64, generator=g).conj()
    c = w.clone()
    state = {"w": w, "z": z, "c": c}
    f32, own = w.data, c.untyped_storage()

    def to_int():
        w.data = f32.view(torch.int32)

    def to_float():
        w.data = f32

    def unconj():  # read as its memory: not its values
        torch._C._set_conj(z, False)

    def conj():
        torch._C._set_conj(z, True)

    def alias():
        c.set_(w.untyped_storage(), 0, (4, 6), (6, 1))

    def apart():
        c.set_(own, 0, (4, 6), (6, 1))

    step = 0
    for change, change_back in ((to_int, to_float), (unconj, conj), (alias, apart)):
        ckpt._layout = None  # a miss: flattened
        save_with(ckpt, step + 1, state, _state.flatten, change, change_back)
        save_and_check(ckpt, step + 2, state)
        assert sorted(load_file(file_of(ckpt.root, step + 2))) == ["c", "w", "z"]
        step += 2


def test_a_skeleton_flattened_while_the_state_changed_and_back_is_not_reused(ckpt):
    """A plain value, a key, a Parameter's ``requires_grad`` or an array's dtype changed
    while ``flatten`` reads them and back before the save ends: the skeleton and names
    flattened meanwhile are never reused by a later save."""
    state = base_state()
    state["p"] = torch.nn.Parameter(torch.ones(3))
    state["a"] = np.arange(4, dtype=np.float32)
    n, p, a = state["n"], state["p"], state["a"]

    def lr(v):
        n["lr"] = v

    def rename(old, new):
        n[new] = n.pop(old)  # the last key: the same order once back

    def grad(v):
        p.requires_grad_(v)

    def dtype(v):
        a.dtype = v  # in place, the same memory read as another dtype

    scenarios = (
        (lambda: lr(0.25), lambda: lr(0.5)),
        (lambda: rename("name", "nm"), lambda: rename("nm", "name")),
        (lambda: grad(False), lambda: grad(True)),
        (lambda: dtype(np.int32), lambda: dtype(np.float32)),
    )
    for step, (change, change_back) in enumerate(scenarios):
        ckpt._layout = None  # a miss: flattened
        save_with(ckpt, 2 * step + 1, state, _state.flatten, change, change_back)
        save_and_check(ckpt, 2 * step + 2, state)
        back = ckpt.load(2 * step + 2)
        assert list(back["n"]) == ["m", "lr", "step", "name"] and back["n"]["lr"] == 0.5
        assert back["p"].requires_grad and back["a"].dtype == np.float32


# -- plain values that change at every save (a step counter, an epoch, a learning rate) ---


_FLATTEN = _state.flatten


@pytest.fixture
def flattens(monkeypatch):
    """The number of times a save flattened its state (a miss; a hit flattens nothing)."""
    calls = []
    real = _state.flatten

    def counted(state):
        calls.append(1)
        return real(state)

    monkeypatch.setattr(_state, "flatten", counted)
    return calls


def skeleton_of(root, step):
    """The skeleton JSON the file of ``step`` holds."""
    return header(file_of(root, step))[0]["__metadata__"][_state.STATE_KEY]


def save_hit(ck, step, state, **kw):
    """``save_and_check``, asserting also that the skeleton written is exactly what
    flattening and encoding the state gives (the same bytes, whether the save reused the
    layout or not)."""
    want = _state.encode(_FLATTEN(state))
    hit = save_and_check(ck, step, state, **kw)
    assert skeleton_of(ck.root, step) == want
    return hit


def trainer_state(step, g):
    return {
        "model": {"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g)},
        "optim": {"state": {0: {"exp_avg": torch.zeros(4, 6), "step": torch.tensor(0.0)}}, "lr": 1e-3},
        "step": step,
        "epoch": 0,
        "global_step": step * 8,
        "loss": float("nan"),
        "tag": "warmup",
        "done": False,
        "best": None,
    }


def test_a_state_whose_plain_values_change_at_every_save_reuses_the_layout(ckpt, flattens):
    """A trainer's state with a step counter, an epoch, a learning rate, a loss, a phase name
    and a flag that change between saves: one flatten (the first save), every later save a
    hit, and each step loads back exactly its own values, types and bytes."""
    g = torch.Generator().manual_seed(7)
    state = trainer_state(0, g)
    lay = None
    wants = {}
    losses = [float("nan"), 2.5, -0.0, 0.0, float("inf"), float("-inf"), 1e308, 5e-324, 0.1, -1.25e-7]
    for i, loss in enumerate(losses):
        step = 100 + i
        state["step"] = step
        state["epoch"] = i // 3
        state["global_step"] = step * 8
        state["optim"]["lr"] = 1e-3 * 0.5**i
        state["loss"] = loss
        state["tag"] = ("warmup", "train", "cooldown ❄")[i % 3]
        state["done"] = i == len(losses) - 1
        with torch.no_grad():
            state["model"]["w"].add_(1.0)
            state["optim"]["state"][0]["step"].add_(1.0)
        wants[step] = snapshot(state)
        assert save_hit(ckpt, step, state) == (i > 0)
        if lay is None:
            lay = ckpt._layout
        assert ckpt._layout is lay
    assert len(flattens) == 1
    for step, want in wants.items():
        back = ckpt.load(step)
        assert_same(want, back)
        for k in ("step", "epoch", "global_step", "loss", "tag", "done", "best"):
            assert type(back[k]) is type(want[k])
        assert back["step"] == step and back["global_step"] == step * 8
        assert repr(back["loss"]) == repr(want["loss"])
    assert repr(ckpt.load(102)["loss"]) == "-0.0" and ckpt.load(103)["loss"] == 0.0


def test_plain_value_changes_are_exact_for_every_type(ckpt, flattens):
    """Values of each plain type that compare or print alike, each a hit and stored exactly:
    floats by their repr (signed zeros, infinities, NaN, the extremes), big ints, unicode and
    escaped strings, bools."""
    state = {"t": torch.arange(4.0), "i": 0, "f": 0.0, "s": "", "b": False, "n": None, "l": [1, 2.0, "3", True]}
    save_hit(ckpt, 1, state)
    ints = [1, -1, 2**63 - 1, -(2**63), 2**64, 2**200 + 1, -(10**4000), 10**4299, 0]
    floats = [-0.0, 0.0, float("inf"), float("-inf"), float("nan"), 1e-320, -1.7976931348623157e308, 0.1 + 0.2, 1.0]
    strs = ["é", "日本語", "🚀 rocket", '"quoted" \\ back', "\x00\x01\n\t\x7f", "\u2028\u2029", "é" * 1000, "a"]
    step = 2
    for i in range(max(len(ints), len(floats), len(strs))):
        state["i"] = ints[i % len(ints)]
        state["f"] = floats[i % len(floats)]
        state["s"] = strs[i % len(strs)]
        state["b"] = not state["b"]
        state["l"] = [i, float(i) / 3, str(i), i % 2 == 0]
        assert save_hit(ckpt, step, state)
        back = ckpt.load(step)
        assert type(back["i"]) is int and back["i"] == state["i"]
        assert type(back["f"]) is float and repr(back["f"]) == repr(state["f"])
        assert type(back["s"]) is str and back["s"] == state["s"]
        assert back["b"] is state["b"] and back["n"] is None
        step += 1
    assert len(flattens) == 1


def test_an_int_too_long_for_str_raises_on_a_hit_as_on_a_miss(ckpt, flattens):
    """``str`` converts ints of at most ``sys.get_int_max_str_digits()`` digits: a longer
    one is refused (``ValueError``) whether the save would reuse the layout or not, and the
    layout stays usable."""
    limit = sys.get_int_max_str_digits()
    huge = 10 ** (limit + 1)
    state = {"t": torch.ones(2), "step": 1}
    save_hit(ckpt, 1, state)
    lay = ckpt._layout
    state["step"] = huge
    with pytest.raises(ValueError, match="digits"):
        ckpt.save(2, state)  # a hit's skeleton
    assert ckpt._layout is lay
    ckpt._layout = None
    with pytest.raises(ValueError, match="digits"):
        ckpt.save(2, state)  # a miss: flatten
    state["step"] = 1
    save_hit(ckpt, 2, state)
    state["step"] = -(10 ** (limit - 1))
    assert save_hit(ckpt, 3, state)
    assert ckpt.load(3)["step"] == state["step"]


def test_a_name_holding_the_value_marker_makes_value_changes_misses(ckpt):
    """A key (so a name) encoded with what stands for the values in the cut skeleton (the
    marker itself, or after an escaped quote): the layout cannot be cut; a value change is
    then a miss, still exact. As a value it is a value like any other."""
    t = torch.ones(2)
    for step, key in ((1, _layout._SLOT), (10, 'a"' + _layout._SLOT)):
        state = {key: 1, "t": t, "v": "a", "d": {key: t.clone()}}
        assert not save_hit(ckpt, step, state)
        assert ckpt._layout.parts is None
        assert save_hit(ckpt, step + 1, state)  # the same values: the same skeleton
        state["v"] = "other"
        assert not save_hit(ckpt, step + 2, state)
        state[key] = 2
        assert not save_hit(ckpt, step + 3, state)
        assert ckpt.load(step + 3)[key] == 2
    state = {"t": t, "v": _layout._SLOT, "k" + _layout._SLOT: 5}
    assert not save_hit(ckpt, 20, state)
    assert ckpt._layout.parts is not None
    state["v"], state["k" + _layout._SLOT] = "x" + _layout._SLOT, 6
    assert save_hit(ckpt, 21, state)
    assert ckpt.load(21)["v"] == "x" + _layout._SLOT


def save_when(ck, step, state, code, mutate, nth=1, **kw):
    """Save ``state`` as ``step``, calling ``mutate()`` when ``code`` is entered for the
    ``nth`` time during the save (another thread changing the state at that point)."""
    seen = []
    old = sys.gettrace()

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is code:
            seen.append(True)
            if len(seen) == nth:
                mutate()
        return None

    sys.settrace(tracer)
    try:
        ck.save(step, state, **kw).wait()
    finally:
        sys.settrace(old)
    assert len(seen) >= nth
    return ck.load(step)


def test_a_plain_value_changed_while_flattened_is_not_cached(ckpt):
    """Plain values changed by another thread after the probe, while ``flatten`` reads the
    state (and not back): that save stores either, and the layout it flattened (the old
    values' key, the new values' skeleton) is never reused; every later save stores its own
    values, the old ones included."""
    state = {"t": torch.arange(3.0), "step": 5, "lr": 0.5, "tag": "a", "flag": True}

    def change():
        state.update(step=6, lr=0.25, tag="b", flag=False)

    ckpt._layout = None
    back = save_when(ckpt, 1, state, _state.flatten.__code__, change)
    assert back["step"] in (5, 6)
    assert ckpt._layout is None  # the tree read is not the probe's: nothing cached
    state.update(step=5, lr=0.5, tag="a", flag=True)  # the values the save's probe read
    assert not save_hit(ckpt, 2, state)
    state.update(step=6, lr=0.25, tag="b", flag=False)
    assert save_hit(ckpt, 3, state)
    state.update(step=5, lr=0.5, tag="a", flag=True)
    assert save_hit(ckpt, 4, state)
    # A type changed while flattened (an int made a float) and back.
    lay = ckpt._layout

    def to_float():
        state["step"] = 7.0

    ckpt._layout = None
    save_with(ckpt, 5, state, _state.flatten, to_float, lambda: state.update(step=7))
    assert ckpt._layout is None
    state["step"] = 7
    assert not save_hit(ckpt, 6, state)
    assert ckpt._layout is not lay and type(ckpt.load(6)["step"]) is int
    # Changed once flattened, while the layout is cut (from the tree read, not the state):
    # that save stores the values read, the layout is theirs, and the new values are a hit.
    ckpt._layout = None
    want = snapshot(state)
    assert_same(want, save_when(ckpt, 7, state, _layout._template.__code__, change))
    assert ckpt._layout is not None and ckpt._layout.vals == [7, "0.5", "a", True]
    assert save_hit(ckpt, 8, state)
    assert (ckpt.load(8)["step"], ckpt.load(8)["tag"]) == (6, "b")
    state.update(step=7, lr=0.5, tag="a", flag=True)
    assert save_hit(ckpt, 9, state)
    assert_same(want, ckpt.load(9))


def test_a_plain_value_changed_during_a_hit_is_stored_as_probed(ckpt):
    """Plain values changed by another thread during a save that reuses the layout (while
    its skeleton is built from the probe's values, before or after its tensors are captured): that
    save stores the values its probe read, the layout is not changed, and the next save
    stores the new values."""
    state = {"t": torch.arange(3.0), "n": {"step": 5, "lr": 0.5}, "tag": "a"}
    save_hit(ckpt, 1, state)
    lay = ckpt._layout
    parts, vals, skeleton = list(lay.parts), list(lay.vals), lay.skeleton
    codes = (_layout._fill.__code__, type(ckpt)._reap.__code__, SaveHandle.__init__.__code__)
    for step, code in enumerate(codes, start=2):
        state["n"]["step"] = step
        want = snapshot(state)

        def change():
            state["n"].update(step=-1, lr=-1.0)
            state["tag"] = "changed"

        assert_same(want, save_when(ckpt, step, state, code, change))
        assert ckpt._layout is lay
        assert (lay.parts, lay.vals, lay.skeleton) == (parts, vals, skeleton)
        assert save_hit(ckpt, step + 10, state)
        state["tag"] = "a"
        state["n"]["lr"] = 0.5


def test_a_plain_value_changed_during_the_probe_is_never_cached_apart(ckpt):
    """Plain values changed by another thread while the probe walks the state (the probe
    reads a mix: the values before the change, those after it): that save stores the mix
    or a state read later; whatever is cached, every later save stores its own values."""
    walk = next(c for c in _layout.probe.__code__.co_consts if getattr(c, "co_name", "") == "walk")
    inner = {"x": 1, "y": 2.5, "z": "s"}
    state = {"a": 1, "t": torch.ones(2), "in": inner, "b": "q"}
    for first in (True, False):  # a miss (no layout yet) and a hit
        if first:
            ckpt._layout = None
        else:
            save_hit(ckpt, 50, state)

        def change():
            state["a"] = 100  # already read
            inner.update(x=200, y=-2.5)  # not yet read

        # walk(state), walk(1), then walk(inner): change the state when inner is entered.
        back = save_when(ckpt, 51 if first else 52, state, walk, change, nth=3)
        assert back["in"]["x"] == 200 and back["a"] in (1, 100)
        for step, (a, x, y) in enumerate(((1, 1, 2.5), (100, 200, -2.5), (1, 200, -2.5), (100, 1, 2.5)), start=60):
            state["a"] = a
            inner.update(x=x, y=y)
            save_hit(ckpt, step + (0 if first else 10), state)
            back = ckpt.load(step + (0 if first else 10))
            assert (back["a"], back["in"]["x"], back["in"]["y"]) == (a, x, y)
