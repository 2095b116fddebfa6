#!/usr/bin/env python3
"""Fail when the Rust sources or the Python package have an import circle between modules.

    scripts/check_module_cycles.py [SRC_DIR ...]   # default: src cli/src python/src python/shmckpt crates/*/src
    scripts/check_module_cycles.py --self-test     # the check on a made-up crate and package
    scripts/check_module_cycles.py --doc           # rewrite docs/design.md's module uses
    scripts/check_module_cycles.py --doc-check     # exit 1 when they are out of date
    scripts/check_module_cycles.py --graph         # print them

A circle is a set of modules where each imports the next and the last imports the first:
A -> B -> A, or A -> B -> C -> A. It is printed with the lines that close it (exit 1).
The same holds one level up, for the picture docs/design.md draws: top-level modules (a
folder with its files, `engine/`; the root file with the inline modules written in it)
must not use each other both ways either, through whichever of their modules (their
test modules left out: a module's tests may drive what uses it).

Rust (a crate's source directory). The modules are the files and the inline `mod x { }`
in them (a `#[cfg(test)] mod tests { }` is a module of its own: what its tests import is
counted, as its edges; nothing imports a test module, so it never closes a circle through
the code it tests). A module *imports* another when one of its paths names an item the
other defines: `use` declarations, and paths in code that start with `crate::`, `super::`,
`self::`, a submodule's name (`state::SaveState` in `engine/mod.rs`) or a name a `use`
brought in (`commit::retire` after `use crate::commit;`). A path that names a re-export
(`use`, private or `pub`) is followed to the module that defines the item, so
`super::lock` in `engine/handle.rs` imports `util.rs` when `engine/mod.rs` only has
`use crate::util::lock`. Comments, strings and character literals are skipped; paths
through other crates are not imports.

Parent and child modules (a file and its own submodules) are counted like any other pair,
with one rule for the two ways a module tree is written in Rust:

- A module's face is not an import: `use child::Item` (`pub` or not) in a module whose own
  code never names `Item` only hands the name on, to the module's users or to its other
  submodules (`super::Item`, followed to `child`).
- A module's use of a *type* one of its ancestors defines (a `struct`, `enum`, `union`,
  `trait` or `type` in the ancestor's own code, with its associated items and variants:
  `super::Engine`, `impl super::IoBackend for ...`, `super::Sweep::Gc`) is not counted: a
  child is where the parts of its parent's types live (their `impl` blocks in files of
  their own, the types their fields hold). Everything else a child takes from an ancestor
  is counted: its functions, constants, statics, and its re-exports of other modules
  (followed to them). So a parent that calls into its child while the child calls the
  parent's functions is a circle; what both need goes down into a leaf module
  (`commit/store.rs` holds the commit entry points it implements, `cli/bench/common.rs`
  the bench's helpers, `python/src/convert.rs` the extension's shared checks).

Python (a directory with `__init__.py`): the modules are the `.py` files and the compiled
module's stub (`.pyi`, which imports nothing of the package). Every `import` and
`from ... import` counts wherever it stands: at module level, under `if TYPE_CHECKING:`,
and inside a function or method (a local import is still a dependency: it runs whenever
the function does, and a circle through it is only deferred, not gone). `from .x import
y` imports `x` (or `x.y` when that is a submodule), `from . import x` imports the
submodule `x` or else the package's `__init__.py`, absolute imports of the package
(`import shmckpt.x`, `from shmckpt import y`) likewise, and a name a package's
`__init__.py` only re-exports (`from .m import y`) is followed to `m`. A package and its
modules are counted like any other pair: no type rule here (importing a package runs
its `__init__.py` first, whatever is imported from it).

`--doc` writes the module uses by top-level module (the library's and the Python
package's) between `<!-- module-deps:start -->` and `<!-- module-deps:end -->` in
docs/design.md; `--doc-check` (CI) fails when that section differs from the sources.
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
    tree = re.sub(r"\s+", " ", tree).strip()
    tree = re.sub(r"\s*(::|[{},])\s*", r"\1", tree)
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
                p = re.sub(r" as " + IDENT + "$", "", p)  # `x as y`: the path is `x`
                segs = [x for x in p.split("::") if x]
                if segs and segs[-1] == "self":
                    segs = segs[:-1]
                out.append(prefix + segs)

    walk([], tree)
    return out


def is_test_cfg(head: str) -> bool:
    """Whether the attributes at the end of `head` (the code just before a `mod` item)
    compile it for tests only: a `#[cfg(...)]` naming `test`, not `not(test)`."""
    attrs = re.search(r"((?:#\[[^\]]*\]\s*)*)$", head).group(1)
    return any(
        re.search(r"\btest\b", c) and "not(test" not in c
        for c in re.findall(r"#\[cfg\((.*?)\)\]", attrs)
    )


def path_attributes(mods: dict[tuple[str, ...], Path]) -> dict[tuple[str, ...], Path]:
    """`mods` with files declared `#[path = "x.rs"] mod name;` under their module path
    (`restore/ranged_tests.rs` is `restore::ranged::tests`)."""
    by_file = {f.resolve(): m for m, f in mods.items()}
    out = dict(mods)
    for m, f in mods.items():
        for d in re.finditer(r'#\[path\s*=\s*"([^"]+)"\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(' + IDENT + r")\s*;", f.read_text()):
            target = (f.parent / d.group(1)).resolve()
            if target in by_file:
                out[m + (d.group(2),)] = out.pop(by_file[target])
    return out


class Crate:
    """A crate's modules and the paths each writes.

    The unit is the module: every file, and every inline `mod name { ... }` in a file
    (`mods` maps both to their file; `inline` holds the inline ones). Test modules
    (`#[cfg(test)] mod x;` or `mod x { }`, and everything under them) are in `tests`."""

    def __init__(self, src: Path):
        self.src = src
        self.mods = path_attributes(module_files(src))
        self.files = dict(self.mods)
        self.inline: dict[tuple[str, ...], int] = {}  # inline module -> line in its file
        self.tests: set[tuple[str, ...]] = set()
        self.code = {m: strip_code(f.read_text()) for m, f in self.files.items()}
        for m, code in self.code.items():
            spans = self.spans(code)
            for s, e, path in spans:
                self.mods.setdefault(m + path, self.files[m])
                self.inline[m + path] = code.count("\n", 0, s) + 1
            for d in re.finditer(r"\bmod\s+(" + IDENT + r")\s*[;{]", code):
                outer = max((p for s, e, p in spans if s < d.start() < e), key=len, default=())
                head = code[max(0, d.start() - 300): d.start()]
                head = re.sub(r"\bpub\s*(\([^)]*\))?\s*$", "", head.rstrip()).rstrip()
                if is_test_cfg(head):
                    self.tests.add(m + outer + (d.group(1),))
        self.tests = {m for m in self.mods if any(m[:k] in self.tests for k in range(1, len(m) + 1))}
        # module -> {name: absolute path segments} from its `use` declarations
        self.uses: dict[tuple[str, ...], dict[str, list[str]]] = {m: {} for m in self.mods}
        # module -> [(line, absolute path segments)] of every path it writes
        self.refs: dict[tuple[str, ...], list[tuple[int, list[str]]]] = {m: [] for m in self.mods}
        # module -> the types (struct, enum, union, trait, type alias) its own code defines
        self.types: dict[tuple[str, ...], set[str]] = {m: set() for m in self.mods}
        for m, code in self.code.items():
            self.scan(m, code)

    def label(self, m: tuple[str, ...]) -> str:
        """`engine/mod.rs`, or `restore/reader.rs (mod tests)` for an inline module."""
        f = str(self.mods[m].relative_to(self.src))
        if m in self.inline:
            f += " (mod " + "::".join(m[len(self.file_of(m)):]) + ")"
        return f

    def file_of(self, m: tuple[str, ...]) -> tuple[str, ...]:
        """The module of the file that holds `m`."""
        while m not in self.files:
            m = m[:-1]
        return m

    @staticmethod
    def spans(code: str) -> list[tuple[int, int, tuple[str, ...]]]:
        """Inline modules of a file's `code`: (start, end, path inside the file)."""
        raw: list[tuple[int, int, str]] = []
        for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{", code):
            depth, j = 1, m.end()
            while j < len(code) and depth:
                depth += code[j] == "{"
                depth -= code[j] == "}"
                j += 1
            raw.append((m.start(), j, m.group(1)))
        out = []
        for s, e, name in raw:
            outer = tuple(n for s2, e2, n in raw if s2 < s and e <= e2)
            out.append((s, e, outer + (name,)))
        return out

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
        spans = [(s, e, file_mod + p) for s, e, p in self.spans(code)]

        def module_at(pos: int) -> tuple[str, ...]:
            best = file_mod
            for s, e, path in spans:
                if s <= pos < e and len(path) > len(best):
                    best = path
            return best

        def line_of(pos: int) -> int:
            return code.count("\n", 0, pos) + 1

        use_spans: list[tuple[int, int]] = []
        decls = list(re.finditer(r"(\bpub\s*(?:\([^)]*\)\s*)?)?\buse\s+([^;]+);", code))
        for m in decls:
            use_spans.append((m.start(), m.end()))
        outside = code
        for s, e in reversed(use_spans):
            outside = outside[:s] + " " * (e - s) + outside[e:]

        def own_code(mod: tuple[str, ...]) -> str:
            """The code of module `mod` alone (its inline submodules blanked), no `use`s."""
            lo, hi = 0, len(outside)
            for s, e, path in spans:
                if path == mod:
                    lo, hi = s, e
            text = outside[lo:hi]
            for s, e, path in spans:
                if path != mod and lo <= s and e <= hi:
                    text = text[: s - lo] + " " * (e - s) + text[e - lo:]
            return text

        own: dict[tuple[str, ...], str] = {}
        for _, _, mod in [(0, 0, file_mod)] + spans:
            own[mod] = own_code(mod)
            self.types[mod] = set(re.findall(r"\b(?:struct|enum|union|trait|type)\s+(" + IDENT + ")", own[mod]))
        for m in decls:
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
                    self.uses[here][name] = absolute
                # A module's face: `use child::Item` (`pub` or not) in a module only hands
                # on a name of its own submodule, to its users or to its other submodules
                # (`super::Item`; paths through it are followed to the file that defines
                # the item). It is an import only where the module's own code names the
                # item too. Re-exports of other modules are imports.
                if name is not None and len(absolute) > len(here) and tuple(absolute[: len(here)]) == here:
                    if tuple(absolute[: len(here) + 1]) in self.mods:
                        if not re.search(r"\b" + re.escape(name) + r"\b", own[here]):
                            continue
                self.refs[here].append((line_of(m.start()), absolute))
        for m in re.finditer(r"(?<![A-Za-z0-9_:$])((?:crate|super|self)(?:\s*::\s*" + IDENT + r")+)", code):
            if any(s <= m.start() < e for s, e in use_spans):
                continue
            segs = [x.strip() for x in m.group(1).split("::")]
            here = module_at(m.start())
            absolute = self.absolute(here, segs)
            if absolute is not None:
                self.refs[here].append((line_of(m.start()), absolute))
        # Paths in code that start at a name: a submodule of the module (`state::SaveState`
        # in `engine/mod.rs`) or a name its `use` declarations bring in (`commit::retire`
        # after `use crate::commit;`).
        for m in re.finditer(r"(?<![A-Za-z0-9_:$])(" + IDENT + r")((?:\s*::\s*" + IDENT + r")+)", outside):
            if m.group(1) in KEYWORDS:
                continue
            here = module_at(m.start())
            rest = [x.strip() for x in m.group(2).split("::") if x.strip()]
            if here + (m.group(1),) in self.mods:
                absolute = list(here) + [m.group(1)] + rest
            elif m.group(1) in self.uses[here]:
                absolute = self.uses[here][m.group(1)] + rest
            else:
                continue
            self.refs[here].append((line_of(m.start()), absolute))

    def resolve(self, segs: list[str], depth: int = 0) -> tuple[tuple[str, ...], str | None]:
        """The module whose file defines what the absolute path `segs` names, and the
        name it has there (`None` when the path names a module itself)."""
        mod: tuple[str, ...] = ()
        i = 0
        while i < len(segs) and mod + (segs[i],) in self.mods:
            mod += (segs[i],)
            i += 1
        if i == len(segs):
            return mod, None
        name = segs[i]
        target = self.uses.get(mod, {}).get(name)
        if target is not None and depth < 16:
            return self.resolve(target + segs[i + 1:], depth + 1)
        return mod, name

    def defining_module(self, segs: list[str]) -> tuple[str, ...]:
        """The module whose file defines what the absolute path `segs` names."""
        return self.resolve(segs)[0]

    def edges(self) -> dict[tuple[str, ...], dict[tuple[str, ...], int]]:
        """Importing module -> {imported module: first line}. A module's use of a type
        one of its ancestors defines is left out (see the script's doc)."""
        out: dict[tuple[str, ...], dict[tuple[str, ...], int]] = {m: {} for m in self.mods}
        for m, refs in self.refs.items():
            for line, segs in refs:
                target, name = self.resolve(segs)
                if target == m:
                    continue
                if name is not None and m[: len(target)] == target and name in self.types[target]:
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

    def label(self, m: tuple[str, ...]) -> str:
        return str(self.mods[m].relative_to(self.src))

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


def self_test() -> None:
    """The check on a made-up crate and package: a circle of three files through a
    re-export; a parent and a child that call each other's functions (a circle), a child
    that only uses its parent's type (none), a parent that only hands on its child's item
    (none); a test module, its own node, importing what imports its file (none); names
    with `as` inside; Python circles through relative imports, `TYPE_CHECKING`,
    function-local imports, re-exports of `__init__.py` and between a package and its
    module."""
    import tempfile

    files = {
        "lib.rs": "mod a;\nmod b;\nmod c;\nmod util;\nmod e;\nmod p;\nmod t;\nmod u;\nmod x;\nmod y;\n",
        # folders that use each other through different files: no circle of modules, one
        # of top-level modules
        "x/mod.rs": "mod xa;\nmod xb;\n",
        "x/xa.rs": "pub struct XA(crate::y::Y);\n",
        "x/xb.rs": "pub struct XB;\n",
        "y.rs": "pub struct Y(crate::x::xb::XB);\n",
        "a.rs": "use crate::b::X; // crate::c::Z in a comment\npub struct A;\n",
        "b.rs": 'pub struct X;\nfn f() { let _ = "crate::a::A"; super::c::y(); }\n',
        "c.rs": "pub use crate::a::A as Renamed;\npub fn y() {}\n",
        "util.rs": "pub fn lock() {}\npub fn has_assets() {}\n",
        "e/mod.rs": "mod f;\nuse crate::util::lock;\npub use f::F;\nfn g() { lock(); }\n",
        "e/f.rs": "pub struct F;\nfn h() { super::lock(); }\n",
        # a parent calling its child's function (a path in code, no `use`), the child
        # calling the parent's: a circle
        "p/mod.rs": "mod q;\nmod r;\nmod s;\nuse s::S;\npub struct P;\npub fn pf() {}\n"
        "fn k() { q::helper(); let _ = r::R(P); }\n",
        "p/q.rs": "pub fn helper() { super::pf(); }\n",
        # a child that uses only its parent's type: no circle
        "p/r.rs": "use super::P;\npub struct R(pub P);\n",
        # a child whose item the parent only hands on (`use s::S` it never names): no circle
        "p/s.rs": "pub struct S;\nfn m() { super::pf(); }\n",
        # a test module importing what imports its file: no circle
        "t.rs": "pub struct T;\n#[cfg(test)]\nmod tests {\n    use crate::u::U;\n}\n",
        "u.rs": "use crate::util::{lock as l, has_assets};\npub struct U(crate::t::T);\n",
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
        # a package and its module importing each other (in a function: still counted)
        "pkg/sub2/__init__.py": "from .m import M\nHELPER = 1\n",
        "pkg/sub2/m.py": "def f():\n    from . import HELPER\n    return HELPER\nclass M: ...\n",
    }
    with tempfile.TemporaryDirectory() as d:
        for name, text in {**files, **pyfiles}.items():
            (Path(d) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / name).write_text(text)
        crate = Crate(Path(d))
        edges = crate.edges()
        found = [[crate.label(m) for m in comp] for comp in cycles(edges)]
        assert found == [["a.rs", "b.rs", "c.rs"], ["p/mod.rs", "p/q.rs"]], found
        assert edges[("e", "f")] == {("util",): 2}, edges[("e", "f")]
        assert edges[("p",)] == {("p", "q"): 7, ("p", "r"): 7}, edges[("p",)]
        assert edges[("p", "r")] == {}, edges[("p", "r")]
        assert edges[("p", "s")] == {("p",): 2}, edges[("p", "s")]
        assert crate.tests == {("t", "tests")}, crate.tests
        assert crate.label(("t", "tests")) == "t.rs (mod tests)", crate.label(("t", "tests"))
        assert edges[("t", "tests")] == {("u",): 4}, edges[("t", "tests")]
        assert edges[("t",)] == {}, edges[("t",)]
        assert edges[("u",)] == {("util",): 1, ("t",): 2}, edges[("u",)]
        assert crate.refs[("u",)][:2] == [(1, ["util", "lock"]), (1, ["util", "has_assets"])], crate.refs[("u",)]
        tops = top_level_edges(crate, "lib.rs")
        found = [[a[0] for a in comp] for comp in cycles({a: dict.fromkeys(ts, 0) for a, ts in tops.items()})]
        assert found == [["a", "b", "c"], ["x", "y"]], found
        # a test module's imports are not its top-level module's
        assert ("u",) not in tops[("t",)], tops[("t",)]
        pkg = PyPackage(Path(d) / "pkg")
        pe = pkg.edges()
        # `from pkg import A` in _b.py is followed through __init__.py to _a.py
        assert pe[("_b",)] == {("_a",): 2}, pe[("_b",)]
        assert pe[("_a",)] == {("_b",): 3}, pe[("_a",)]
        assert pe[("_c",)] == {("_a",): 1, ("_ext",): 2}, pe[("_c",)]
        assert pe[("_ext",)] == {}, pe[("_ext",)]
        assert pe[("sub", "s")] == {("_c",): 1, ("sub", "t"): 2}, pe[("sub", "s")]
        assert pe[("sub", "t")] == {("sub", "s"): 1}, pe[("sub", "t")]
        assert pe[("sub2", "m")] == {("sub2",): 2}, pe[("sub2", "m")]
        found = [["/".join(m) for m in comp] for comp in cycles(pe)]
        assert found == [["_a", "_b"], ["sub/s", "sub/t"], ["sub2", "sub2/m"]], found
    print("self-test passed")


DEPS_START = "<!-- module-deps:start -->"
DEPS_END = "<!-- module-deps:end -->"


def top_level(unit: "Crate | PyPackage", m: tuple[str, ...], root_name: str) -> str:
    """The top-level module `m` belongs to (`root_name` for the root file and the inline
    modules written in it, like lib.rs's `cuda` and `flash` faces)."""
    if not m or (isinstance(unit, Crate) and m in unit.inline and unit.file_of(m) == ()):
        return root_name
    return m[0]


def top_level_edges(
    unit: "Crate | PyPackage", root_name: str
) -> dict[tuple[str, ...], dict[tuple[str, ...], tuple[tuple[str, ...], int, tuple[str, ...]]]]:
    """Top-level module -> {top-level module it imports: (a module, line, the module it
    imports)}, tests left out."""
    tests = unit.tests if isinstance(unit, Crate) else set()
    out: dict[tuple[str, ...], dict[tuple[str, ...], tuple[tuple[str, ...], int, tuple[str, ...]]]] = {}
    for m, targets in sorted(unit.edges().items()):
        a = (top_level(unit, m, root_name),)
        out.setdefault(a, {})
        if m in tests:
            continue
        for t, line in sorted(targets.items()):
            b = (top_level(unit, t, root_name),)
            if b != a:
                out[a].setdefault(b, (m, line, t))
    return out


def module_uses(unit: "Crate | PyPackage", root_name: str) -> list[str]:
    """One line per top-level module of `unit`: the top-level modules its modules import,
    then those only its tests import."""
    tests = unit.tests if isinstance(unit, Crate) else set()

    def top(m: tuple[str, ...]) -> str:
        return top_level(unit, m, root_name)

    code: dict[str, set[str]] = {}
    test: dict[str, set[str]] = {}
    for m, targets in unit.edges().items():
        a = top(m)
        code.setdefault(a, set())
        test.setdefault(a, set())
        for t in targets:
            b = top(t)
            if b != a:
                (test if m in tests else code)[a].add(b)
    out = []
    for a in sorted(code):
        nothing = "nothing of the package" if isinstance(unit, PyPackage) else "nothing of the crate"
        line = f"- `{a}` uses " + (", ".join(f"`{b}`" for b in sorted(code[a])) or nothing)
        extra = sorted(test[a] - code[a])
        if extra:
            line += "; its tests also " + ", ".join(f"`{b}`" for b in extra)
        out.append(line)
    return out


def deps_section(root: Path) -> str:
    """The library's and the Python package's module uses, by top-level module."""
    out = [
        DEPS_START,
        "<!-- generated by scripts/check_module_cycles.py --doc; CI checks it with --doc-check -->",
        "",
        "The library (`src/`):",
        "",
        *module_uses(Crate(root / "src"), "lib.rs"),
        "",
        "The Python package (`python/shmckpt/`; `checkpointer` and `dcp` are subpackages):",
        "",
        *module_uses(PyPackage(root / "python" / "shmckpt"), "__init__.py"),
        DEPS_END,
    ]
    return "\n".join(out)


TABLE_START = "<!-- module-table:start -->"
TABLE_END = "<!-- module-table:end -->"


def table_problems(root: Path, text: str) -> list[str]:
    """What docs/design.md's module table (between `<!-- module-table:start -->` and
    `<!-- module-table:end -->`) lacks: a row per top-level module of `src/` (and none
    for a module that is gone), and in a directory module's row every file of it that is
    not a test module (by name: `request.rs` or `request`)."""
    if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1:
        return [f"needs one {TABLE_START} ... {TABLE_END} section"]
    table = text[text.index(TABLE_START): text.index(TABLE_END)]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(" + IDENT + r")`[^\n]*", table, re.M)}
    crate = Crate(root / "src")
    tops = {m[0] for m in crate.files if len(m) == 1}
    problems = [f"module `{m}` has no row" for m in sorted(tops - rows.keys())]
    problems += [f"row `{m}` names no module of src/" for m in sorted(rows.keys() - tops)]
    def names(cell: str, m: tuple[str, ...], f: Path) -> bool:
        stem = f.stem if f.stem != "mod" else f.parent.name
        if f.stem == "mod" and re.search(r"`mod\.rs`", cell):
            return True
        return bool(
            re.search(r"[`/]" + re.escape(stem) + r"(\.rs|/\*?)?`", cell)
            or (len(m) > 2 and re.search(r"`" + re.escape("/".join(m[1:-1])) + r"/\*`", cell))
        )

    for m, f in sorted(crate.files.items()):
        if m in crate.tests or not m or m[0] not in rows:
            continue
        cells = rows[m[0]].split(" | ")
        if len(m) >= 2 and not names(rows[m[0]], m, f):
            problems.append(f"row `{m[0]}` does not name `{f.relative_to(root / 'src')}`")
        # the last column: the files that allow `unsafe` code, or `no`
        unsafe_cell = cells[-1]
        allows = "allow(unsafe_code)" in f.read_text()
        if allows and not names(unsafe_cell, m, f) and not (len(m) == 1 and f"`{f.name}`" in unsafe_cell):
            problems.append(f"row `{m[0]}`: `{f.relative_to(root / 'src')}` allows unsafe code; the unsafe column does not name it")
        if not allows and len(m) >= 2 and f.stem != "mod" and re.search(r"`" + re.escape(f.stem) + r"(\.rs)?`", unsafe_cell):
            problems.append(f"row `{m[0]}`: the unsafe column names `{f.relative_to(root / 'src')}`, which has no unsafe code")
    for m0, row in rows.items():
        any_unsafe = any(
            "allow(unsafe_code)" in f.read_text() for m, f in crate.files.items() if m[:1] == (m0,) and m not in crate.tests
        )
        if any_unsafe == row.split(" | ")[-1].startswith("no"):
            problems.append(f"row `{m0}`: the unsafe column says {'no' if any_unsafe else 'unsafe'}, the sources say otherwise")
    return problems


def doc(root: Path, check: bool) -> int:
    """Write (or with `check`, compare) docs/design.md's module uses; check its module
    table either way."""
    path = root / "docs" / "design.md"
    text = path.read_text()
    if text.count(DEPS_START) != 1 or text.count(DEPS_END) != 1:
        print(f"{path}: needs one {DEPS_START} ... {DEPS_END} section")
        return 1
    a, b = text.index(DEPS_START), text.index(DEPS_END) + len(DEPS_END)
    new = text[:a] + deps_section(root) + text[b:]
    problems = table_problems(root, text)
    for p in problems:
        print(f"{path}: module table: {p}")
    if check:
        if new != text:
            print(f"{path}: the module uses are out of date; run {Path(__file__).name} --doc")
            return 1
        if problems:
            return 1
        print("module table and module uses in docs/design.md up to date")
        return 0
    path.write_text(new)
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if argv == ["--self-test"]:
        self_test()
        return 0
    if argv == ["--graph"]:
        print(deps_section(Path(__file__).resolve().parent.parent))
        return 0
    if argv in (["--doc"], ["--doc-check"]):
        return doc(Path(__file__).resolve().parent.parent, argv == ["--doc-check"])
    root = Path(__file__).resolve().parent.parent
    dirs = [Path(a) for a in argv] or [
        root / "src",
        root / "cli" / "src",
        root / "python" / "src",
        root / "python" / "shmckpt",
        # The tools' crates beside the library (crates/*/src).
        *sorted(root.glob("crates/*/src")),
    ]
    bad = 0
    for d in dirs:
        if not d.is_dir():
            continue
        unit: Crate | PyPackage = PyPackage(d) if (d / "__init__.py").is_file() else Crate(d)
        edges = unit.edges()
        for comp in cycles(edges):
            bad += 1
            members = set(comp)
            print(f"import circle in {d}:")
            for m in comp:
                for t, line in sorted(edges[m].items()):
                    if t in members:
                        print(f"  {unit.label(m)}:{line} imports {unit.label(t)}")
        # The picture docs/design.md draws: top-level modules (folders of modules) must
        # not use each other both ways either, through whichever of their modules.
        root_name = "__init__.py" if isinstance(unit, PyPackage) else "crate root"
        tops = top_level_edges(unit, root_name)
        for comp in cycles({a: dict.fromkeys(ts, 0) for a, ts in tops.items()}):
            bad += 1
            members = set(comp)
            print(f"import circle between top-level modules in {d}:")
            for a in comp:
                for b, (m, line, t) in sorted(tops[a].items()):
                    if b in members:
                        print(f"  {a[0]} -> {b[0]}: {unit.label(m)}:{line} imports {unit.label(t)}")
    if bad:
        print(f"{bad} import circle(s): move what both sides need into a module that imports neither")
        return 1
    print("no import circles in " + ", ".join(str(d) for d in dirs if d.is_dir()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
