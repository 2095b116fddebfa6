"""anchors: deterministic content generator (shared with shmckpt's `bench --source ...`),
state layouts and the random GPU state the systems save."""

import math

GiB = 1 << 30
MiB = 1 << 20

# ----------------------------------------------------------------------------
# deterministic content generator (shared with shmckpt's `bench --source ...`)
# ----------------------------------------------------------------------------
M64 = (1 << 64) - 1
SEED_BASE = 0x5348_4D43_4B50_5400  # "SHMCKPT\0"
SPLITMIX_KNOWN = {0: 0xE220A8397B1DCDAF, 1: 0x910A2DEC89025CC1}


def splitmix64_int(x):
    """Reference splitmix64 on Python ints (mod 2^64)."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def seed_word(k, seed=0):
    """seed_word(k) = (0x5348_4D43_4B50_5400 ^ (k << 32)) mod 2^64, seed 0 only."""
    if seed != 0:
        raise NotImplementedError("only seed 0 is specified")
    return (SEED_BASE ^ (k << 32)) & M64


def splitmix64_np(x):
    import numpy as np

    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def expected_bytes(k, nbytes):
    """Bytes of tensor k (0-based, layout order): little-endian u64 words
    w_j = splitmix64(seed_word(k) + j), j = 0, 1, ..., truncated to nbytes.
    Returns a numpy uint8 array of length nbytes."""
    import numpy as np

    nwords = (nbytes + 7) // 8
    with np.errstate(over="ignore"):
        x = np.arange(nwords, dtype=np.uint64) + np.uint64(seed_word(k))
        w = splitmix64_np(x)
    return w.astype("<u8", copy=False).view(np.uint8)[:nbytes]


def _expected_bytes_int(k, nbytes):
    out = bytearray()
    j = 0
    while len(out) < nbytes:
        out += splitmix64_int((seed_word(k) + j) & M64).to_bytes(8, "little")
        j += 1
    return bytes(out[:nbytes])


def selftest_generator():
    """Checks the generator against the known constants and a pure-int
    reference. Returns a dict; 'ok' is False on any mismatch."""
    import numpy as np

    res = {"ok": True, "checks": []}

    def check(name, got, want):
        ok = got == want
        res["checks"].append({"name": name, "ok": ok, "got": str(got), "want": str(want)})
        if not ok:
            res["ok"] = False

    for x, want in SPLITMIX_KNOWN.items():
        check(f"splitmix64_int({x})", hex(splitmix64_int(x)), hex(want))
        got = int(splitmix64_np(np.array([x], dtype=np.uint64))[0])
        check(f"splitmix64_np({x})", hex(got), hex(want))
    # wrap-around of x + golden ratio and of seed_word + j
    for x in (M64, M64 - 5, 1 << 63, 0x123456789ABCDEF0):
        got = int(splitmix64_np(np.array([x], dtype=np.uint64))[0])
        check(f"splitmix64_np(0x{x:x}) == int", hex(got), hex(splitmix64_int(x)))
    for k in (0, 1, 7, 999, 0xFFFFFFFF):
        for n in (0, 1, 7, 8, 9, 64, 1001):
            check(
                f"expected_bytes({k},{n}) == int ref",
                expected_bytes(k, n).tobytes().hex(),
                _expected_bytes_int(k, n).hex(),
            )
    check("seed_word(0)", hex(seed_word(0)), hex(0x5348_4D43_4B50_5400))
    check("seed_word(1)", hex(seed_word(1)), hex(0x5348_4D43_4B50_5400 ^ (1 << 32)))
    return res


# ----------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------
MIXED_DTYPES = ["BF16", "F32", "F16", "BF16", "I64", "U8", "F32", "BF16"]
ELEM_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def mixed_layout(n, total_bytes):
    """Tensor i: dtype MIXED_DTYPES[i % 8]; weight w_i = 1 + (i*2654435761) % 97;
    elements = floor(total_bytes * w_i / sum(w) / elem_size) (at least 1);
    shape [elements // 1024, 1024] when elements is a multiple of 1024 and
    >= 2048, else [elements]; name layers.{i}.weight."""
    w = [1 + (i * 2654435761) % 97 for i in range(n)]
    sw = sum(w)
    out = []
    for i in range(n):
        dt = MIXED_DTYPES[i % 8]
        es = ELEM_SIZE[dt]
        elems = max(1, (total_bytes * w[i]) // (sw * es))
        shape = [elems // 1024, 1024] if (elems >= 2048 and elems % 1024 == 0) else [elems]
        out.append({"name": f"layers.{i}.weight", "dtype": dt, "shape": shape})
    return out


def make_layout(state, scale=1.0):
    if state == "8g":
        rows = max(1, int(round(8192 * scale)))
        return [{"name": f"layers.{i}.weight", "dtype": "BF16", "shape": [rows, 8192]} for i in range(64)]
    if state == "16g":
        return mixed_layout(1000, int(16 * GiB * scale))
    if state == "small":
        return mixed_layout(16, int(256 * MiB * scale))
    raise ValueError(f"unknown state {state!r}")


def layout_nbytes(entry):
    return math.prod(entry["shape"]) * ELEM_SIZE[entry["dtype"]]


def torch_dtype(name):
    import torch

    return {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F64": torch.float64,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }[name]


def make_state(layout, device, seed=1234):
    """Random content: torch.randint on uint8, viewed as the dtype. Returns
    (state_dict, raw_uint8_tensors)."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed)
    sd, raws = {}, []
    for e in layout:
        n = layout_nbytes(e)
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)
        sd[e["name"]] = raw.view(torch_dtype(e["dtype"])).view(e["shape"])
        raws.append(raw)
    if device == "cuda":
        torch.cuda.synchronize()
    return sd, raws


def mutate_in_place(raws, device):
    """Steady state: same tensors, every byte changed in place."""
    import torch

    for r in raws:
        r.add_(1)
    if device == "cuda":
        torch.cuda.synchronize()
