#!/usr/bin/env python3
"""Lines of the product against lines of the tools around it (issue 37, item 5).

    python3 scripts/layout_lines.py          # a Markdown table, from the repository root

The library's sources (src/) are split into:
  * product: what a plain dependency compiles (`shmckpt = "..."`, default features, plus
    `s3`, which is a product feature);
  * unit tests: items under `#[cfg(test)]` (inline `mod tests { .. }` and the files of
    `#[cfg(test)] mod x;`);
  * tools: the directories of the tool modules (src/bench, src/ipc, src/crashsim,
    src/testing) and, elsewhere, the items gated on a tool feature (`bench`, `ipc`,
    `testing`, `crash-record`, `fs-observer`, `fault-injection`): the attribute and the item after it,
    brace-matched (an approximation: a gated statement inside a function counts up to
    its `;`, a gated `mod x;` counts x's file).
The command line (cli/src) is split into its product subcommands and its tools (the
`bench` subcommands and the IPC baseline's writer process). Every other row is whole
directories. "lines" counts every line, "code" those that are neither blank nor `//`
comments. Paths that do not exist are left out, so the script reads the layout before
and after the move.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL_FEATURES = {"bench", "ipc", "testing", "crash-record", "fs-observer", "fault-injection"}
TOOL_DIRS = ["src/bench", "src/ipc", "src/crashsim", "src/testing"]
CLI_TOOLS = ["cli/src/cli/bench", "cli/src/cli/ipc_writer.rs"]


def counts(lines: list[str]) -> tuple[int, int]:
    code = sum(1 for s in lines if s.strip() and not s.strip().startswith("//"))
    return len(lines), code


def files_under(rel: str, exts: tuple[str, ...]) -> list[Path]:
    p = ROOT / rel
    if p.is_file():
        return [p] if p.name.endswith(exts) else []
    if not p.is_dir():
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = [d for d in dirnames if d not in ("target", "__pycache__", ".venv")]
        out += [Path(dirpath) / f for f in filenames if f.endswith(exts)]
    return sorted(out)


def read(p: Path) -> list[str]:
    return p.read_text(encoding="utf-8", errors="replace").splitlines()


CFG = re.compile(r"^\s*#\[cfg\((.*)\)\]\s*$")
MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")
PATH_ATTR = re.compile(r'^\s*#\[path\s*=\s*"([^"]+)"\]')


def gate_kind(cond: str) -> str | None:
    """'test' or 'tools' when the cfg condition turns the item on only for tests or a
    tool feature (a `not(..)` gate keeps a product item: None)."""
    if "not(" in cond:
        return None
    if re.fullmatch(r"\s*test\s*", cond):
        return "test"
    feats = set(re.findall(r'feature\s*=\s*"([^"]+)"', cond))
    if feats and feats <= TOOL_FEATURES | {"s3"} and feats & TOOL_FEATURES:
        # `all(..)` with any tool feature, or `any(..)` of tool features only.
        if cond.strip().startswith("any(") and not feats <= TOOL_FEATURES:
            return None
        return "tools"
    return None


def mod_files(decl_file: Path, name: str, path_attr: str | None) -> list[Path]:
    base = decl_file.parent
    if decl_file.name not in ("mod.rs", "lib.rs", "main.rs"):
        base = base / decl_file.stem
    if path_attr:
        p = (decl_file.parent / path_attr).resolve()
        return [p] if p.is_file() else []
    if (base / f"{name}.rs").is_file():
        f = base / f"{name}.rs"
        sub = base / name
        return [f] + (files_under(str(sub.relative_to(ROOT)), (".rs",)) if sub.is_dir() else [])
    if (base / name / "mod.rs").is_file():
        return files_under(str((base / name).relative_to(ROOT)), (".rs",))
    return []


def item_end(lines: list[str], i: int) -> int:
    """Index one past the item starting at line i (attributes already skipped)."""
    depth = 0
    opened = False
    j = i
    while j < len(lines):
        s = re.sub(r"//.*", "", lines[j])
        s = re.sub(r'"(?:\\.|[^"\\])*"', '""', s)
        depth += s.count("{") - s.count("}")
        if "{" in s:
            opened = True
        if opened and depth <= 0:
            return j + 1
        if not opened and re.search(r"[;,]\s*$", s):
            return j + 1
        j += 1
    return j


def split_library() -> dict[str, list[str]]:
    """{'product'|'test'|'tools-dir'|'tools-gated': lines} over src/."""
    out: dict[str, list[str]] = {"product": [], "test": [], "tools-dir": [], "tools-gated": []}
    all_files = files_under("src", (".rs",))
    tool_dir_files = {f for d in TOOL_DIRS for f in files_under(d, (".rs",))}
    assigned: dict[Path, str] = {f: "tools-dir" for f in tool_dir_files}
    # Files reached through a gated `mod x;` take their gate's kind.
    pending: list[tuple[Path, str]] = []
    regions: dict[Path, list[tuple[int, int, str]]] = {}
    for f in all_files:
        if f in tool_dir_files:
            continue
        lines = read(f)
        i = 0
        while i < len(lines):
            m = CFG.match(lines[i])
            kind = gate_kind(m.group(1)) if m else None
            if not kind:
                i += 1
                continue
            j = i + 1
            path_attr = None
            while j < len(lines) and lines[j].strip().startswith(("#[", "///", "//")):
                pm = PATH_ATTR.match(lines[j])
                if pm:
                    path_attr = pm.group(1)
                j += 1
            if j >= len(lines):
                break
            md = MOD_DECL.match(lines[j])
            if md:
                for mf in mod_files(f, md.group(1), path_attr):
                    pending.append((mf, kind))
                end = j + 1
            else:
                end = item_end(lines, j)
            regions.setdefault(f, []).append((i, end, kind))
            i = end
    for mf, kind in pending:
        if mf not in assigned:
            assigned[mf] = "test" if kind == "test" else "tools-gated"
    for f in all_files:
        lines = read(f)
        if f in assigned:
            out[assigned[f]] += lines
            continue
        marks = ["product"] * len(lines)
        for a, b, kind in regions.get(f, []):
            for k in range(a, min(b, len(lines))):
                marks[k] = "test" if kind == "test" else "tools-gated"
        for s, k in zip(lines, marks):
            out[k].append(s)
    return out


def lines_of(paths: list[str], exts: tuple[str, ...], minus: list[str] = ()) -> list[str]:
    skip = {f for m in minus for f in files_under(m, exts)}
    out: list[str] = []
    for p in paths:
        for f in files_under(p, exts):
            if f not in skip:
                out += read(f)
    return out


def main() -> int:
    rows: list[tuple[str, str, list[str] | None]] = []
    lib = split_library()
    rows.append(("library src/ (Rust)", "product", lib["product"]))
    rows.append(("library src/ (Rust)", "unit tests (#[cfg(test)])", lib["test"]))
    rows.append(("library src/ (Rust)", "tools: " + ", ".join(
        d.removeprefix("src/") for d in TOOL_DIRS if (ROOT / d).exists()) or "tools: (none)",
        lib["tools-dir"]))
    rows.append(("library src/ (Rust)", "tools: items gated on a tool feature", lib["tools-gated"]))
    rows.append(("cli/src (Rust)", "product subcommands", lines_of(["cli/src"], (".rs",), CLI_TOOLS)))
    rows.append(("cli/src (Rust)", "tools: bench subcommands, IPC writer",
                 lines_of(CLI_TOOLS, (".rs",))))
    # The tools' own crates beside the library (crates/*, each on its public API).
    for d in sorted(p for p in (ROOT / "crates").glob("*") if p.is_dir()):
        c = d.relative_to(ROOT).as_posix()
        rows.append((f"{c} (Rust)", "tool crate", lines_of([c], (".rs",))))
    rows.append(("integration tests (Rust)", "tests/", lines_of(["tests"], (".rs",))))
    rows.append(("integration tests (Rust)", "cli/tests/", lines_of(["cli/tests"], (".rs",))))
    rows.append(("benches/", "Rust", lines_of(["benches"], (".rs",))))
    rows.append(("benches/", "Python", lines_of(["benches"], (".py",))))
    rows.append(("benches/", "shell", lines_of(["benches"], (".sh",))))
    rows.append(("benches/", "Markdown (incl. the journal)", lines_of(["benches"], (".md",))))
    rows.append(("docs/", "Markdown", lines_of(["docs"], (".md",))))
    rows.append(("python/shmckpt", "Python (the package)", lines_of(["python/shmckpt"], (".py", ".pyi"))))
    rows.append(("python/src", "Rust (the extension)", lines_of(["python/src"], (".rs",))))
    rows.append(("python/tests", "Python", lines_of(["python/tests"], (".py",))))
    rows.append(("crashfs/", "Rust (test support)", lines_of(["crashfs"], (".rs",))))

    print("| where | what | lines | code |")
    print("|---|---|---:|---:|")
    for where, what, ls in rows:
        n, c = counts(ls or [])
        print(f"| {where} | {what} | {n} | {c} |")
    p_n, p_c = counts(lib["product"])
    t_n, t_c = counts(lib["tools-dir"] + lib["tools-gated"])
    print()
    print(f"library product vs tools (code lines): {p_c} vs {t_c} "
          f"({100 * t_c / max(1, p_c + t_c):.1f}% of the library's non-test code is tools)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
