#!/usr/bin/env python3
"""Fail when the Rust sources have an import circle between files.

    scripts/check_module_cycles.py [CRATE_SRC_DIR ...]   # default: src cli/src python/src
    scripts/check_module_cycles.py --self-test           # the check on a made-up crate

A file *imports* another when one of its paths (`use` declarations and qualified paths in
code, starting with `crate::`, `super::` or `self::`) names an item defined in the other
file. A path that names a re-export (`use`, private or `pub`) is followed to the file that
defines the item, so `super::lock` in `engine/handle.rs` imports `util.rs` when
`engine/mod.rs` only has `use crate::util::lock`. A circle is a set of files where each
imports the next and the last imports the first: A -> B -> A, or A -> B -> C -> A.

References between a module file and its own submodules (`engine/mod.rs` and
`engine/state.rs`) are the module tree, not imports, and are not counted; neither are
paths through other crates. Comments, strings and character literals are skipped. Exits
1 and prints every circle with the lines that close it; exits 0 when there is none.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
KEYWORDS = {"crate", "super", "self"}


def strip_code(text: str) -> str:
    """`text` with comments, strings and char literals blanked (newlines kept)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif re.match(r'b?r#*"', text[i:i + 12]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'b?r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^'\\\n])'", text[i:])
            if m:  # a char literal; otherwise a lifetime or label
                out.append(" " * m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def module_files(src: Path) -> dict[tuple[str, ...], Path]:
    """Module path -> file, for every `.rs` file under the crate source dir `src`."""
    mods: dict[tuple[str, ...], Path] = {}
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src).with_suffix("").parts
        if rel in (("lib",), ("main",)):
            mods[()] = f
        elif rel[-1] == "mod":
            mods[rel[:-1]] = f
        else:
            mods[rel] = f
    return mods


def split_use_tree(tree: str) -> list[list[str]]:
    """`a::{b, c::{d, e as f}}` -> [[a, b], [a, c, d], [a, c, e]] (renames dropped,
    `self` inside braces kept as the prefix itself)."""
    tree = re.sub(r"\s+", "", tree)
    out: list[list[str]] = []

    def walk(prefix: list[str], s: str) -> None:
        parts: list[str] = []
        depth, cur = 0, ""
        for ch in s:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        parts.append(cur)
        for p in parts:
            if not p:
                continue
            if "{" in p:
                head, rest = p.split("{", 1)
                walk(prefix + [x for x in head.split("::") if x], rest[:-1])
            else:
                segs = [x for x in re.sub(r"as" + IDENT + "$", "", p).split("::") if x]
                if p.endswith(")"):
                    continue
                if " as " in p or re.search(r"\bas\b", p):
                    segs = segs[:-1]
                if segs and segs[-1] == "self":
                    segs = segs[:-1]
                out.append(prefix + segs)

    walk([], tree.replace("asself", "as self"))
    return out


class Crate:
    def __init__(self, src: Path):
        self.src = src
        self.mods = module_files(src)
        self.code = {m: strip_code(f.read_text()) for m, f in self.mods.items()}
        # module -> {name: (absolute path segments, line)} from its `use` declarations
        self.uses: dict[tuple[str, ...], dict[str, list[str]]] = {}
        # module -> [(line, absolute path segments)] of every path it writes
        self.refs: dict[tuple[str, ...], list[tuple[int, list[str]]]] = {}
        for m, code in self.code.items():
            self.scan(m, code)

    def absolute(self, here: tuple[str, ...], segs: list[str]) -> list[str] | None:
        """Segments of a path written in module `here`, made absolute; `None` when it
        does not start at this crate (`std::`, other crates, local names)."""
        if not segs:
            return None
        if segs[0] == "crate":
            return segs[1:]
        if segs[0] in ("super", "self"):
            base = list(here)
            i = 0
            while i < len(segs) and segs[i] in ("super", "self"):
                if segs[i] == "super":
                    if not base:
                        return None
                    base.pop()
                i += 1
            return base + segs[i:]
        if segs[0] == "$crate":
            return None
        # A bare first segment: a submodule of `here` (lib.rs and mod.rs files name their
        # children this way) or a name `use`d in `here`.
        if tuple(here) + (segs[0],) in self.mods:
            return list(here) + segs
        return None

    def scan(self, file_mod: tuple[str, ...], code: str) -> None:
        uses: dict[str, list[str]] = {}
        refs: list[tuple[int, list[str]]] = []
        # Inline modules (`mod tests { ... }`): the module path at each offset.
        spans: list[tuple[int, int, tuple[str, ...]]] = []
        for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{", code):
            depth, j = 1, m.end()
            while j < len(code) and depth:
                depth += code[j] == "{"
                depth -= code[j] == "}"
                j += 1
            spans.append((m.start(), j, (m.group(1),)))

        def module_at(pos: int) -> tuple[str, ...]:
            inner: tuple[str, ...] = ()
            for s, e, name in spans:
                if s <= pos < e:
                    inner = inner + name
            return file_mod + inner

        def line_of(pos: int) -> int:
            return code.count("\n", 0, pos) + 1

        use_spans: list[tuple[int, int]] = []
        for m in re.finditer(r"\buse\s+([^;]+);", code):
            use_spans.append((m.start(), m.end()))
            here = module_at(m.start())
            for segs in split_use_tree(m.group(1)):
                if segs and segs[-1] == "*":
                    segs = segs[:-1]
                    glob = True
                else:
                    glob = False
                absolute = self.absolute(here, segs)
                if absolute is None:
                    continue
                if not glob and here == file_mod and absolute:
                    # the name the declaration brings into scope
                    alias = re.search(r"\b" + re.escape(segs[-1]) + r"\s+as\s+(" + IDENT + ")", m.group(1))
                    uses[alias.group(1) if alias else absolute[-1]] = absolute
                refs.append((line_of(m.start()), absolute))
        for m in re.finditer(r"(?<![A-Za-z0-9_:$])((?:crate|super|self)(?:\s*::\s*" + IDENT + r")+)", code):
            if any(s <= m.start() < e for s, e in use_spans):
                continue
            segs = [x.strip() for x in m.group(1).split("::")]
            absolute = self.absolute(module_at(m.start()), segs)
            if absolute is not None:
                refs.append((line_of(m.start()), absolute))
        self.uses[file_mod] = uses
        self.refs[file_mod] = refs

    def defining_module(self, segs: list[str], depth: int = 0) -> tuple[str, ...] | None:
        """The module whose file defines what the absolute path `segs` names."""
        mod: tuple[str, ...] = ()
        i = 0
        while i < len(segs) and mod + (segs[i],) in self.mods:
            mod += (segs[i],)
            i += 1
        if i == len(segs):
            return mod  # the path names a module file itself
        name = segs[i]
        target = self.uses.get(mod, {}).get(name)
        if target is not None and depth < 16:
            resolved = self.defining_module(target + segs[i + 1:], depth + 1)
            if resolved is not None:
                return resolved
        return mod

    def edges(self) -> dict[tuple[str, ...], dict[tuple[str, ...], int]]:
        """Importing module -> {imported module: first line}."""
        out: dict[tuple[str, ...], dict[tuple[str, ...], int]] = {m: {} for m in self.mods}
        for m, refs in self.refs.items():
            for line, segs in refs:
                target = self.defining_module(segs)
                if target is None or target == m:
                    continue
                # the module tree: a file and its own submodules (either way)
                if target[: len(m)] == m or m[: len(target)] == target:
                    continue
                out[m].setdefault(target, line)
        return out


def cycles(edges: dict[tuple[str, ...], dict[tuple[str, ...], int]]) -> list[list[tuple[str, ...]]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[tuple[str, ...], int] = {}
    low: dict[tuple[str, ...], int] = {}
    stack: list[tuple[str, ...]] = []
    on: set[tuple[str, ...]] = set()
    found: list[list[tuple[str, ...]]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: tuple[str, ...]) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def self_test() -> None:
    """The check finds a circle of three files through a re-export, and none in the
    module tree or through a name a parent only `use`s."""
    import tempfile

    files = {
        "lib.rs": "mod a;\nmod b;\nmod c;\nmod util;\nmod e;\n",
        "a.rs": "use crate::b::X; // crate::c::Z in a comment\npub struct A;\n",
        "b.rs": 'pub struct X;\nfn f() { let _ = "crate::a::A"; super::c::y(); }\n',
        "c.rs": "pub use crate::a::A as Renamed;\npub fn y() {}\n",
        "util.rs": "pub fn lock() {}\n",
        "e/mod.rs": "mod f;\nuse crate::util::lock;\npub use f::F;\nfn g() { lock(); }\n",
        "e/f.rs": "pub struct F;\nfn h() { super::lock(); }\n",
    }
    with tempfile.TemporaryDirectory() as d:
        for name, text in files.items():
            (Path(d) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / name).write_text(text)
        crate = Crate(Path(d))
        edges = crate.edges()
        found = [[crate.mods[m].name for m in comp] for comp in cycles(edges)]
        assert found == [["a.rs", "b.rs", "c.rs"]], found
        assert edges[("e", "f")] == {("util",): 2}, edges[("e", "f")]
    print("self-test passed")


def main(argv: list[str]) -> int:
    if argv == ["--self-test"]:
        self_test()
        return 0
    root = Path(__file__).resolve().parent.parent
    dirs = [Path(a) for a in argv] or [root / "src", root / "cli" / "src", root / "python" / "src"]
    bad = 0
    for d in dirs:
        if not d.is_dir():
            continue
        crate = Crate(d)
        edges = crate.edges()
        for comp in cycles(edges):
            bad += 1
            members = set(comp)
            print(f"import circle in {d}:")
            for m in comp:
                for t, line in sorted(edges[m].items()):
                    if t in members:
                        print(f"  {crate.mods[m].relative_to(d)}:{line} imports {crate.mods[t].relative_to(d)}")
    if bad:
        print(f"{bad} import circle(s): move what both sides need into a module that imports neither")
        return 1
    print("no import circles in " + ", ".join(str(d) for d in dirs if d.is_dir()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
