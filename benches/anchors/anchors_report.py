"""anchors: results table (text and Markdown) and results.json / results.md."""

import json
import os

from peers import log

from anchors_state import GiB, MiB


# ----------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------
def _f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def _gib(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def _idx(lst, i):
    if not isinstance(lst, list) or len(lst) <= i:
        return None
    return lst[i]


def table_rows(results):
    rows = []
    for sname, st in results.get("states", {}).items():
        raw_s = st.get("raw_write", {}).get("median_seconds")
        d2h_s = (st.get("d2h") or {}).get("seconds")
        raw = st.get("raw_write", {})
        rows.append([
            "raw O_DIRECT write (ref)", sname, "-", "-",
            _f((raw.get("before") or {}).get("seconds")), _f((raw.get("after") or {}).get("seconds")),
            "1.00" if raw_s else "-", "-", "-", "-", "-", "-",
            f"median {_f(raw_s)} s = {_f(raw.get('median_gbps'))} GB/s (before, after)",
        ])
        if st.get("d2h"):
            rows.append([
                "pinned D2H copy (ref)", sname, _f(d2h_s, 3), "-", "-", "-", "-", "1.00", "-", "-", "-", "-",
                f"{_f(st['d2h'].get('gbps'))} GB/s; pinned alloc {_f(st['d2h'].get('pinned_alloc_seconds'))} s",
            ])
        for name, r in st.get("systems", {}).items():
            if not r.get("ok"):
                rows.append([name, sname, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", f"FAILED: {(r.get('error') or '')[:160]}"])
                continue
            s1, s2 = _idx(r.get("stall_s"), 0), _idx(r.get("stall_s"), 1)
            d1, d2 = _idx(r.get("durable_s"), 0), _idx(r.get("durable_s"), 1)
            mem = r.get("memory", {})
            if name.startswith("shmckpt"):
                gpu = r.get("gpu_after_reported_by_shmckpt_bytes")
                gpu_s = "-" if gpu is None else f"{gpu / MiB:.0f} MiB (bin)"
            else:
                gd = r.get("gpu_used_delta_after_bytes")
                gpu_s = "-" if gd is None else f"{gd / MiB:+.0f} MiB"
            disk = _idx(r.get("disk_bytes"), 1)
            if disk is None and r.get("disk_bytes_left_after_run"):
                disk = r.get("disk_bytes_left_after_run")
            note = ""
            if name == "dcp" and r.get("return_s"):
                note = "returns in " + ", ".join(_f(x, 3) for x in r["return_s"]) + " s"
            rows.append([
                name, sname, _f(s1, 3), _f(s2, 3), _f(d1), _f(d2),
                _f(d2 / raw_s if (d2 and raw_s) else None),
                _f(s2 / d2h_s if (s2 is not None and d2h_s) else None),
                f"{_gib(mem.get('peak_rss_tree_bytes'))} ({_gib(mem.get('peak_rss_tree_delta_bytes'))})"
                if mem.get("peak_rss_tree_bytes") is not None else "-",
                _gib(mem.get("peak_host_used_delta_bytes")),
                gpu_s, _gib(disk), note,
            ])
    if results.get("interchange"):
        ic = results["interchange"]
        if ic.get("error"):
            txt = f"FAILED: {ic['error'][:160]}"
        else:
            txt = f"{ic.get('passed')}/{ic.get('tensors')} tensors byte-exact" + ("" if ic.get("ok") else " (MISMATCH)")
            if ic.get("failed_only_at_byte0"):
                txt += f"; {ic['failed_only_at_byte0']} differ only in byte 0"
        rows.append(["interchange (shmckpt -> safetensors)", "small", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", txt])
    return rows


HEADER = [
    "system", "state", "stall #1 s", "stall #2 s", "durable #1 s", "durable #2 s",
    "durable#2 / raw write", "stall#2 / D2H", "peak RSS tree GiB (Δ)", "peak host used Δ GiB", "GPU mem after",
    "on disk GiB", "notes",
]


def render_text(rows):
    widths = [len(h) for h in HEADER]
    for row in rows:
        for i, c in enumerate(row[:-1]):
            widths[i] = max(widths[i], len(str(c)))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(HEADER))]
    lines.append("  ".join("-" * widths[i] for i in range(len(HEADER))))
    for row in rows:
        lines.append("  ".join(str(c).ljust(widths[i]) for i, c in enumerate(row)))
    return "\n".join(lines)


def render_md(results, rows):
    m = results.get("meta", {})
    v = m.get("versions", {})
    out = ["# Checkpoint anchors", ""]
    out.append(
        f"Run {m.get('started')} on {m.get('gpu') or 'no GPU'} ({m.get('host')}), ckpt dir `{m.get('ckpt_dir')}` "
        f"({(m.get('ckpt_fs') or {}).get('fstype')}), device `{m.get('device')}`, scale {m.get('scale')}, "
        f"writer threads {m.get('threads')}."
    )
    out.append("")
    out.append(
        "Versions: "
        + ", ".join(f"{k} {v.get(k)}" for k in ("python", "torch", "cuda", "safetensors", "numpy", "nvidia-resiliency-ext", "shmckpt"))
    )
    out.append("")
    out.append("| " + " | ".join(HEADER) + " |")
    out.append("|" + "|".join("---" for _ in HEADER) + "|")
    for row in rows:
        out.append("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |")
    out.append("")
    out.append(
        "Stall = time the trainer is blocked until it may mutate the weights again (DCP: until staging completes). "
        "Durable = until the data is fsynced (torch / nvrx: plus our os.fsync of the file). #1 = first save "
        "(includes process start-up, allocation, pinning), #2 = second save of the same tensors modified in place. "
        "Ratios use save #2 and the median raw O_DIRECT write / median pinned D2H of the same bytes. "
        "Peak RSS tree sums RSS over the process tree (shared pages counted once per process; in parentheses the "
        "rise over the tree's RSS just before the system started); peak host used Δ is the rise of MemTotal-MemAvailable (counts shared memory and pinned pages once). GPU mem after = change of "
        "device-wide used memory after the last finalize (shmckpt: the binary's gpu_mem_used_after_bytes)."
    )
    states = results.get("states", {})
    if states:
        out += ["", "States: " + "; ".join(
            f"{s}: {st.get('tensors')} tensors, {st.get('bytes', 0) / GiB:.3f} GiB ({', '.join(st.get('dtypes', []))})"
            for s, st in states.items()) + "."]
    notes, seen = [], set()
    for sname, st in states.items():
        for name, r in st.get("systems", {}).items():
            for n in r.get("notes") or []:
                if (name, n) not in seen:
                    seen.add((name, n))
                    notes.append(f"- **{name}**: {n}")
            if r.get("error"):
                notes.append(f"- **{name} / {sname} FAILED**: `{r['error'][:400]}`")
            if r.get("verify") is not None:
                notes.append(f"- **{name} / {sname}** content check of the last save: {'ok' if r['verify'].get('ok') else r['verify']}")
    if notes:
        out += ["", "Notes:", ""] + notes
    nv = m.get("nvrx_empty_cache_refs")
    out += ["", f"`torch.cuda.empty_cache` in the installed NVRx package: {nv if nv else 'no occurrence'}"]
    return "\n".join(out) + "\n"


def write_results(ctx, results):
    try:
        p = os.path.join(ctx.out_dir, "results.json")
        with open(p + ".tmp", "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(p + ".tmp", p)
        rows = table_rows(results)
        with open(os.path.join(ctx.out_dir, "results.md"), "w") as f:
            f.write(render_md(results, rows))
    except Exception as e:
        log(f"writing results failed: {e!r}")
