"""The save's layout cache (``_layout.py``, issue 24): a state saved again with the same
structure and tensor metadata reuses the last save's layout, also when its plain values
changed (not their types); any change of what flattening or capturing a tensor reads is
detected, and every save stores exactly the values its state held at the call (round trips
compared byte for byte)."""

import collections
import gc
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import shmckpt
from shmckpt import _layout
from shmckpt.errors import UnsupportedValue

from test_state import assert_same, file_of, raw

from layout_support import (  # noqa: F401 (ckpt: fixture)
    base_state,
    ckpt,
    save_and_check,
    snapshot,
)


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
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=256 << 20)) as ck:
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



def test_a_probe_reads_each_storage_once_and_membership_is_per_tensor():
    """``read_meta`` reads each storage's address with the metadata (``Probe.addresses``,
    what storage keys, membership and a deferral use: never read again); ``membership`` is
    exact per tensor whether all, some or none are guarded (its all-inside fast path)."""
    big = torch.arange(12.0)
    state = {"a": big[:4], "b": big[4:].view(2, 4), "c": torch.zeros(3, dtype=torch.int16), "d": torch.empty(0)}
    p = _layout.probe(state)
    assert p is not None and p.sig is not None
    ts = list(state.values())
    assert p.addresses == [t.untyped_storage().data_ptr() for t in ts]
    assert p.storage_keys() == [(t.device, t.untyped_storage().data_ptr()) for t in ts]
    assert _layout.storage_addresses(p) is p.addresses
    meta, shapes, strides, offsets, ptrs, conj, neg, sizes, params = p.sig
    assert shapes == [(4,), (2, 4), (3,), (0,)] and all(type(s) is tuple for s in shapes)
    assert [m[3] for m in meta] == [torch.float32, torch.float32, torch.int16, torch.float32]
    assert offsets == [0, 4, 0, 0] and sizes == [48, 48, 6, 0]
    keys = p.storage_keys()
    assert _layout.membership(p, None, set(keys), None) == [True] * 4
    assert _layout.membership(p, None, {keys[0]}, None) == [True, True, False, False]  # a and b: one storage
    assert _layout.membership(p, None, {keys[2], ("cpu", 1)}, None) == [False, False, True, False]
    assert _layout.membership(p, None, set(), None) == [False] * 4
