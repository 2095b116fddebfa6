"""Helpers of the layout-cache tests (``test_layout*.py``): saves checked against a copy
of the state's values, saves that change the state at a chosen point (another thread's
change, injected with ``sys.settrace``), and the count of flattens."""

import sys

import numpy as np
import pytest
import torch

import shmckpt
from shmckpt import _state

from conftest import SMALL
from test_state import assert_same, file_of, header


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
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20)) as c:
        yield c


def save_traced(ck, step, state, code, mutate, nth=1, undo=None, **kw):
    """Save ``state`` as ``step``, calling ``mutate()`` when ``code`` (a function's
    ``__code__``) is entered for the ``nth`` time during the save, and ``undo()`` (if given)
    when that call returns: what another thread changing the state during that save does,
    at a chosen point. Returns the load of the step."""
    seen = []
    old = sys.gettrace()

    def back(frame, event, arg):
        if event == "return":
            undo()
        return back

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is code:
            seen.append(True)
            if len(seen) == nth:
                mutate()
                return back if undo is not None else None
        return None

    sys.settrace(tracer)
    try:
        ck.save(step, state, **kw).wait()
    finally:
        sys.settrace(old)
    assert len(seen) >= nth
    return ck.load(step)


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
