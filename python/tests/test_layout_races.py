"""The layout cache (``_layout.py``) under a state changed by another thread during a save
(injected with ``sys.settrace`` at a chosen point): such a save may store either state, but
nothing is cached that was not checked against the probe, so no later save reuses a layout,
a capture plan, leaves or a skeleton of the changed state."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shmckpt import _layout, _state
from shmckpt.checkpointer import save as save_mod
from shmckpt.checkpointer.handle import SaveHandle

from test_state import assert_same, file_of

from layout_support import (  # noqa: F401 (ckpt: fixture)
    base_state,
    ckpt,
    save_and_check,
    save_hit,
    save_traced,
    snapshot,
)


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

    save_traced(ckpt, 1, state, _state.flatten.__code__, to_int)
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

    save_traced(ckpt, 2, state, save_mod._capture.__code__, swap, blocking=False)
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

    save_traced(ckpt, 2, state, save_mod._capture.__code__, swap, undo=swap_back, blocking=False)
    assert p.data_ptr() == own.data_ptr()
    with torch.no_grad():
        p.mul_(3)
    save_and_check(ckpt, 3, state, blocking=False)
    assert torch.equal(ckpt.load(3)["p"], torch.arange(8, dtype=torch.float32) * 3)


def test_leaves_flattened_while_the_state_changed_and_back_are_not_reused(ckpt):
    """Tensors given another dtype, lazy bit or aliasing while ``flatten`` reads them, and
    their old metadata back before the save ends: the leaves flattened meanwhile (their
    dtypes, lazy bits, aliases) are never reused by a later save. The dtype flattened
    (int32) is not the tensor's when the engine takes it (float32 again): the engine
    refuses that tuple (its dtype is not its capsule's) instead of storing float bytes
    labelled int32, and nothing of the step is listed."""
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
        if change is to_int:
            refused = r'tensor "w": the tuple says I32 \[4, 6\], its memory holds DLPack type \(code 2, 32 bits, 1 lanes\) of shape \[4, 6\]'
            with pytest.raises(ValueError, match=refused):
                save_traced(ckpt, step + 1, state, _state.flatten.__code__, change, undo=change_back)
            assert step + 1 not in ckpt.list()
        else:
            save_traced(ckpt, step + 1, state, _state.flatten.__code__, change, undo=change_back)
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
        save_traced(ckpt, 2 * step + 1, state, _state.flatten.__code__, change, undo=change_back)
        save_and_check(ckpt, 2 * step + 2, state)
        back = ckpt.load(2 * step + 2)
        assert list(back["n"]) == ["m", "lr", "step", "name"] and back["n"]["lr"] == 0.5
        assert back["p"].requires_grad and back["a"].dtype == np.float32


def test_a_plain_value_changed_while_flattened_is_not_cached(ckpt):
    """Plain values changed by another thread after the probe, while ``flatten`` reads the
    state (and not back): that save stores either, and the layout it flattened (the old
    values' key, the new values' skeleton) is never reused; every later save stores its own
    values, the old ones included."""
    state = {"t": torch.arange(3.0), "step": 5, "lr": 0.5, "tag": "a", "flag": True}

    def change():
        state.update(step=6, lr=0.25, tag="b", flag=False)

    ckpt._layout = None
    back = save_traced(ckpt, 1, state, _state.flatten.__code__, change)
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
    save_traced(ckpt, 5, state, _state.flatten.__code__, to_float, undo=lambda: state.update(step=7))
    assert ckpt._layout is None
    state["step"] = 7
    assert not save_hit(ckpt, 6, state)
    assert ckpt._layout is not lay and type(ckpt.load(6)["step"]) is int
    # Changed once flattened, while the layout is cut (from the tree read, not the state):
    # that save stores the values read, the layout is theirs, and the new values are a hit.
    ckpt._layout = None
    want = snapshot(state)
    assert_same(want, save_traced(ckpt, 7, state, _layout._template.__code__, change))
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
    codes = (_layout._fill.__code__, type(ckpt._shared).reap.__code__, SaveHandle.__init__.__code__)
    for step, code in enumerate(codes, start=2):
        state["n"]["step"] = step
        want = snapshot(state)

        def change():
            state["n"].update(step=-1, lr=-1.0)
            state["tag"] = "changed"

        assert_same(want, save_traced(ckpt, step, state, code, change))
        assert ckpt._layout is lay
        assert (lay.parts, lay.vals, lay.skeleton) == (parts, vals, skeleton)
        assert save_hit(ckpt, step + 10, state)
        state["tag"] = "a"
        state["n"]["lr"] = 0.5


def test_a_plain_value_changed_during_the_probe_is_never_cached_apart(ckpt):
    """Plain values changed by another thread while the probe walks the state (the probe
    reads a mix: the values before the change, those after it): that save stores the mix
    or a state read later; whatever is cached, every later save stores its own values."""
    walk = next(c for c in _layout.walk.__code__.co_consts if getattr(c, "co_name", "") == "go")
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

        # go(state), go(1), then go(inner): change the state when inner is entered.
        back = save_traced(ckpt, 51 if first else 52, state, walk, change, nth=3)
        assert back["in"]["x"] == 200 and back["a"] in (1, 100)
        for step, (a, x, y) in enumerate(((1, 1, 2.5), (100, 200, -2.5), (1, 200, -2.5), (100, 1, 2.5)), start=60):
            state["a"] = a
            inner.update(x=x, y=y)
            save_hit(ckpt, step + (0 if first else 10), state)
            back = ckpt.load(step + (0 if first else 10))
            assert (back["a"], back["in"]["x"], back["in"]["y"]) == (a, x, y)
