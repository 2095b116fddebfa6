"""The layout cache (``_layout.py``) with plain values (a step counter, an epoch, a learning
rate) that change at every save: a hit, its skeleton the cached one with the new values,
encoded exactly as flattening would; a change of type is a miss."""

import sys

import pytest
import torch

from shmckpt import _layout

from test_state import assert_same

from layout_support import (  # noqa: F401 (ckpt, flattens: fixtures)
    ckpt,
    flattens,
    save_hit,
    snapshot,
)


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

