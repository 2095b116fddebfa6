"""anchors: running the shmckpt binary (`shmckpt bench ... --json`), the
shmckpt-shm / shmckpt-ipc system and the shmckpt -> safetensors interchange check."""

import json
import os
import subprocess
import traceback

from peers import log, now

from anchors_state import expected_bytes, layout_nbytes, make_layout, torch_dtype
from anchors_util import disk_usage_of, gpu_mem, rmtree


SHMCKPT_KEYS = [
    "bytes",
    "tensors",
    "stall_s",
    "stall_first_s",
    "stall_steady_s",
    "durable_s",
    "durable_first_s",
    "persist_gbps",
    "reference_write_gbps",
    "ratio",
    "d2h_gbps",
    "stall_ratio",
    "register_s",
    "gpu_mem_used_after_bytes",
    "peak_rss_bytes",
]


def parse_json_stdout(text):
    text = (text or "").strip()
    if not text:
        raise ValueError("empty stdout")
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            return obj
    except Exception:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
                if isinstance(obj, dict):
                    return obj
            except Exception:
                continue
    raise ValueError(f"no JSON object on stdout: {text[-300:]!r}")


def run_shmckpt(ctx, args_tail, timeout):
    if not ctx.shmckpt_bin or not os.path.isfile(ctx.shmckpt_bin):
        raise FileNotFoundError(f"shmckpt binary not found: {ctx.shmckpt_bin}")
    cmd = [ctx.shmckpt_bin] + args_tail
    log(f"    $ {' '.join(cmd)}")
    t0 = now()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    wall = now() - t0
    err_tail = "\n".join((p.stderr or "").splitlines()[-15:])
    if err_tail:
        for line in err_tail.splitlines():
            log(f"    | {line}")
    if p.returncode != 0:
        raise RuntimeError(f"shmckpt exited {p.returncode}: {err_tail[-800:]}")
    return parse_json_stdout(p.stdout), wall, cmd


def sys_shmckpt(ctx, r, mode):
    base = os.path.join(ctx.ckpt_dir, f"shmckpt-{mode}")
    rmtree(base)
    os.makedirs(base, exist_ok=True)
    try:
        j, wall, cmd = run_shmckpt(
            ctx,
            ["bench", "--source", ctx.shmckpt_source, "--mode", mode, "--layout", ctx.layout_path,
             "--dir", base, "--repeat", str(ctx.saves), "--json"],
            ctx.timeout,
        )
        alloc, apparent, files = disk_usage_of(base)
    finally:
        rmtree(base)
    out = {k: j.get(k) for k in SHMCKPT_KEYS}
    r["shmckpt_json"] = j
    r["shmckpt"] = out
    r["command"] = cmd
    r["process_wall_s"] = wall
    stall2 = out.get("stall_steady_s") if out.get("stall_steady_s") is not None else out.get("stall_s")
    r["stall_s"] = [out.get("stall_first_s"), stall2]
    r["durable_s"] = [out.get("durable_first_s"), out.get("durable_s")]
    r["disk_bytes_left_after_run"] = alloc
    r["apparent_bytes_left_after_run"] = apparent
    r["gpu_after"] = gpu_mem(ctx)
    r["gpu_after_reported_by_shmckpt_bytes"] = out.get("gpu_mem_used_after_bytes")
    r["notes"].append(
        "separate process with its own GPU copy of the layout (--source %s); #1 = *_first_s, "
        "#2 = stall_steady_s (else stall_s) / durable_s as printed by the binary" % ctx.shmckpt_source
    )
    if j.get("bytes") is not None and j.get("bytes") != ctx.nbytes:
        r["notes"].append(f"shmckpt reports bytes={j.get('bytes')} but the layout has {ctx.nbytes}")


# ----------------------------------------------------------------------------
# interchange check
# ----------------------------------------------------------------------------
def verify_safetensors(path, layout, device):
    """Loads `path` with safetensors.torch.load_file and compares every tensor,
    byte for byte, with expected_bytes(k, nbytes) (k = index in layout)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    loaded = load_file(path, device=device)
    per = []
    for k, e in enumerate(layout):
        name = e["name"]
        nb = layout_nbytes(e)
        item = {"k": k, "name": name, "bytes": nb, "ok": False}
        t = loaded.get(name)
        if t is None:
            item["error"] = "missing"
            per.append(item)
            continue
        item["dtype"] = str(t.dtype)
        item["shape"] = list(t.shape)
        problems = []
        if t.dtype != torch_dtype(e["dtype"]):
            problems.append(f"dtype {t.dtype} != {e['dtype']}")
        if list(t.shape) != list(e["shape"]):
            problems.append(f"shape {list(t.shape)} != {e['shape']}")
        got = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        want = expected_bytes(k, nb)
        if got.size != want.size:
            problems.append(f"{got.size} bytes != {want.size}")
        else:
            diff = np.flatnonzero(got != want)
            if diff.size:
                problems.append(f"{diff.size} bytes differ, first at {int(diff[0])}")
                if diff.size == 1 and int(diff[0]) == 0:
                    # diagnostic only: a bench that stamps byte 0 of every tensor per save
                    item["only_byte0_differs"] = True
                    item["byte0_got"] = int(got[0])
                    item["byte0_generator"] = int(want[0])
        if problems:
            item["error"] = "; ".join(problems)
        else:
            item["ok"] = True
        per.append(item)
    extra = sorted(set(loaded) - {e["name"] for e in layout})
    passed = sum(1 for p in per if p["ok"])
    return {
        "file": path,
        "tensors": len(layout),
        "passed": passed,
        "failed": len(layout) - passed,
        "failed_only_at_byte0": sum(1 for p in per if p.get("only_byte0_differs")),
        "extra_tensors_in_file": extra,
        "ok": passed == len(layout) and not extra,
        "per_tensor": per,
    }


def interchange_check(ctx):
    r = {"ok": False, "error": None}
    layout = make_layout("small", ctx.scale)
    lpath = os.path.join(ctx.out_dir, "layout-small.json")
    with open(lpath, "w") as f:
        json.dump(layout, f)
    d = os.path.join(ctx.ckpt_dir, "interchange")
    rmtree(d)
    os.makedirs(d, exist_ok=True)
    try:
        j, wall, cmd = run_shmckpt(
            ctx,
            ["bench", "--source", ctx.shmckpt_source, "--layout", lpath, "--dir", d, "--repeat", "1", "--keep", "--json"],
            ctx.timeout,
        )
        r["command"] = cmd
        r["shmckpt_json"] = j
        kept = j.get("kept_dir")
        if not kept:
            raise RuntimeError("shmckpt JSON has no kept_dir")
        path = os.path.join(kept, "rank-00000-of-00001.safetensors")
        v = verify_safetensors(path, layout, ctx.device)
        r.update(v)
        log(
            f"  interchange: {v['passed']}/{v['tensors']} tensors byte-exact, extra={v['extra_tensors_in_file']}"
            + (f", {v['failed_only_at_byte0']} differ only in byte 0" if v["failed_only_at_byte0"] else "")
        )
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
        r["traceback"] = traceback.format_exc()
        log(f"  interchange FAILED: {r['error']}")
    finally:
        rmtree(d)
    return r


def selftest_interchange_synthetic(tmpdir, device):
    """Writes a safetensors file with the expected content (safetensors.torch
    .save_file), checks the verifier passes it, corrupts one byte, checks the
    verifier catches it. Proves the verifier, not shmckpt."""
    import torch
    from safetensors.torch import save_file

    layout = make_layout("small", 1.0 / 256)  # 1 MiB, mixed dtypes
    tensors = {}
    for k, e in enumerate(layout):
        b = torch.from_numpy(expected_bytes(k, layout_nbytes(e)).copy())
        tensors[e["name"]] = b.view(torch_dtype(e["dtype"])).view(e["shape"])
    os.makedirs(tmpdir, exist_ok=True)
    p = os.path.join(tmpdir, "rank-00000-of-00001.safetensors")
    save_file(tensors, p)
    good = verify_safetensors(p, layout, device)
    name = layout[3]["name"]
    t = tensors[name].reshape(-1).view(torch.uint8)
    t[5] ^= 0xFF
    save_file(tensors, p)
    bad = verify_safetensors(p, layout, device)
    rmtree(tmpdir)
    return {
        "good_file_passed": good["passed"],
        "good_file_ok": good["ok"],
        "corrupted_file_failed": bad["failed"],
        "corrupted_detected": (not bad["ok"]) and bad["failed"] == 1,
        "ok": good["ok"] and (not bad["ok"]) and bad["failed"] == 1,
    }
