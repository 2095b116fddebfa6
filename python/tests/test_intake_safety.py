"""No call of the extension takes an address from Python (issue 37): tensors and arrays come
as DLPack capsules, which the extension checks, consumes and owns for as long as it uses
their memory. A forged address or length cannot be passed any more; a capsule of the wrong
place, layout or size is a clear error before any byte is read or written; and what is
saved and loaded through capsules is the exact bytes (bf16 included)."""

import gc
import tempfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import shmckpt
from shmckpt import _shmckpt, _util
from shmckpt.errors import StepExists

from conftest import SMALL, listing

cap = torch.utils.dlpack.to_dlpack


def file_of(root, step):
    return str(root / f"step-{step}" / "rank-00000-of-00001.safetensors")


def bits(t):
    """The bytes of a tensor (bf16 and all as they are)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def engine(root):
    e = _shmckpt.Engine(str(root), dict(staging_capacity=SMALL, chunk_size=1 << 20))
    yield e
    e.close()


# -- forged addresses and lengths ----------------------------------------------------------


def test_a_save_refuses_an_address_whatever_the_length(engine, root):
    """The old tuple (name, dtype, shape, address, nbytes, device) named any memory with
    any length: now an integer is a TypeError, never read."""
    w = torch.arange(4, dtype=torch.float32)
    before = listing(root)
    for addr, nbytes in [(w.data_ptr(), 16), (w.data_ptr(), 1 << 40), (0x1000, 16), (0, 16)]:
        for dev in (-1, 0):
            with pytest.raises(TypeError, match=r'tensor "w": expected a DLPack capsule.*not int'):
                engine.save(1, [("w", "F32", [4], addr, nbytes, dev)], {}, [], True)
    assert listing(root) == before


def test_a_save_and_a_hold_refuse_stream_and_event_handles_that_are_not_torch_objects(engine, root):
    """A CUDA stream or event handle made up in Python (an int, an object with a
    ``cuda_stream`` attribute, a subclass of torch's class overriding it) would
    reach the driver: a save's ``after`` and a handle's ``hold_streams`` take exactly a
    ``torch.cuda.Stream`` or ``torch.cuda.Event`` (the type itself, not a subclass), and
    refuse anything else before a byte is staged."""

    class Fake:
        cuda_stream = 0x1234
        cuda_event = 0x1234
        device_index = 0

    w = torch.arange(4, dtype=torch.float32)
    before = listing(root)
    bad = [
        ((0, "stream", 0x1234), TypeError, r"stream must be a torch\.cuda\.Stream \(not a subclass\), not int"),
        ((0, "event", 0x1234), TypeError, r"event must be a torch\.cuda\.Event \(not a subclass\), not int"),
        ((0, "stream", Fake()), TypeError, r"not Fake"),
        ((0, "event", Fake()), TypeError, r"not Fake"),
        ((0, "queue", Fake()), ValueError, r"ordering kind must be 'stream' or 'event', not \"queue\""),
    ]
    for after, exc, match in bad:
        for blocking in (True, False):
            with pytest.raises(exc, match=match):
                engine.save(1, [("w", "F32", [4], cap(w), 16, -1)], {}, [after], blocking)
    assert listing(root) == before
    h = engine.save(1, [("w", "F32", [4], cap(w), 16, -1)], {}, [], False)
    for streams, match in [([(0, 0x1234)], r"not int"), ([(0, Fake())], r"not Fake")]:
        with pytest.raises(TypeError, match=match):
            h.hold_streams(streams)
    h.wait()
    assert load_file(file_of(root, 1))["w"].equal(w)


def test_a_capsule_larger_or_smaller_than_the_tuple_says_is_refused(engine, root):
    """The length comes from the capsule: a tuple claiming more (or fewer) bytes than the
    tensor has, or another device, is a ValueError naming both."""
    before = listing(root)
    for nbytes, dev, match in [
        (1 << 40, -1, r"says 1099511627776 bytes on Host, its memory is 16 bytes on Host"),
        (8, -1, r"says 8 bytes on Host, its memory is 16 bytes on Host"),
        (16, 0, r"says 16 bytes on Cuda\(0\), its memory is 16 bytes on Host"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.save(1, [("w", "F32", [4], cap(torch.arange(4.0)), nbytes, dev)], {}, [], True)
    assert listing(root) == before


def test_the_engine_sizes_the_save_from_the_capsule_and_checks_the_shape(engine):
    """A shape that is not the capsule's is refused at intake, naming both."""
    with pytest.raises(ValueError, match=r'tensor "w": the tuple says F32 \[1073741824\], its memory holds DLPack type \(code 2, 32 bits, 1 lanes\) of shape \[4\]'):
        engine.save(1, [("w", "F32", [1 << 30], cap(torch.arange(4.0)), 16, -1)], {}, [], True)


def test_a_tuple_whose_dtype_or_shape_is_not_its_tensors_is_refused(engine, root):
    """The bytes of an engine tuple are labelled with its dtype and shape: a tuple that
    says another dtype or shape than its capsule's tensor (what a stale layout cache would
    give), with the same byte length, is a ValueError before anything is written, never
    bytes saved under the wrong label."""
    w = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    before = listing(root)
    bad = [
        ("F32", [3, 4], r"says F32 \[3, 4\], its memory holds DLPack type \(code 0, 32 bits, 1 lanes\) of shape \[3, 4\]"),
        ("U32", [3, 4], r"says U32 \[3, 4\].*code 0, 32 bits"),
        ("I32", [4, 3], r"says I32 \[4, 3\].*of shape \[3, 4\]"),
        ("I32", [12], r"says I32 \[12\].*of shape \[3, 4\]"),
        ("I16", [3, 8], r"says I16 \[3, 8\].*code 0, 32 bits"),
        ("BF16", [3, 8], r"says BF16 \[3, 8\].*code 0, 32 bits"),
    ]
    for dtype, shape, match in bad:
        for blocking in (True, False):
            with pytest.raises(ValueError, match=match):
                engine.save(1, [("w", dtype, shape, cap(w), 48, -1)], {}, [], blocking)
    assert listing(root) == before
    # The right tuple, a 0-d tensor, bool, bf16, and a tensor handed over as its bytes (a
    # one-dimensional uint8 view: how the package passes a dtype DLPack cannot carry).
    b = torch.tensor([True, False, True])
    h16 = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    s = torch.tensor(7.5, dtype=torch.float64)
    raw8 = torch.arange(8, dtype=torch.uint8)
    tuples = [
        ("w", "I32", [3, 4], cap(w), 48, -1),
        ("b", "BOOL", [3], cap(b), 3, -1),
        ("h", "BF16", [2, 3], cap(h16), 12, -1),
        ("s", "F64", [], cap(s), 8, -1),
        ("f8", "F8_E4M3", [2, 4], cap(raw8), 8, -1),
        ("asbytes", "F32", [3, 4], cap(w.reshape(-1).view(torch.uint8)), 48, -1),
        ("arr", "U16", [2, 2], np.arange(4, dtype=np.uint16).reshape(2, 2).__dlpack__(), 8, -1),
    ]
    engine.save(1, tuples, {}, [], True).wait()
    back = load_file(file_of(root, 1))
    assert bits(back["w"]) == bits(w) and back["w"].dtype == torch.int32 and back["w"].shape == (3, 4)
    assert back["b"].tolist() == [True, False, True]
    assert bits(back["h"]) == bits(h16) and back["h"].dtype == torch.bfloat16
    assert back["s"].item() == 7.5 and back["s"].shape == ()
    assert bits(back["f8"]) == bits(raw8) and back["f8"].dtype == torch.float8_e4m3fn
    assert bits(back["asbytes"]) == bits(w) and back["asbytes"].dtype == torch.float32
    assert back["arr"].tolist() == [[0, 1], [2, 3]]


def test_prepared_tensors_are_checked_at_prepare_and_taken_by_one_save(engine, root):
    """``Engine.prepare`` checks the tuples as ``save`` does (a lying tuple is refused
    there, naming both); a save takes the prepared tensors, started or not (a second use,
    or a use after ``release``, is a ValueError, nothing written), and stores their exact
    bytes."""
    w = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    with pytest.raises(ValueError, match=r"says F32 \[3, 4\], its memory holds DLPack type \(code 0, 32 bits"):
        engine.prepare([("w", "F32", [3, 4], cap(w), 48, -1)])
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        engine.prepare([("w", "I32", [3, 4], w, 48, -1)])
    before = listing(root)
    p = engine.prepare([("w", "I32", [3, 4], cap(w), 48, -1), ("e", "F32", [0], None, 0, -1)])
    assert len(p) == 2 and not p.taken
    p.release()
    assert p.taken
    with pytest.raises(ValueError, match="taken by a save or released"):
        engine.save(1, p, {}, [], True)
    assert listing(root) == before
    p = engine.prepare([("w", "I32", [3, 4], cap(w), 48, -1)])
    h = engine.save(1, p, {}, [], False)
    assert p.taken
    h.wait()
    with pytest.raises(ValueError, match="taken by a save or released"):
        engine.save(2, p, {}, [], False)
    back = load_file(file_of(root, 1))
    assert bits(back["w"]) == bits(w) and back["w"].dtype == torch.int32 and back["w"].shape == (3, 4)
    # Taken by a save that fails (the step exists): gone all the same.
    p = engine.prepare([("w", "I32", [3, 4], cap(w), 48, -1)])
    with pytest.raises(StepExists):
        engine.save(1, p, {}, [], True)
    assert p.taken


def test_objects_describing_memory_are_not_capsules(engine):
    """Pure Python can describe any memory through ``__array_interface__``,
    ``__cuda_array_interface__`` or a buffer-like object: none is taken."""

    class Forged:
        __array_interface__ = {"version": 3, "data": (0x1000, False), "shape": (16,), "typestr": "|u1"}
        __cuda_array_interface__ = __array_interface__

    t = torch.arange(4.0)
    for obj in (Forged(), t, t.numpy(), memoryview(bytearray(16)), b"\0" * 16, 0x1000):
        with pytest.raises(TypeError, match="expected a DLPack capsule"):
            engine.save(1, [("w", "F32", [4], obj, 16, -1)], {}, [], True)
        with pytest.raises(TypeError, match="expected a DLPack capsule"):
            _shmckpt.crc32c_of(obj)


def test_crc32c_at_is_gone_and_crc32c_of_takes_host_capsules():
    assert not hasattr(_shmckpt, "crc32c_at")
    data = np.frombuffer(b"123456789", dtype=np.uint8).copy()
    assert _shmckpt.crc32c_of(data.__dlpack__()) == 0xE3069283  # CRC-32C check value
    assert _shmckpt.crc32c_of(cap(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8))) == 0xE3069283
    first = _shmckpt.crc32c_of(data[:4].__dlpack__())
    assert _shmckpt.crc32c_of(data[4:].__dlpack__(), first) == 0xE3069283
    assert _shmckpt.crc32c_of(None, 7) == 7
    with pytest.raises(ValueError, match="not C-contiguous"):
        _shmckpt.crc32c_of(np.zeros(8, np.uint8)[::2].__dlpack__())


def test_a_capsule_is_taken_once(engine):
    """The extension consumes a capsule (the DLPack protocol): a second use is refused, and
    nobody else can take the tensor from it meanwhile."""
    c = cap(torch.arange(4.0))
    engine.save(1, [("w", "F32", [4], c, 16, -1)], {}, [], True).wait()
    with pytest.raises(ValueError, match="consumed already"):
        engine.save(2, [("w", "F32", [4], c, 16, -1)], {}, [], True)
    with pytest.raises(Exception):
        torch.utils.dlpack.from_dlpack(c)


def test_a_refused_capsule_is_not_consumed(engine):
    """A capsule that fails a check is left to its producer (which frees it with the
    capsule); it can still be used."""
    t = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    c = cap(t)
    with pytest.raises(ValueError, match="not C-contiguous"):
        engine.save(1, [("w", "F32", [3, 2], c, 24, -1)], {}, [], True)
    assert torch.equal(torch.utils.dlpack.from_dlpack(c), t)


# -- destinations ---------------------------------------------------------------------------


def test_destinations_must_be_writable_contiguous_host_capsules(ck, root):
    ck.save(1, {"w": torch.arange(4)}).wait()
    ro = np.zeros(32, np.uint8)
    ro.flags.writeable = False
    bad = [
        (0x1000, TypeError, "expected a DLPack capsule"),
        (ro.__dlpack__(max_version=(1, 0)), ValueError, "read-only"),
        (np.zeros(64, np.uint8)[::2].__dlpack__(), ValueError, "not C-contiguous"),
        (cap(torch.zeros(8, 4, dtype=torch.uint8).t()), ValueError, "not C-contiguous"),
    ]
    for obj, err, match in bad:
        with pytest.raises(err, match=match):
            ck._engine.load_into(1, [("w", obj)])
    for obj, err, match in bad[:1] + bad[2:]:
        with pytest.raises(err, match=match):
            _shmckpt.read_rank_file(str(root / "step-1"), 0, host=[("w", obj)])
        with pytest.raises(err, match=match):
            _shmckpt.read_rank_ranges(str(root / "step-1"), 0, [], host=[("w", obj, 0)])
    # The package's own wrapper says why in its terms.
    with pytest.raises(ValueError, match="writable"):
        _util.dest_capsule(ro)
    with pytest.raises(ValueError, match="contiguous"):
        _util.dest_capsule(torch.zeros(4, 4).t())


def test_device_reads_refuse_host_memory_and_integers(root, ck):
    ck.save(1, {"w": torch.arange(4)}).wait()
    h = torch.zeros(4, dtype=torch.int64)
    for dest, err in [([("w", h.data_ptr(), 0)], TypeError), ([("w", cap(h), 0)], ValueError)]:
        with pytest.raises(err):
            _shmckpt.read_rank_file(str(root / "step-1"), 0, device=dest)
        with pytest.raises(err):
            _shmckpt.read_rank_ranges(str(root / "step-1"), 0, [], device=dest)
    assert h.tolist() == [0, 0, 0, 0]


# -- exact bytes ----------------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _values(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        return raw[:n] % 2 == 1
    return raw.view(dtype)


@pytest.mark.parametrize("blocking", [True, False])
def test_save_and_load_give_the_exact_bytes(ck, root, blocking):
    state = {str(d).removeprefix("torch."): _values(d, 37, i) for i, d in enumerate(DTYPES)}
    state["bf16_2d"] = _values(torch.bfloat16, 60, 99).reshape(6, 10)
    state["strided"] = _values(torch.bfloat16, 60, 98).reshape(6, 10).t()
    state["array"] = np.arange(11, dtype=np.int16)
    state["empty"] = torch.zeros(0, dtype=torch.bfloat16)
    h = ck.save(3, state, blocking=blocking)
    h.wait()
    on_disk = load_file(file_of(root, 3))
    for k, v in state.items():
        if k != "array":
            assert bits(on_disk[k]) == bits(v), k
    back = ck.load(3)
    dest = {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else torch.zeros_like(v)) for k, v in state.items()}
    ck.load_into(dest, 3)
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            assert back[k].tobytes() == v.tobytes() == dest[k].tobytes(), k
        else:
            assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
            assert bits(back[k]) == bits(v) == bits(dest[k]), k


def test_a_repeated_save_of_one_layout_reads_the_tensors_anew(ck):
    """The layout cache keeps no tensor (nor capsule): every save hands the engine fresh
    capsules of the same tensors, so changed values are saved."""
    w = torch.zeros(1000, dtype=torch.bfloat16)
    state = {"w": w, "b": torch.zeros(3)}
    for step in range(4):
        w.fill_(step)
        ck.save(step, state).wait()
        assert ck._layout is None or all(e[3] is None for e in (ck._layout.plan.entries if ck._layout.plan else []))
    for step in range(4):
        assert bits(ck.load(step)["w"]) == bits(torch.full((1000,), step, dtype=torch.bfloat16))


# -- memory kept alive ----------------------------------------------------------------------


@pytest.mark.parametrize("producer", ["torch", "numpy"])
def test_a_non_blocking_save_keeps_the_memory_when_everything_else_is_dropped(producer):
    """The handle owns the capsules' tensors until staged: dropping the caller's tensor and
    the handle at once (before staging ends) never frees memory under the engine's copy;
    the save's bytes are exact. (numpy's deleter takes the GIL itself: freed from the
    handle's release thread.)"""
    n = 48 << 20
    expect = None
    with tempfile.TemporaryDirectory() as d:
        e = _shmckpt.Engine(d, dict(staging_capacity=64 << 20, chunk_size=1 << 20, writer_threads=1, queue_depth=1))
        try:
            for step in range(3):
                if producer == "torch":
                    t = torch.full((n,), step + 1, dtype=torch.uint8)
                    c = cap(t)
                else:
                    t = np.full(n, step + 1, dtype=np.uint8)
                    c = t.__dlpack__()
                h = e.save(step, [("w", "U8", [n], c, n, -1)], {}, [], False)
                del t, c, h
                gc.collect()
                # Fresh allocations of the same size would reuse freed memory.
                junk = [np.full(n, 0xEE, dtype=np.uint8) for _ in range(2)]
                del junk
            e.flush()
            for step in range(3):
                _, _, _, tensors = e.load(step)
                ((name, dtype, shape, buf),) = tensors
                expect = bytes([step + 1]) * n
                assert np.asarray(buf).tobytes() == expect, step
        finally:
            e.close()


# -- CUDA memory (skipped without a GPU) -----------------------------------------------------


@pytest.mark.gpu
def test_a_device_save_and_load_through_capsules_give_the_exact_bytes(engine):
    """CUDA tensors go in and come back as kDLCUDA capsules: the engine's own save and
    device load (the raw extension calls), bf16 included, byte for byte."""
    src = _values(torch.bfloat16, 4099, 7).cuda()
    n = src.numel() * 2
    engine.save(1, [("w", "BF16", [4099], cap(src), n, src.device.index)], {}, [], True).wait()
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    assert engine.load_into_device(1, [("w", cap(dst.view(torch.uint8)), dst.device.index)], False) == 1
    torch.cuda.synchronize()
    assert bits(dst.cpu()) == bits(src.cpu())


@pytest.mark.gpu
def test_device_capsules_of_the_wrong_place_or_layout_are_refused(engine):
    """A CUDA capsule named with another ordinal, given as host memory, strided, or taken
    as a host destination or a crc32c input is refused before any copy."""
    src = torch.arange(16, dtype=torch.float32, device="cuda")
    dev = src.device.index
    with pytest.raises(ValueError, match=r"its memory is 64 bytes on Cuda"):
        engine.save(1, [("w", "F32", [16], cap(src), 64, -1)], {}, [], True)
    with pytest.raises(ValueError, match=r"its memory is 64 bytes on Cuda"):
        engine.save(1, [("w", "F32", [16], cap(src), 64, dev + 1)], {}, [], True)
    with pytest.raises(ValueError, match="not C-contiguous"):
        engine.save(1, [("w", "F32", [4, 4], cap(src.reshape(4, 4).t()), 64, dev)], {}, [], True)
    engine.save(1, [("w", "F32", [16], cap(src), 64, dev)], {}, [], True).wait()
    dst = torch.zeros(16, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match=f"not memory of CUDA device {dev + 1}"):
        engine.load_into_device(1, [("w", cap(dst), dev + 1)], False)
    with pytest.raises(ValueError, match="not host memory"):
        engine.load_into(1, [("w", cap(dst))])
    with pytest.raises(ValueError, match="not host memory"):
        _shmckpt.crc32c_of(cap(dst))
    torch.cuda.synchronize()
    assert not dst.any()


@pytest.mark.gpu
def test_a_dropped_non_blocking_device_save_keeps_its_memory(root):
    """A non-blocking save of CUDA memory whose handle and tensor are dropped at once: the
    handle's release thread keeps the tensor until staged; the bytes are exact."""
    n = 64 << 20
    e = _shmckpt.Engine(str(root), dict(staging_capacity=96 << 20, chunk_size=1 << 20))
    try:
        for step in range(3):
            t = torch.full((n,), step + 1, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            h = e.save(step, [("w", "U8", [n], cap(t), n, t.device.index)], {}, [], False)
            del t, h
            junk = torch.full((n,), 0xEE, dtype=torch.uint8, device="cuda")  # reuses freed blocks
            del junk
        e.flush()
        for step in range(3):
            ((_, _, _, buf),) = e.load(step)[3]
            assert np.asarray(buf).tobytes() == bytes([step + 1]) * n, step
    finally:
        e.close()
