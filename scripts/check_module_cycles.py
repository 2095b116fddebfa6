#!/usr/bin/env python3
"""Fail when the Rust sources or the Python package have an import circle between files.

    scripts/check_module_cycles.py [CRATE_SRC_DIR ...]   # default: src cli/src python/src python/shmckpt
    scripts/check_module_cycles.py --self-test           # the check on a made-up crate
    scripts/check_module_cycles.py --with-module-tree    # also parent <-> child edges
    scripts/check_module_cycles.py --doc[-check]         # docs/design.md's module uses

A file *imports* another when one of its paths (`use` declarations and qualified paths in
code, starting with `crate::`, `super::` or `self::`) names an item defined in the other
file. A path that names a re-export (`use`, private or `pub`) is followed to the file that
defines the item, so `super::lock` in `engine/handle.rs` imports `util.rs` when
`engine/mod.rs` only has `use crate::util::lock`. A circle is a set of files where each
imports the next and the last imports the first: A -> B -> A, or A -> B -> C -> A.

A `pub use child::Item` in a module file whose code does not name `Item` is the module's
face, not an import. References between a module file and its own submodules
(`engine/mod.rs` and `engine/state.rs`) are counted only with `--with-module-tree`; paths
through other crates never are. Python (a directory with `__init__.py`): see `PyPackage`. Comments, strings and character literals are skipped. Exits
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
        decls = list(re.finditer(r"(\bpub\s*(?:\([^)]*\)\s*)?)?\buse\s+([^;]+);", code))
        for m in decls:
            use_spans.append((m.start(), m.end()))
        outside = code
        for s, e in reversed(use_spans):
            outside = outside[:s] + " " * (e - s) + outside[e:]
        for m in decls:
            reexport = m.group(1) is not None
            here = module_at(m.start())
            for segs in split_use_tree(m.group(2)):
                if segs and segs[-1] == "*":
                    segs = segs[:-1]
                    glob = True
                else:
                    glob = False
                absolute = self.absolute(here, segs)
                if absolute is None:
                    continue
                name = None
                if not glob and absolute:
                    # the name the declaration brings into scope
                    alias = re.search(r"\b" + re.escape(segs[-1]) + r"\s+as\s+(" + IDENT + ")", m.group(2))
                    name = alias.group(1) if alias else absolute[-1]
                    if here == file_mod:
                        uses[name] = absolute
                # A module's face: `pub use child::Item` in a module file only hands on a
                # name of its own submodule (paths through it are followed to the file that
                # defines the item). It is an import only where this file's code names the
                # item too. Re-exports of other modules are imports.
                if (
                    reexport
                    and name is not None
                    and tuple(absolute[: len(file_mod) + 1]) in self.mods
                    and len(absolute) > len(file_mod)
                    and tuple(absolute[: len(file_mod)]) == file_mod
                    and not re.search(r"\b" + re.escape(name) + r"\b", outside)
                ):
                    continue
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
                out[m].setdefault(target, line)
        return out


class PyPackage:
    """The import edges between the modules of a Python package directory `pkg`.

    Every `import` and `from ... import` counts wherever it stands (module level, inside a
    function, under `if TYPE_CHECKING:`): `from .x import y` imports `x` (or `x.y` when
    that is a submodule), `from . import x` imports the submodule `x` or else the package's
    `__init__.py`, and a name a package's `__init__.py` only re-exports (`from .m import
    y`) is followed to `m`."""

    def __init__(self, pkg: Path):
        import ast

        self.src = pkg
        self.name = pkg.name
        self.mods: dict[tuple[str, ...], Path] = {}
        for f in sorted(pkg.rglob("*.py")):
            rel = f.relative_to(pkg).with_suffix("").parts
            self.mods[rel[:-1] if rel[-1] == "__init__" else rel] = f
        # A compiled extension module (`_shmckpt`) is known by its stub; it imports nothing
        # of the package.
        for f in sorted(pkg.rglob("*.pyi")):
            rel = f.relative_to(pkg).with_suffix("").parts
            self.mods.setdefault(rel[:-1] if rel[-1] == "__init__" else rel, f)
        # module -> [(line, imported module, names imported from it)]
        self.imports: dict[tuple[str, ...], list[tuple[int, tuple[str, ...], list[str]]]] = {}
        for m, f in self.mods.items():
            is_pkg = f.name == "__init__.py"
            out: list[tuple[int, tuple[str, ...], list[str]]] = []
            if f.suffix == ".pyi":
                self.imports[m] = out
                continue
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        parts = a.name.split(".")
                        if parts[0] == self.name:
                            out.append((node.lineno, self.longest(tuple(parts[1:])), []))
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = list(m if is_pkg else m[:-1])
                        if node.level - 1 > len(base):
                            continue
                        base = base[: len(base) - (node.level - 1)]
                    elif node.module and node.module.split(".")[0] == self.name:
                        base = []
                        node_mod = node.module.split(".")[1:]
                        target = tuple(base + node_mod)
                        self.add_from(out, node.lineno, target, [a.name for a in node.names])
                        continue
                    else:
                        continue
                    target = tuple(base + (node.module.split(".") if node.module else []))
                    self.add_from(out, node.lineno, target, [a.name for a in node.names])
            self.imports[m] = out

    def longest(self, parts: tuple[str, ...]) -> tuple[str, ...]:
        while parts and parts not in self.mods:
            parts = parts[:-1]
        return parts

    def add_from(self, out: list, line: int, target: tuple[str, ...], names: list[str]) -> None:
        target = self.longest(target)
        rest: list[str] = []
        for n in names:
            if target + (n,) in self.mods:
                out.append((line, target + (n,), []))
            else:
                rest.append(n)
        if rest:
            out.append((line, target, rest))

    def defining_module(self, mod: tuple[str, ...], name: str, depth: int = 0) -> tuple[str, ...]:
        """The module that defines `name`, which `mod` may only re-export."""
        if depth < 16 and self.mods[mod].name == "__init__.py":
            for _, t, names in self.imports.get(mod, []):
                if name in names and t != mod:
                    return self.defining_module(t, name, depth + 1)
        return mod

    def edges(self) -> dict[tuple[str, ...], dict[tuple[str, ...], int]]:
        out: dict[tuple[str, ...], dict[tuple[str, ...], int]] = {m: {} for m in self.mods}
        for m, imps in self.imports.items():
            for line, t, names in imps:
                targets = {self.defining_module(t, n) for n in names} if names else {t}
                for target in targets:
                    if target != m:
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


def drop_module_tree(
    edges: dict[tuple[str, ...], dict[tuple[str, ...], int]],
) -> dict[tuple[str, ...], dict[tuple[str, ...], int]]:
    """`edges` without those between a module and its own submodules (either way)."""
    return {
        m: {t: line for t, line in ts.items() if t[: len(m)] != m and m[: len(t)] != t}
        for m, ts in edges.items()
    }


def self_test() -> None:
    """The check finds a circle of three files through a re-export, a parent<->child
    circle only with the module tree counted (and none through a module's face, `pub use
    child::Item`), and Python circles through relative
    imports, `TYPE_CHECKING` and function-level imports and re-exports of `__init__.py`."""
    import tempfile

    files = {
        "lib.rs": "mod a;\nmod b;\nmod c;\nmod util;\nmod e;\nmod p;\n",
        "a.rs": "use crate::b::X; // crate::c::Z in a comment\npub struct A;\n",
        "b.rs": 'pub struct X;\nfn f() { let _ = "crate::a::A"; super::c::y(); }\n',
        "c.rs": "pub use crate::a::A as Renamed;\npub fn y() {}\n",
        "util.rs": "pub fn lock() {}\n",
        "e/mod.rs": "mod f;\nuse crate::util::lock;\npub use f::F;\nfn g() { lock(); }\n",
        "e/f.rs": "pub struct F;\nfn h() { super::lock(); }\n",
        # a parent that uses its child's item, whose child uses the parent's
        "p/mod.rs": "mod q;\nmod r;\nuse q::Q;\npub use r::R;\npub struct P;\nfn k(_: Q) {}\n",
        # a child that uses its parent, whose parent only re-exports it: no circle
        "p/r.rs": "use super::P;\npub struct R(P);\n",
        "p/q.rs": "use super::P;\npub struct Q(P);\n",
    }
    pyfiles = {
        "pkg/__init__.py": "from ._a import A\nfrom .sub import S\n",
        "pkg/_a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import B\nclass A: ...\n",
        "pkg/_b.py": "def f():\n    from pkg import A\n    return A\nclass B: ...\n",
        "pkg/_c.py": "import pkg._a\nfrom . import _ext\n",
        "pkg/_ext.pyi": "from pkg import A\n",
        "pkg/sub/__init__.py": "from .s import S\n",
        "pkg/sub/s.py": "from .. import _c\nfrom . import t\nclass S: ...\n",
        "pkg/sub/t.py": "from pkg.sub import S\n",
    }
    with tempfile.TemporaryDirectory() as d:
        for name, text in {**files, **pyfiles}.items():
            (Path(d) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / name).write_text(text)
        crate = Crate(Path(d))
        edges = crate.edges()
        found = [[str(crate.mods[m].relative_to(d)) for m in comp] for comp in cycles(edges)]
        assert found == [["a.rs", "b.rs", "c.rs"], ["p/mod.rs", "p/q.rs"]], found
        found = [[crate.mods[m].name for m in comp] for comp in cycles(drop_module_tree(edges))]
        assert found == [["a.rs", "b.rs", "c.rs"]], found
        assert edges[("e", "f")] == {("util",): 2}, edges[("e", "f")]
        assert edges[("p",)] == {("p", "q"): 3}, edges[("p",)]
        pkg = PyPackage(Path(d) / "pkg")
        pe = pkg.edges()
        # `from pkg import A` in _b.py is followed through __init__.py to _a.py
        assert pe[("_b",)] == {("_a",): 2}, pe[("_b",)]
        assert pe[("_a",)] == {("_b",): 3}, pe[("_a",)]
        assert pe[("_c",)] == {("_a",): 1, ("_ext",): 2}, pe[("_c",)]
        assert pe[("_ext",)] == {}, pe[("_ext",)]
        assert pe[("sub", "s")] == {("_c",): 1, ("sub", "t"): 2}, pe[("sub", "s")]
        assert pe[("sub", "t")] == {("sub", "s"): 1}, pe[("sub", "t")]
        found = [["/".join(m) for m in comp] for comp in cycles(pe)]
        assert found == [["_a", "_b"], ["sub/s", "sub/t"]], found
    print("self-test passed")


DEPS_START = "<!-- module-deps:start -->"
DEPS_END = "<!-- module-deps:end -->"


def deps_section(root: Path) -> str:
    """The library's modules (top level of src/), each with the modules its files import."""
    crate = Crate(root / "src")
    agg: dict[str, set[str]] = {}
    for m, targets in crate.edges().items():
        a = m[0] if m else "lib.rs"
        agg.setdefault(a, set())
        for t in targets:
            b = t[0] if t else "lib.rs"
            if b != a:
                agg[a].add(b)
    out = [DEPS_START, "<!-- generated by scripts/check_module_cycles.py --doc; CI checks it -->", ""]
    for a in sorted(agg):
        used = ", ".join(f"`{b}`" for b in sorted(agg[a])) or "nothing of the crate"
        if a == "lib.rs" and not agg[a]:
            used = "nothing of the crate (it declares the modules and re-exports their items)"
        out.append(f"- `{a}` uses {used}")
    out.append(DEPS_END)
    return "\n".join(out)


def doc(root: Path, check: bool) -> int:
    path = root / "docs" / "design.md"
    text = path.read_text()
    if text.count(DEPS_START) != 1 or text.count(DEPS_END) != 1:
        print(f"{path}: needs one {DEPS_START} ... {DEPS_END} section")
        return 1
    a, b = text.index(DEPS_START), text.index(DEPS_END) + len(DEPS_END)
    new = text[:a] + deps_section(root) + text[b:]
    if check:
        if new != text:
            print(f"{path}: the module dependencies are out of date; run {Path(__file__).name} --doc")
            return 1
        print("module dependencies in docs/design.md up to date")
        return 0
    path.write_text(new)
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--self-test"]:
        self_test()
        return 0
    if argv in (["--doc"], ["--doc-check"]):
        return doc(Path(__file__).resolve().parent.parent, argv == ["--doc-check"])
    # The module tree (a file and its own submodules) is left out unless asked for:
    # `--with-module-tree` also counts a parent that uses its child's items and a child
    # that uses its parent's. (Issue 37 wants it on; the circles it still finds are listed by
    # this flag.)
    tree = "--with-module-tree" in argv
    argv = [a for a in argv if a != "--with-module-tree"]
    root = Path(__file__).resolve().parent.parent
    dirs = [Path(a) for a in argv] or [
        root / "src",
        root / "cli" / "src",
        root / "python" / "src",
        root / "python" / "shmckpt",
    ]
    bad = 0
    for d in dirs:
        if not d.is_dir():
            continue
        unit: Crate | PyPackage = PyPackage(d) if (d / "__init__.py").is_file() else Crate(d)
        edges = unit.edges() if tree else drop_module_tree(unit.edges())
        for comp in cycles(edges):
            bad += 1
            members = set(comp)
            print(f"import circle in {d}:")
            for m in comp:
                for t, line in sorted(edges[m].items()):
                    if t in members:
                        print(f"  {unit.mods[m].relative_to(d)}:{line} imports {unit.mods[t].relative_to(d)}")
    if bad:
        print(f"{bad} import circle(s): move what both sides need into a module that imports neither")
        return 1
    print("no import circles in " + ", ".join(str(d) for d in dirs if d.is_dir()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
