"""Silent wrong data and crafted input (issue 21, items 1, 2, 5, 6): byte order, lazy
(conjugate / negative) views, tensors whose memory is not their values, typed errors for
crafted checkpoints and bad destinations, bool steps. Every check is on exact values and
bytes: what ``load`` returns, what a destination holds, and what a plain safetensors
reader finds in the rank file."""

import gc
import json
import os
import struct
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.numpy import load_file as np_load_file
from safetensors.torch import load_file as torch_load_file

import shmckpt
from shmckpt import _state
from shmckpt.dcp import ShmckptWriter, release

from conftest import listing

CHUNK = 1 << 20
STATE_KEY = _state.STATE_KEY


@pytest.fixture(autouse=True)
def _release_dcp_engines():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    release()


def file_of(root, step):
    return os.path.join(root, f"step-{step}", "rank-00000-of-00001.safetensors")


def file_tensor_bytes(path, name):
    """The bytes of tensor ``name`` as stored in a safetensors file (read by hand)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    hdr = json.loads(data[8 : 8 + n])
    a, b = hdr[name]["data_offsets"]
    return data[8 + n + a : 8 + n + b]


def bits(t):
    """The bytes of a CPU tensor's values in row-major order (bits resolved)."""
    t = _state.resolved(t.detach()).contiguous()
    return t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# -- 1. byte order -------------------------------------------------------------------------

BE_DTYPES = [">f8", ">f4", ">f2", ">i8", ">i4", ">i2", ">u8", ">u4", ">u2", ">c8"]


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("dt", BE_DTYPES)
def test_big_endian_arrays_are_saved_by_value(ck, root, dt, blocking):
    le = np.dtype(dt).newbyteorder("<")
    vals = np.array([1, 2, 3, 100, 7, 9], dtype=le)
    if le.kind == "c":
        vals = vals + 1j * np.array([5, -6, 0, 1, 2, 3], dtype=le)
    be = vals.astype(dt)
    state = {
        "a": be,
        "strided": be[::2],  # non-contiguous too
        "scalar": be[1:2].reshape(()),  # 0-d
        "m": be.reshape(2, 3).T,
    }
    assert be.tobytes() != vals.tobytes()  # really another byte order
    ck.save(1, state, blocking=blocking).wait()
    back = ck.load(1)
    for k, v in state.items():
        got = back[k]
        assert got.dtype == le and got.shape == v.shape, k
        assert np.array_equal(got, v), (k, got, v)
        assert got.tobytes() == np.ascontiguousarray(v).astype(le).tobytes(), k
    # A plain safetensors reader sees the same values, stored little-endian.
    on_disk = np_load_file(file_of(root, 1))
    for k, v in state.items():
        assert on_disk[k].shape == v.shape and np.array_equal(on_disk[k], v), k
        assert file_tensor_bytes(file_of(root, 1), k) == np.ascontiguousarray(v).astype(le).tobytes(), k
    assert file_tensor_bytes(file_of(root, 1), "a") == vals.tobytes()


def test_zero_dim_arrays_keep_their_shape(ck, root):
    state = {"z": np.array(2.5, dtype=np.float64), "i": np.array(-3, dtype=np.int32)}
    ck.save(1, state).wait()
    back = ck.load(1)
    for k, v in state.items():
        assert back[k].shape == () and back[k].dtype == v.dtype and back[k] == v, k
    on_disk = np_load_file(file_of(root, 1))
    assert on_disk["z"].shape == () and on_disk["z"] == 2.5


def test_load_into_a_big_endian_destination_converts(ck, root):
    vals = np.array([[1.5, -2.0, 3.25], [4.0, 5.5, -6.75]], dtype=np.float32)
    ints = np.arange(5, dtype=np.int64) * 1000003
    ck.save(1, {"a": vals, "i": ints, "t": torch.arange(4.0)}).wait()
    dst = {"a": np.zeros((2, 3), dtype=">f4"), "i": np.zeros(5, dtype=">i8"), "t": torch.zeros(4)}
    ck.load_into(dst, 1)
    assert dst["a"].dtype == np.dtype(">f4") and dst["i"].dtype == np.dtype(">i8")
    assert np.array_equal(dst["a"], vals) and np.array_equal(dst["i"], ints)
    assert dst["a"].tobytes() == vals.astype(">f4").tobytes()
    assert dst["i"].tobytes() == ints.astype(">i8").tobytes()
    assert torch.equal(dst["t"], torch.arange(4.0))
    # A non-contiguous big-endian destination (a view of a larger array).
    big = np.zeros((2, 6), dtype=">f4")
    ck.load_into({"a": big[:, ::2], "i": np.zeros(5, dtype="<i8"), "t": torch.zeros(4)}, 1)
    assert np.array_equal(big[:, ::2], vals) and np.array_equal(big[:, 1::2], np.zeros((2, 3)))


# -- 2. lazy views and tensors whose memory is not their values ---------------------------


def lazy_state():
    g = torch.Generator().manual_seed(3)
    z = torch.complex(torch.randn(6, generator=g), torch.randn(6, generator=g))
    f = torch.randn(5, generator=g)
    i = torch.arange(-3, 4, dtype=torch.int64)
    return {
        "z": z,
        "zc": z.conj(),  # same memory, is_conj()
        "zn": torch._neg_view(z),
        "zcn": torch._neg_view(z.conj()),
        "f": f,
        "fn": torch._neg_view(f),
        "in": torch._neg_view(i),
        "zc_strided": z.conj()[::2],
        "zc2": z.conj(),  # the same values as "zc": may be its alias
    }


@pytest.mark.parametrize("blocking", [True, False])
def test_conjugate_and_negative_views_are_saved_by_value(ck, root, blocking):
    state = lazy_state()
    assert state["zc"].is_conj() and state["zn"].is_neg() and state["fn"].is_neg()
    assert state["zc"].data_ptr() == state["z"].data_ptr()
    ck.save(1, state, blocking=blocking).wait()
    back = ck.load(1)
    on_disk = torch_load_file(file_of(root, 1))
    expect = {
        "z": state["z"],
        "zc": torch.complex(state["z"].real, -state["z"].imag),
        "zn": -state["z"],
        "zcn": -torch.complex(state["z"].real, -state["z"].imag),
        "f": state["f"],
        "fn": -state["f"],
        "in": torch.arange(3, -4, -1, dtype=torch.int64),
        "zc_strided": torch.complex(state["z"].real, -state["z"].imag)[::2],
        "zc2": torch.complex(state["z"].real, -state["z"].imag),
    }
    for k, e in expect.items():
        assert not back[k].is_conj() and not back[k].is_neg(), k
        assert bits(back[k]) == bits(e), k
        if k != "zc2":
            assert bits(on_disk[k]) == bits(e), k
    # Aliases only between tensors of the same values: "zc2" may alias "zc", nothing else.
    stored = {t["name"] for t in ck.manifest(1)["files"][0]["tensors"]}
    assert stored == set(expect) - {"zc2"}
    assert back["zc2"] is back["zc"]


def test_load_into_conjugate_and_negative_destinations(ck):
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 10)
    f = torch.arange(5.0) - 2
    ck.save(1, {"z": z, "f": f}).wait()
    zmem, fmem = torch.zeros(4, dtype=torch.complex64), torch.zeros(5)
    dst = {"z": zmem.conj(), "f": torch._neg_view(fmem)}
    ck.load_into(dst, 1)
    # The destinations read as the saved values; their memory holds the conjugate/negation.
    assert bits(dst["z"]) == bits(z) and bits(dst["f"]) == bits(f)
    assert bits(zmem) == bits(torch.complex(z.real, -z.imag)) and bits(fmem) == bits(-f)


class Wrapper(torch.Tensor):
    """A wrapper subclass (as torchao's and float8 tensors are): its memory is not its
    values (here it has no memory at all)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, Wrapper) else x  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def freed():
    t = torch.ones(4)
    t.untyped_storage().resize_(0)  # what FSDP does to an unsharded parameter
    return t


def shrunk():
    t = torch.ones(8)
    t.untyped_storage().resize_(16)  # 4 of the 8 floats
    return t


def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(3)


def functional():
    return torch._to_functional_tensor(torch.ones(3))


def nested_strided():
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def nested_jagged():
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)


ODD = [
    pytest.param(freed, "no data in memory", id="freed"),
    pytest.param(shrunk, "storage is smaller", id="shrunk-storage"),
    pytest.param(fake, "__torch_dispatch__", id="fake"),
    pytest.param(functional, "no data in memory", id="functional"),
    pytest.param(lambda: Wrapper(torch.ones(3)), "__torch_dispatch__", id="wrapper-subclass"),
    pytest.param(nested_strided, "nested", id="nested"),
    pytest.param(nested_jagged, "jagged", id="nested-jagged"),
    pytest.param(lambda: torch.ones(3, device="meta"), "meta", id="meta"),
    pytest.param(lambda: torch.ones(2, 2).to_sparse_csr(), "sparse_csr", id="sparse-csr"),
    pytest.param(lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "qint8", id="quantized"),
    pytest.param(lambda: np.ma.masked_array([1.0, 2.0], mask=[0, 1]), "masked", id="masked-array"),
]


@pytest.mark.parametrize("make,what", ODD)
def test_tensors_whose_memory_is_not_their_values_are_refused(ck, root, make, what):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad = make()
    before = listing(root)
    with pytest.raises(shmckpt.UnsupportedValue) as ei:
        ck.save(1, {"ok": torch.ones(100), "m": {"x": bad}})
    assert isinstance(ei.value, TypeError)
    assert ei.value.key == "state['m']['x']" and what in str(ei.value), str(ei.value)
    assert str(ei.value).startswith("state['m']['x']: ")
    assert listing(root) == before
    # Not a destination either (nothing is written into it, or anywhere).
    ck.save(1, {"ok": torch.arange(100.0), "m": {"x": torch.ones(2)}}).wait()
    dst = {"ok": torch.zeros(100), "m": {"x": bad}}
    with pytest.raises(shmckpt.UnsupportedValue):
        ck.load_into(dst, 1)
    assert torch.equal(dst["ok"], torch.zeros(100))


def test_unsupported_value_keeps_its_key_through_pickle():
    import pickle

    e = pickle.loads(pickle.dumps(shmckpt.UnsupportedValue("state['a']: no", key="state['a']")))
    assert type(e) is shmckpt.UnsupportedValue and str(e) == "state['a']: no" and e.key == "state['a']"
    assert e.kind == "UnsupportedValue" and isinstance(e, TypeError) and isinstance(e, shmckpt.ShmckptError)


def test_plain_subclasses_and_expanded_views_are_saved_by_value(ck, root):
    class Mine(torch.Tensor):  # no __torch_dispatch__: its memory holds its values
        pass

    base = torch.arange(6.0)
    state = {"sub": base.as_subclass(Mine), "exp": torch.tensor([7.0, 8.0]).expand(3, 2), "zero_d": torch.tensor(4.5)}
    ck.save(1, state).wait()
    back = ck.load(1)
    assert type(back["sub"]) is torch.Tensor and torch.equal(back["sub"], base)
    assert torch.equal(back["exp"], torch.tensor([[7.0, 8.0]] * 3))
    assert back["zero_d"].shape == () and back["zero_d"].item() == 4.5
    on_disk = torch_load_file(file_of(root, 1))
    assert torch.equal(on_disk["exp"], torch.tensor([[7.0, 8.0]] * 3)) and torch.equal(on_disk["sub"], base)


def test_dcp_writer_stores_lazy_views_by_value(tmp_path):
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    f = torch.arange(5.0) + 1
    for mode in ("save", "async_save"):
        p = tmp_path / mode
        st = {"z": z, "zc": z.conj(), "fn": torch._neg_view(f), "zcn": torch._neg_view(z.conj())}
        w = ShmckptWriter(p, tuning=shmckpt.Tuning(chunk_size=CHUNK))
        if mode == "save":
            dcp.save(st, storage_writer=w)
        else:
            r = dcp.async_save(st, storage_writer=w)
            (r.upload_completion if hasattr(r, "upload_completion") else r).result()
        on_disk = torch_load_file(p / "rank-00000-of-00001.safetensors")
        zc = torch.complex(z.real, -z.imag)
        assert bits(on_disk["z"]) == bits(z), mode
        assert bits(on_disk["zc"]) == bits(zc), mode
        assert bits(on_disk["fn"]) == bits(-f), mode
        assert bits(on_disk["zcn"]) == bits(-zc), mode


def test_dcp_reader_fills_lazy_views_with_the_checkpoints_values(tmp_path):
    """A conjugate or negative view as a DCP load destination gets the checkpoint's
    values (it was filled with raw bytes, so it read back conjugated or negated)."""
    from shmckpt.dcp import ShmckptReader

    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    f = torch.arange(5.0) + 1
    dcp.save({"z": z, "f": f}, storage_writer=ShmckptWriter(tmp_path / "c", tuning=shmckpt.Tuning(chunk_size=CHUNK)))
    zmem, fmem = torch.zeros(4, dtype=torch.complex64), torch.zeros(5)
    out = {"z": zmem.conj(), "f": torch._neg_view(fmem)}
    dcp.load(out, storage_reader=ShmckptReader(tmp_path / "c"))
    assert bits(out["z"].resolve_conj()) == bits(z)
    assert bits(out["f"].resolve_neg()) == bits(f)
    # The memory under the views holds what makes them read as the saved values.
    assert bits(zmem) == bits(torch.complex(z.real, -z.imag))
    assert bits(fmem) == bits(-f)


class Rewrap(Wrapper):
    """A wrapper subclass whose operations return wrappers (``detach()`` included)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = Wrapper.__torch_dispatch__.__func__(cls, func, types, args, kwargs)
        return Rewrap(out) if isinstance(out, torch.Tensor) else out


@pytest.mark.parametrize(
    "make,what",
    [ODD[0], ODD[3], pytest.param(lambda: Rewrap(torch.ones(3)), "__torch_dispatch__", id="wrapper-subclass")],
)
def test_dcp_writer_refuses_tensors_without_their_values_in_memory(tmp_path, make, what):
    st = {"ok": torch.ones(4), "x": make()}
    w = ShmckptWriter(tmp_path / "c", tuning=shmckpt.Tuning(chunk_size=CHUNK))
    with pytest.raises(BaseException) as ei:
        w.stage(st)
    assert isinstance(ei.value, shmckpt.UnsupportedValue), repr(ei.value)
    assert ei.value.key == "x" and what in str(ei.value)
    assert not (tmp_path / "c").exists()


# -- 5. crafted checkpoints and bad destinations -------------------------------------------

PAD = 60000


def save_padded(ck, state, step=1):
    """Save with a metadata entry of PAD bytes that header rewrites can shrink, so that
    the header keeps its length (and the data its offsets)."""
    ck.save(step, state, metadata={"pad": "p" * PAD}).wait()


def rewrite_header(path, edit=None, raw_pad=None):
    """Rewrite the safetensors header of ``path`` in place, at the same length: ``edit``
    changes the parsed header; ``raw_pad`` replaces the pad entry's JSON value."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    hdr = json.loads(data[8 : 8 + n])
    if edit is not None:
        edit(hdr)
    hdr["__metadata__"]["pad"] = ""
    new = json.dumps(hdr, separators=(",", ":")).encode()
    if raw_pad is not None:
        assert new.count(b'"pad":""') == 1
        new = new.replace(b'"pad":""', b'"pad":' + raw_pad)
    assert len(new) <= n, (len(new), n)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(new + b" " * (n - len(new)))
    # A crafted checkpoint comes with a manifest that vouches for its header: record the
    # new header's CRC-32C there, so that the checks after it are what is tested.
    head = data[:8] + new + b" " * (n - len(new))
    mpath = os.path.join(os.path.dirname(path), "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    for e in m["files"]:
        if e["file"] == os.path.basename(path):
            e["header_crc32c"] = crc32c(head)
    with open(mpath, "w") as f:
        json.dump(m, f)


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data):
    """CRC-32C (Castagnoli), as the manifest records it."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def set_skeleton(text):
    def edit(hdr):
        hdr["__metadata__"][STATE_KEY] = text

    return edit


def test_deeply_nested_header_json_is_a_corrupt_error(ck, root):
    save_padded(ck, {"a": torch.arange(3.0)})
    rewrite_header(file_of(root, 1), raw_pad=b"[" * 2500 + b"]" * 2500)
    with pytest.raises(shmckpt.CorruptError):
        ck.load(1)
    dst = {"a": torch.zeros(3)}
    with pytest.raises(shmckpt.CorruptError):
        ck.load_into(dst, 1)
    assert torch.equal(dst["a"], torch.zeros(3))


def deep_skeleton(levels):
    return (
        '{"format":1,"tree":{"t":"dict","v":[["s","a",{"t":"tensor","n":"a","dtype":"float32"}],["s","d",'
        + '{"t":"list","v":[' * levels
        + "]}" * levels
        + "]]}}"
    )


@pytest.mark.parametrize("levels", [_state.MAX_DEPTH + 1, 600, 2000])
def test_deeply_nested_skeleton_is_a_corrupt_error(ck, root, levels):
    save_padded(ck, {"a": torch.arange(3.0)})
    rewrite_header(file_of(root, 1), set_skeleton(deep_skeleton(levels)))
    with pytest.raises(shmckpt.CorruptError):
        ck.load(1)
    dst = {"a": torch.zeros(3)}
    with pytest.raises(shmckpt.CorruptError):
        ck.load_into(dst, 1)
    assert torch.equal(dst["a"], torch.zeros(3))


def test_the_deepest_allowed_state_round_trips_and_deeper_is_refused(ck, root):
    def nest(levels):
        s = {"leaf": torch.arange(2.0)}
        for i in range(levels):
            s = [s] if i % 2 else {"k": s}
        return s

    ok = {"s": nest(_state.MAX_DEPTH - 2)}
    ck.save(1, ok).wait()
    back = ck.load(1)
    node, depth = back, 0
    while not isinstance(node, torch.Tensor):
        node = node[0] if isinstance(node, list) else next(iter(node.values()))
        depth += 1
    assert depth == _state.MAX_DEPTH and torch.equal(node, torch.arange(2.0))
    before = listing(root)
    for levels in (_state.MAX_DEPTH, 5000):
        with pytest.raises(shmckpt.UnsupportedValue) as ei:
            ck.save(2, {"s": nest(levels)})
        assert f"nested deeper than {_state.MAX_DEPTH} levels" in str(ei.value)
        assert ei.value.key.startswith("state['s']")
    assert listing(root) == before


def skel(tree):
    return json.dumps({"format": 1, "tree": tree}, separators=(",", ":"))


A = {"t": "tensor", "n": "a", "dtype": "float32"}
MALFORMED = [
    pytest.param(skel({"t": "dict", "v": [["s", "a", A], ["s", "l", {"t": "list", "v": [1]}]]}), id="int-node"),
    pytest.param(skel({"t": "dict", "v": [["s", "a", A], ["s", "k"]]}), id="short-item"),
    pytest.param(skel({"t": "dict", "v": [["s", "a", A], ["s", "l", {"t": "list", "v": 5}]]}), id="items-not-a-list"),
    pytest.param(skel({"t": "dict", "v": [["s", "a", A], ["x", "k", {"t": "none"}]]}), id="bad-key-kind"),
    pytest.param(skel({"t": "dict", "v": [["s", "a", dict(A, n=["a"])]]}), id="name-not-a-string"),
    pytest.param(skel({"t": "dict", "v": [["s", "a", dict(A, alias=7)]]}), id="alias-not-a-string"),
    pytest.param(skel({"t": "dict", "v": [["s", "a", A], ["s", "b", {"t": "bool", "v": "yes"}]]}), id="bool-not-a-bool"),
    pytest.param(skel(["not", "a", "node"]), id="tree-not-a-node"),
    pytest.param('{"format":1}', id="no-tree"),
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_skeleton_is_a_corrupt_error_for_load_and_load_into(ck, root, text):
    save_padded(ck, {"a": torch.arange(3.0)})
    rewrite_header(file_of(root, 1), set_skeleton(text))
    with pytest.raises(shmckpt.CorruptError):
        ck.load(1)
    dst = {"a": torch.zeros(3)}
    with pytest.raises(shmckpt.CorruptError):
        ck.load_into(dst, 1)
    assert torch.equal(dst["a"], torch.zeros(3))


def test_a_skeleton_asking_gradients_of_an_integer_tensor_is_a_corrupt_error(ck, root):
    save_padded(ck, {"i": torch.arange(3), "p": torch.nn.Parameter(torch.ones(2))})
    text = skel(
        {
            "t": "dict",
            "v": [
                ["s", "i", {"t": "tensor", "n": "i", "dtype": "int64", "param": True, "requires_grad": True}],
                ["s", "p", {"t": "tensor", "n": "p", "dtype": "float32", "param": True, "requires_grad": True}],
            ],
        }
    )
    rewrite_header(file_of(root, 1), set_skeleton(text))
    with pytest.raises(shmckpt.CorruptError) as ei:
        ck.load(1)
    assert "int64 parameter cannot require gradients" in str(ei.value)


def test_an_integer_parameter_without_gradients_still_loads(ck):
    p = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    ck.save(1, {"p": p}).wait()
    back = ck.load(1)
    assert isinstance(back["p"], torch.nn.Parameter) and not back["p"].requires_grad
    assert torch.equal(back["p"], torch.arange(3))


@pytest.mark.parametrize(
    "make_bad,what",
    [
        (lambda: np.broadcast_to(np.zeros(3, dtype=np.float32), (3,)), "read-only numpy array"),
        (lambda: np.frombuffer(bytes(12), dtype=np.float32), "read-only numpy array"),
        (lambda: torch.zeros(1).expand(3), "share memory"),
    ],
)
def test_unwritable_destinations_are_refused_before_any_byte_is_written(ck, make_bad, what):
    ck.save(1, {"a": torch.arange(100.0), "b": torch.arange(3.0), "c": np.arange(4, dtype=np.int64)}).wait()
    bad = make_bad()
    dst = {"a": torch.zeros(100), "b": bad, "c": np.zeros(4, dtype=np.int64)}
    before_b = bytes(np.asarray(bad).tobytes()) if isinstance(bad, np.ndarray) else bad.clone()
    with pytest.raises(shmckpt.DestinationError) as ei:
        ck.load_into(dst, 1)
    assert "b: the destination" in str(ei.value) and what in str(ei.value), str(ei.value)
    assert torch.equal(dst["a"], torch.zeros(100)) and np.array_equal(dst["c"], np.zeros(4))
    if isinstance(bad, np.ndarray):
        assert bad.tobytes() == before_b
    else:
        assert torch.equal(bad, before_b)


def test_inference_tensor_destinations_are_filled(ck):
    ck.save(1, {"a": torch.arange(4.0), "b": torch.arange(6.0)}).wait()
    with torch.inference_mode():
        a = torch.zeros(4)
        base = torch.zeros(12)
    b = base[::2]  # not contiguous: filled by a copy, which needs inference mode
    ck.load_into({"a": a, "b": b}, 1)
    assert torch.equal(a, torch.arange(4.0)) and torch.equal(base[::2], torch.arange(6.0))
    assert torch.equal(base[1::2], torch.zeros(6))


# -- 6. bool steps ----------------------------------------------------------------------------


@pytest.mark.parametrize("step", [True, False, np.bool_(True), np.bool_(False)])
def test_a_bool_step_is_refused_by_save_and_load(ck, root, step):
    before = listing(root)
    with pytest.raises(TypeError) as ei:
        ck.save(step, {"a": torch.ones(2)})
    assert "bool" in str(ei.value)
    assert listing(root) == before and ck.list() == []
    ck.save(1, {"a": torch.ones(2)}).wait()
    with pytest.raises(TypeError):
        ck.load(step)
    assert ck.list() == [1]


def test_numpy_integer_steps_are_steps(ck):
    ck.save(np.int64(4), {"a": torch.ones(2)}).wait()
    assert ck.list() == [4] and torch.equal(ck.load(np.int32(4))["a"], torch.ones(2))


@pytest.mark.parametrize(
    "make",
    [
        lambda z, f: z.conj(),
        lambda z, f: torch._neg_view(z.conj()),
        lambda z, f: z.conj().t(),
        lambda z, f: torch._neg_view(f)[::3],
        lambda z, f: torch._neg_view(f.reshape(10, 10)).t()[2:5],
    ],
)
def test_host_route_of_lazy_cuda_views_gives_their_values(monkeypatch, make):
    """The host route of conjugate / negative CUDA views (copy the memory as it is into
    pinned memory, apply the bits on the host), checked on CPU tensors: pinning (which
    needs CUDA) is left out, everything else is the CUDA code path."""
    from shmckpt import _util

    real_empty = torch.empty
    monkeypatch.setattr(_util.torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    z = torch.complex(torch.arange(100.0), torch.arange(100.0) * -2).reshape(10, 10)
    f = torch.arange(100.0) - 50
    t = make(z, f)
    assert _state.is_lazy(t)
    pinned, finish = _util._cuda_span_copy(t)
    assert not _state.is_lazy(pinned)  # the memory as it is
    out = finish()
    assert not _state.is_lazy(out) and out.is_contiguous() and out.shape == t.shape
    assert bits(out) == bits(_state.resolved(t))


# -- CUDA: lazy views on the device (marker gpu) -------------------------------------------


def cuda_lazy_state():
    g = torch.Generator(device="cuda").manual_seed(5)
    z = torch.complex(torch.randn(64, 32, device="cuda", generator=g), torch.randn(64, 32, device="cuda", generator=g))
    f = torch.randn(1000, device="cuda", generator=g)
    return {
        "z": z,
        "zc": z.conj(),
        "zn": torch._neg_view(z),
        "zcn": torch._neg_view(z.conj()),
        "zc_t": z.conj().t(),  # lazy and not contiguous
        "fn": torch._neg_view(f),
        "fn_strided": torch._neg_view(f)[::3],
    }


@pytest.mark.gpu
def test_cuda_lazy_views_are_saved_by_value_with_no_device_memory(root):
    state = cuda_lazy_state()
    expect = {k: _state.resolved(v).cpu() for k, v in state.items()}
    torch.cuda.synchronize()
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20)) as ck:
        ck.prepare_cuda([torch.cuda.current_device()])
        # Garbage of earlier tests (CUDA tensors in reference cycles) would be freed by a
        # collection during the saves and move the counters: collect it first.
        gc.collect()
        torch.cuda.synchronize()
        before = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        ck.save(1, state).wait()
        ck.save(2, state, blocking=False).wait()
        assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == before
        for s in (1, 2):
            back = ck.load(s)
            on_disk = torch_load_file(file_of(root, s))
            for k, e in expect.items():
                assert bits(back[k]) == bits(e) and bits(on_disk[k]) == bits(e), (s, k)
            assert {t["name"] for t in ck.manifest(s)["files"][0]["tensors"]} == set(expect)
        # load_into conjugate / negative CUDA destinations (through the device path).
        zmem = torch.zeros(64, 32, dtype=torch.complex64, device="cuda")
        fmem = torch.zeros(1000, device="cuda")
        ck.save(3, {"z": expect["z"].cuda(), "f": expect["fn"].cuda()}).wait()
        dst = {"z": zmem.conj(), "f": torch._neg_view(fmem)}
        ck.load_into(dst, 3)
        assert bits(dst["z"].cpu()) == bits(expect["z"]) and bits(dst["f"].cpu()) == bits(expect["fn"])
        assert bits(fmem.cpu()) == bits(-expect["fn"])


@pytest.mark.gpu
def test_cuda_lazy_views_through_the_dcp_writer(tmp_path):
    state = cuda_lazy_state()
    expect = {k: _state.resolved(v).cpu() for k, v in state.items()}
    torch.cuda.synchronize()
    for mode in ("save", "async_save"):
        p = tmp_path / mode
        w = ShmckptWriter(p, tuning=shmckpt.Tuning(chunk_size=CHUNK))
        if mode == "save":
            dcp.save(state, storage_writer=w)
        else:
            r = dcp.async_save(state, storage_writer=w)
            (r.upload_completion if hasattr(r, "upload_completion") else r).result()
        on_disk = torch_load_file(p / "rank-00000-of-00001.safetensors")
        for k, e in expect.items():
            assert bits(on_disk[k]) == bits(e), (mode, k)


def test_the_extension_refuses_an_address_or_no_memory_with_bytes_in_a_save(ck, root):
    """The last check under the package's own refusals: the extension takes a tensor's
    memory only as a DLPack capsule; an address (a null one included: what a freed tensor
    gave before) is a TypeError and no memory with bytes a ValueError, nothing read."""
    before = listing(root)
    for dev in (-1, 0):
        with pytest.raises(TypeError, match='tensor "w": expected a DLPack capsule'):
            ck._engine.save(1, [("w", "F32", [4], 0, 16, dev)], {}, [], True)
        with pytest.raises(ValueError, match='tensor "w": 16 bytes and no memory'):
            ck._engine.save(1, [("w", "F32", [4], None, 16, dev)], {}, [], True)
    assert listing(root) == before
    ck._engine.save(1, [("w", "F32", [0], None, 0, -1)], {}, [], True).wait()  # empty: fine
    assert ck.list() == [1]
