"""The state skeleton is read only from a header the manifest vouches for: a header whose
`__metadata__` lost the skeleton (it still parses) is a `CorruptError` from disk and
under a flash restore, never a flat dict. Helpers are `test_integrity.py`'s."""

import pytest
import torch

import shmckpt

from conftest import remove_arenas_of
from test_integrity import CHUNK, STATE_KEY, bits, file_of


# -- the state skeleton: read only from a header the manifest vouches for ------------------
def _damage_metadata_key(path):
    """Rename the state skeleton's key inside ``__metadata__`` (one byte): the header still
    parses and lists the same tensors, but the file has no state skeleton any more."""
    with open(path, "r+b") as f:
        head = f.read(4096)
        at = head.index(b'"' + STATE_KEY.encode() + b'"') + 1
        f.seek(at)
        f.write(b"x" if head[at : at + 1] != b"x" else b"y")


@pytest.mark.parametrize("keep", [False, True], ids=["disk", "memory"])
def test_a_damaged_header_skeleton_is_an_error_not_a_flat_dict(tmp_path, keep):
    """A header edited so that it still parses and still lists the manifest's tensors, but
    has lost its ``__metadata__`` (the nested state's skeleton), loaded as a flat dict of
    ``model.w`` tensors without any error. The manifest now records the header's CRC-32C,
    and the skeleton is read only after that check, from disk and under a flash restore."""
    root = str(tmp_path / "r")
    state = {"model": {"w": torch.arange(6.0)}, "step": 5}
    kw = dict(tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=CHUNK), keep_in_memory=keep)
    ck = shmckpt.Checkpointer(root, **kw)
    try:
        ck.save(5, state).wait()
        back = ck.load(5)
        assert back["step"] == 5 and bits(back["model"]["w"]) == bits(state["model"]["w"])
        ck.close()
        _damage_metadata_key(file_of(root, 5))
        ck = shmckpt.Checkpointer(root, **kw)
        with pytest.raises(shmckpt.CorruptError, match="header CRC-32C"):
            ck.load(5)
        with pytest.raises(shmckpt.CorruptError, match="header CRC-32C"):
            ck.load_into({"model": {"w": torch.zeros(6)}}, 5)
        if keep:
            assert ck.last_load_source is None or ck.last_load_source[0] != "disk"
    finally:
        ck.close()
        remove_arenas_of(root)
