"""State kinds, dtypes, names, errors: save and load round trips on CPU, bit-exact."""

import collections
import json
import math
import os
import shutil
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import shmckpt
from shmckpt import _state

from conftest import SMALL, descriptors_under, listing


def raw(t):
    """The bytes of a tensor or array, in logical (row-major) order."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return b""
    return t.view(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a, b, path="state"):
    """Same nested structure, same Python types, same tensor dtypes, shapes and bytes."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert raw(a) == raw(b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert raw(a) == raw(b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), path  # -0.0 too
    else:
        assert a == b, path


def file_of(root, step):
    return os.path.join(root, f"step-{step}", "rank-00000-of-00001.safetensors")


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def test_every_state_kind_round_trips(ck, root):
    g = torch.Generator().manual_seed(1)
    state = {
        "model": collections.OrderedDict(
            [("layer.0.weight", torch.randn(8, 4, generator=g)), ("layer.0.bias", torch.randn(8, generator=g))]
        ),
        "ints": {0: torch.arange(3), 1: {"x": 5}, -7: "neg"},
        "list": [torch.ones(2, dtype=torch.float16), 1, 2.5, [None, True, False]],
        "tuple": (0.9, 0.999),
        "plain": {
            "int": 7,
            "big": 2**80 + 1,
            "neg": -3,
            "float": 0.1,
            "inf": float("inf"),
            "ninf": float("-inf"),
            "nan": float("nan"),
            "negzero": -0.0,
            "bool": True,
            "str": "héllo ✓ \"quoted\" \n",
            "none": None,
            "empty_dict": {},
            "empty_list": [],
            "empty_tuple": (),
        },
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "zero_size": torch.empty(0, 3),
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
        "frozen": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "np": np.arange(12, dtype=np.float32).reshape(3, 4),
        "np_i64": np.array([-1, 2**62], dtype=np.int64),
        "np_bool": np.array([True, False]),
        "rng": torch.get_rng_state(),
    }
    ck.save(3, state).wait()
    back = ck.load(3)
    assert_same(state, back)
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert not back["frozen"].requires_grad
    assert ck.latest() == 3 and ck.list() == [3]


def test_list_and_tuple_top_level(ck):
    ck.save(1, [torch.arange(4), (1, "a")]).wait()
    back = ck.load(1)
    assert_same([torch.arange(4), (1, "a")], back)


def every_dtype():
    out = []
    for dt, st in _state.TORCH_TO_ST.items():
        out.append(pytest.param(dt, st, id=st))
    return out


@pytest.mark.parametrize("dt,st", every_dtype())
def test_every_dtype_is_bit_exact(ck, root, dt, st):
    size = torch.empty(0, dtype=dt).element_size()
    rnd = np.random.default_rng(42).integers(0, 256, size=5 * 3 * size, dtype=np.uint8)
    t = torch.from_numpy(rnd.copy()).view(dt).reshape(5, 3)
    ck.save(1, {"x": {"t": t}}).wait()
    back = ck.load(1)["x"]["t"]
    assert back.dtype == dt and back.shape == t.shape
    assert raw(back) == rnd.tobytes()
    # On disk: the safetensors dtype name and exactly these bytes.
    hdr, start = header(file_of(root, 1))
    assert hdr["x.t"]["dtype"] == st and hdr["x.t"]["shape"] == [5, 3]
    a, b = hdr["x.t"]["data_offsets"]
    with open(file_of(root, 1), "rb") as f:
        f.seek(start + a)
        assert f.read(b - a) == rnd.tobytes()


def test_all_required_dtypes_are_mapped():
    need = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"}
    need |= {"U16", "U32", "U64"} if hasattr(torch, "uint64") else set()
    assert need <= set(_state.TORCH_TO_ST.values())


@pytest.mark.parametrize(
    "bad,where,what",
    [
        ({"model": {"w": torch.zeros(2, dtype=torch.complex128)}}, "state['model']['w']", "complex128"),
        ({"a": [1, {"b": {1, 2}}]}, "state['a'][1]['b']", "set"),
        ({"a": {1.5: 1}}, "state['a']", "float"),
        ({"a": {True: 1}}, "state['a']", "bool"),
        ({"a": {"b": np.float32(1.0)}}, "state['a']['b']", "float32"),
        ({"a": {"b": object()}}, "state['a']['b']", "object"),
        ({"a": np.array(["x"])}, "state['a']", "<U1"),
        ({"opt": {"f": lambda: 0}}, "state['opt']['f']", "function"),
        ({"q": torch.zeros(2).to_sparse()}, "state['q']", "sparse"),
    ],
)
def test_bad_input_is_a_type_error_naming_the_path_before_writing(ck, root, bad, where, what):
    state = {"first": torch.ones(1000), **bad}
    before = listing(root)
    with pytest.raises(TypeError) as ei:
        ck.save(5, state)
    msg = str(ei.value)
    assert where in msg and what in msg, msg
    assert listing(root) == before
    # The engine is still usable, and step 5 was never taken.
    ck.save(5, {"ok": torch.ones(1)}).wait()
    assert ck.list() == [5]


@pytest.mark.parametrize(
    "bad,key,what",
    [
        # A lone surrogate (os.fsdecode makes them of undecodable bytes) in a key of a
        # value, of a tensor, and in a string value: UTF-8 cannot encode any of them.
        ({"a": {"x\udc80": 1}}, "state['a']['x\\udc80']", "the key 'x\\udc80'"),
        ({"a": {"w\ud800": torch.ones(2)}}, "state['a']['w\\ud800']", "the key 'w\\ud800'"),
        ({"a": ["ok", "é\udcff"]}, "state['a'][1]", "the string 'é\\udcff'"),
    ],
)
def test_a_lone_surrogate_is_unsupported_naming_its_key(ck, root, bad, key, what):
    before = listing(root)
    with pytest.raises(shmckpt.UnsupportedValue) as ei:
        ck.save(5, {"first": torch.ones(4), **bad})
    assert ei.value.key == key
    assert str(ei.value).startswith(f"{key}: {what} is not valid Unicode text"), str(ei.value)
    assert listing(root) == before
    # Valid non-ASCII text round-trips.
    ck.save(5, {"a": {"é": "ü€😀", "😀": torch.ones(1)}}).wait()
    back = ck.load(5)
    assert back["a"]["é"] == "ü€😀" and torch.equal(back["a"]["😀"], torch.ones(1))


def test_name_collision_is_an_error(ck, root):
    with pytest.raises(ValueError) as ei:
        ck.save(1, {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}})
    assert "'a.b'" in str(ei.value)
    with pytest.raises(ValueError):
        ck.save(1, {"d": {0: torch.ones(1), "0": torch.ones(1)}})
    assert listing(root) == [p for p in listing(root) if not p.startswith("step-")]


def test_top_level_must_be_a_container(ck):
    with pytest.raises(TypeError):
        ck.save(1, torch.ones(2))


def test_non_contiguous_and_views_save_logical_contents(ck, root):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {
        "t": base.t(),
        "step": base[::2, 1::3],
        "narrow": base.narrow(1, 2, 5),
        "row": base[3],
        "expanded": torch.arange(3.0).expand(4, 3),
    }
    ck.save(1, state).wait()
    back = ck.load(1)
    for k, v in state.items():
        assert back[k].shape == v.shape and raw(back[k]) == raw(v.contiguous()), k
    files = load_file(file_of(root, 1))
    for k, v in state.items():
        assert torch.equal(files[k], v.contiguous()), k


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_saved_once_and_restored_as_one(ck, root):
    torch.manual_seed(0)
    m = Tied()
    sd = m.state_dict()
    assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
    ck.save(1, {"model": sd}).wait()
    hdr, _ = header(file_of(root, 1))
    assert "model.embed.weight" in hdr and "model.head.weight" not in hdr
    back = ck.load(1)["model"]
    assert back["head.weight"] is back["embed.weight"]
    assert raw(back["head.weight"]) == raw(m.embed.weight)

    # In place into a fresh tied model: one storage, right bytes.
    m2 = Tied()
    r = ck.load_into({"model": m2.state_dict()})
    assert r.missing_keys == [] and r.unexpected_keys == []
    assert raw(m2.head.weight) == raw(m.embed.weight)
    assert m2.head.weight.data_ptr() == m2.embed.weight.data_ptr()

    # Only the first key given: the alias is an unexpected key.
    only = {"model": {"embed.weight": torch.zeros(10, 4)}}
    with pytest.raises(shmckpt.DestinationError, match="model.head.weight: in the checkpoint"):
        ck.load_into(only)
    r = ck.load_into(only, strict=False)
    assert r.unexpected_keys == ["model.head.weight"] and r.missing_keys == []
    assert raw(only["model"]["embed.weight"]) == raw(m.embed.weight)

    # Into an untied model: both get the bytes.
    m3 = Tied()
    m3.head.weight = torch.nn.Parameter(torch.zeros(10, 4))
    ck.load_into({"model": m3.state_dict()})
    assert raw(m3.head.weight) == raw(m.embed.weight) == raw(m3.embed.weight)


def test_partially_overlapping_views_save_both(ck):
    base = torch.arange(10.0)
    ck.save(1, {"a": base[0:6], "b": base[4:10]}).wait()
    back = ck.load(1)
    assert raw(back["a"]) == raw(base[0:6]) and raw(back["b"]) == raw(base[4:10])


def test_safetensors_interchange_flat_names(ck, root):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ck.save(10, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 10}).wait()
    files = load_file(file_of(root, 10))
    for k, v in model.state_dict().items():
        assert raw(files["model." + k]) == raw(v) and files["model." + k].dtype == v.dtype
    assert raw(files["optim.state.0.exp_avg"]) == raw(opt.state[model[0].weight]["exp_avg"])
    assert "step" not in files  # plain values live in the metadata
    meta = json.loads(header(file_of(root, 10))[0]["__metadata__"][shmckpt.STATE_KEY])
    assert meta["format"] == 1


def test_foreign_checkpoint_loads_flat(root):
    # Written by the engine without the Python skeleton (e.g. from Rust): a flat dict.
    from shmckpt import _shmckpt

    e = _shmckpt.Engine(str(root), dict(staging_capacity=SMALL, chunk_size=1 << 20))
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    e.save(4, [("w", "F32", [2, 3], data.__dlpack__(), data.nbytes, -1)], {}, [], True).wait()
    e.close()
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20)) as c:
        back = c.load()
    assert list(back) == ["w"] and raw(back["w"]) == data.tobytes() and back["w"].shape == (2, 3)


def test_cpu_load_is_zero_copy(ck, monkeypatch):
    ck.save(1, {"a": torch.arange(1000, dtype=torch.float32), "b": {"c": torch.ones(7, dtype=torch.bfloat16)}}).wait()
    seen = {}
    real = ck._engine

    class Spy:
        def __getattr__(self, k):
            return getattr(real, k)

        def load(self, step=None, **kw):
            out = real.load(step, **kw)
            for name, _, _, buf in out[3]:
                seen[name] = buf.address
            return out

    monkeypatch.setattr(ck, "_engine", Spy())
    back = ck.load()
    assert back["a"].data_ptr() == seen["a"]
    assert back["b"]["c"].data_ptr() == seen["b.c"]
    # Writable, and the memory stays valid after the checkpointer's objects are gone.
    back["a"][0] = 5.0
    del seen
    assert back["a"][0].item() == 5.0 and back["a"][999].item() == 999.0


def test_errors_mirror_the_engine(ck, root):
    ck.save(1, {"a": torch.ones(4)}).wait()
    with pytest.raises(shmckpt.StepExists) as ei:
        ck.save(1, {"a": torch.ones(4)})
    assert isinstance(ei.value, shmckpt.ShmckptError) and "step 1 already exists" in str(ei.value)
    assert ei.value.kind == "StepExists"
    with pytest.raises(shmckpt.NotFound) as ei:
        ck.load(99)
    assert "step 99" in str(ei.value)
    with pytest.raises(shmckpt.TooLarge):
        ck.save(2, {"big": torch.zeros(SMALL // 4 + 1)})
    with pytest.raises(shmckpt.InvalidMetadata):
        ck.save(3, {"a": torch.ones(1)}, metadata={"shmckpt.step": "x"})
    # A missing root is created (test_firstday.py); one under a regular file cannot be.
    with open(os.path.join(root, "afile"), "wb"):
        pass
    with pytest.raises(shmckpt.RootMissing):
        shmckpt.Checkpointer(os.path.join(root, "afile", "nope"), tuning=shmckpt.Tuning(staging_capacity=SMALL))
    with pytest.raises(shmckpt.RootLocked):
        shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL))
    with pytest.raises(shmckpt.ConfigError):
        shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1000), rank=3, world_size=4)


def test_corrupted_file_is_a_checksum_error(ck, root):
    t = torch.arange(256, dtype=torch.int32)
    ck.save(1, {"model": {"w": t}}).wait()
    path = file_of(root, 1)
    hdr, start = header(path)
    a, _ = hdr["model.w"]["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(start + a + 17)
        b = f.read(1)
        f.seek(start + a + 17)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(shmckpt.ChecksumError) as ei:
        ck.load(1)
    assert "model.w" in str(ei.value) and "checksum" in str(ei.value)
    with pytest.raises(shmckpt.ChecksumError):
        ck.load_into({"model": {"w": torch.zeros(256, dtype=torch.int32)}})


def test_user_metadata_and_manifest(ck):
    ck.save(2, {"a": torch.ones(3)}, metadata={"run": "r1"}).wait()
    m = ck.manifest(2)
    assert m["step"] == 2 and m["metadata"]["run"] == "r1"
    assert [t["name"] for t in m["files"][0]["tensors"]] == ["a"]
    with pytest.raises(TypeError):
        ck.save(3, {"a": torch.ones(3)}, metadata={"run": 1})


@pytest.mark.parametrize(
    "old,new",
    [
        (b'"n":"zz"', b'"n":"qq"'),  # a tensor the file does not have
        (b'"t":"int","v":"7"', b'"t":"int","v":"x"'),  # not an int
        (b'"t":"dict"', b'"t":"diet"'),  # unknown node type
        (b'"format":1', b'"format":9'),  # unknown format
    ],
)
def test_tampered_skeleton_is_a_corrupt_error(ck, root, old, new):
    ck.save(1, {"zz": torch.ones(3), "n": 7}).wait()
    path = file_of(root, 1)
    data = open(path, "rb").read()
    # The skeleton is a JSON string inside the header JSON: its quotes are escaped.
    old, new = (json.dumps(x.decode())[1:-1].encode() for x in (old, new))
    assert data.count(old) == 1, data[:400]
    with open(path, "r+b") as f:
        f.write(data.replace(old, new))
    with pytest.raises(shmckpt.CorruptError):
        ck.load(1)


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b.t(),
        lambda b: b[::2, 1::3],
        lambda b: b[1:, 2:7].t(),
        lambda b: b[:, 3],
        lambda b: b.narrow(0, 2, 3)[:, ::4],
        lambda b: b[0:1, 0:1],
        lambda b: b[2].expand(3, 10),
    ],
)
def test_span_copy_of_non_contiguous_views_gives_the_logical_contents(make):
    """The host route of non-contiguous CUDA tensors (copy the covered storage span, which
    is contiguous, then gather on the host), checked on CPU tensors."""
    from shmckpt._util import _span

    b = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    t = make(b)
    base, gather = _span(t)
    assert base.is_contiguous() and base.dim() == 1
    assert base.data_ptr() >= b.data_ptr()
    assert base.data_ptr() + base.numel() * 8 <= b.data_ptr() + b.numel() * 8
    out = gather(base.clone())
    assert torch.equal(out, t.contiguous()) and out.is_contiguous()


def test_closed_checkpointer_is_a_shutdown_error(root):
    c = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20))
    name = c.shm_name
    assert os.path.exists(f"/dev/shm/{name}")
    c.save(1, {"a": torch.ones(2)}, blocking=False)
    c.close()  # waits for the save in flight
    c.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(shmckpt.ShutdownError, match="closed"):
        c.save(2, {"a": torch.ones(2)})
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20)) as c2:
        assert c2.list() == [1] and raw(c2.load(1)["a"]) == raw(torch.ones(2))


def test_a_fifo_in_place_of_the_rank_file_is_refused_without_blocking(ck, root):
    """Reading the per-rank skeleton never opens a FIFO blocking (as the engine's reader)."""
    import signal

    ck.save(1, {"w": torch.arange(4)}).wait()
    d = root / "step-1"
    (f,) = [p for p in d.iterdir() if p.name.endswith(".safetensors")]
    f.unlink()
    os.mkfifo(f)

    def hung(*_):
        raise AssertionError("load blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(shmckpt.UnsafePath, match="not a regular file"):
            ck.load(1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_host_destinations_that_overlap_or_are_addresses_are_refused(ck, root):
    """The extension makes byte slices of host destinations: an address (an integer, a null
    one included) is a TypeError, two capsules sharing memory a ValueError, before anything
    is read, by the engine's load_into and by the DCP reader's read_rank_file alike."""
    from shmckpt import _shmckpt

    ck.save(1, {"w": torch.arange(4)}).wait()
    buf = torch.zeros(4, dtype=torch.int64)
    u8 = buf.view(torch.uint8)
    cap = torch.utils.dlpack.to_dlpack
    load = lambda dest: _shmckpt.read_rank_file(str(root / "step-1"), 0, host=dest)  # noqa: E731
    for addr in (0, buf.data_ptr()):
        with pytest.raises(TypeError, match='destination "w": expected a DLPack capsule'):
            load([("w", addr)])
        with pytest.raises(TypeError, match='destination "w": expected a DLPack capsule'):
            ck._engine.load_into(1, [("w", addr)])
    with pytest.raises(ValueError, match="overlap in memory"):
        load([("w", cap(u8)), ("v", cap(u8[8:16]))])
    with pytest.raises(ValueError, match="overlap in memory"):
        ck._engine.load_into(1, [("w", cap(u8)), ("v", cap(u8[8:16]))])
    assert buf.tolist() == [0, 0, 0, 0]  # nothing was written


class _FakeArray:
    """An object exposing only ``__array_interface__``, as given: pure Python can name any
    address this way, so the extension never reads one."""

    def __init__(self, address: int, nbytes: int, **extra: object) -> None:
        self.__array_interface__ = {
            "version": 3,
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            **extra,
        }


def test_load_into_takes_checked_capsules_never_integers(ck):
    """Host destinations of the engine's load_into are DLPack capsules, not addresses nor
    objects describing one: an integer or an ``__array_interface__`` object is a TypeError;
    a read-only, a strided or a wrongly sized array is refused with a typed error before any
    byte is written, and a good one is filled with the checkpoint's exact bytes."""
    ck.save(1, {"w": torch.arange(4)}).wait()
    name = "w"
    dest = np.zeros(32, dtype=np.uint8)
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        ck._engine.load_into(1, [(name, dest.ctypes.data)])
    with pytest.raises(TypeError, match="expected a DLPack capsule.*not _FakeArray"):
        ck._engine.load_into(1, [(name, _FakeArray(dest.ctypes.data, 1, shape=(2**40, 2**40)))])
    with pytest.raises(TypeError, match="expected a DLPack capsule.*not ndarray"):
        ck._engine.load_into(1, [(name, dest)])  # the array itself: its capsule is asked for
    ro = np.zeros(32, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ck._engine.load_into(1, [(name, ro.__dlpack__(max_version=(1, 0)))])
    strided = np.zeros(64, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        ck._engine.load_into(1, [(name, strided.__dlpack__())])
    short = np.zeros(31, dtype=np.uint8)
    with pytest.raises(shmckpt.DestinationError):
        ck._engine.load_into(1, [(name, short.__dlpack__())])
    assert not short.any() and not dest.any() and not strided.any()
    # A 2-D int64 array of the tensor's size: its memory, checked, is the destination.
    two_d = np.zeros((2, 2), dtype=np.int64)
    assert ck._engine.load_into(1, [(name, two_d.__dlpack__())]) == 1
    assert two_d.reshape(-1).tolist() == [0, 1, 2, 3]


def test_device_destinations_are_checked_before_any_cuda_call(ck):
    """Device destinations of load_into_device are DLPack capsules of CUDA memory: an
    integer or an object exposing __cuda_array_interface__ is a TypeError, host memory or a
    negative device ordinal a ValueError, raised by the extension before CUDA is touched
    (this runs without a GPU)."""
    ck.save(1, {"w": torch.arange(4)}).wait()

    class Cai:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {
                "version": 3,
                "data": (1 << 40, False),
                "shape": (4,),
                "typestr": "<i8",
                "strides": None,
            }

    host = torch.zeros(4, dtype=torch.int64)
    for dest, err, match in [
        (lambda: [("w", 1 << 40, 0)], TypeError, "expected a DLPack capsule.*not int"),
        (lambda: [("w", Cai(), 0)], TypeError, "expected a DLPack capsule.*not Cai"),
        (lambda: [("w", torch.utils.dlpack.to_dlpack(host), 0)], ValueError, "not memory of CUDA device 0"),
        (lambda: [("w", torch.utils.dlpack.to_dlpack(host), -1)], ValueError, "not a CUDA device"),
    ]:
        with pytest.raises(err, match=match):
            ck._engine.load_into_device(1, dest())
        with pytest.raises(err, match=match):
            ck._engine.load_into_device_remote(1, dest())
    assert host.tolist() == [0, 0, 0, 0]


def test_a_durable_save_keeps_no_descriptor_of_its_file(ck, root):
    # Closing the last descriptor of a deleted file frees its blocks (seconds for
    # gigabytes with `discard`): the engine once held its last file open until the next
    # save, which then paid for the user's deletion of that checkpoint.
    state = {"w": torch.arange(300_000, dtype=torch.int32)}
    for step in (1, 2, 3):
        handle = ck.save(step, state)
        handle.wait()
        assert descriptors_under(root) == []
        assert raw(load_file(file_of(root, step))["w"]) == raw(state["w"])
        shutil.rmtree(os.path.join(root, f"step-{step}"))
        assert descriptors_under(root) == []
    assert ck.list() == []
