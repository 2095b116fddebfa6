"""The documentation matches the code.

* docs/python.md's "Signatures" block: every documented signature parses, and its
  parameters (name, kind, default) are those of ``inspect.signature`` of the installed
  package; every public callable of the API is documented there.
* docs/migration.md: every ``shmckpt`` name its snippets use exists, and the torch.save
  migration's resume idiom (RNG state of torch, numpy and ``random``; ``close()``) runs on
  the CPU and resumes bit for bit.

Modules with optional dependencies (``shmckpt.dcp``: torch.distributed.checkpoint,
``shmckpt.lightning``: lightning, ``shmckpt.megatron``: megatron-core) are checked when they
import, else skipped visibly (``SHMCKPT_REQUIRE_MEGATRON=1`` makes a missing megatron-core
a failure, as in test_megatron.py)."""

import ast
import importlib
import inspect
import os
import random
import re
import textwrap
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch

import shmckpt
from conftest import REPO

PYTHON_MD = REPO / "docs" / "python.md"
MIGRATION_MD = REPO / "docs" / "migration.md"
BEGIN = "<!-- signatures: begin (checked by python/tests/test_docs.py) -->"
END = "<!-- signatures: end -->"

#: The public callables each module must document, besides every public method of the
#: classes in CLASSES_WITH_METHODS (found by inspection, so a new method must be added).
REQUIRED = {
    "shmckpt": [
        "shmckpt.Checkpointer",
        "shmckpt.export",
        "shmckpt.Tuning",
        "shmckpt.RemoteTier",
        "shmckpt.Replicas",
        "shmckpt.Cadence",
    ],
    "shmckpt.dcp": ["shmckpt.dcp.ShmckptWriter", "shmckpt.dcp.ShmckptReader", "shmckpt.dcp.prepare", "shmckpt.dcp.release"],
    "shmckpt.lightning": [
        "shmckpt.lightning.ShmckptCheckpointIO",
        "shmckpt.lightning.load_from_checkpoint",
        "shmckpt.lightning.to_torch_file",
    ],
    "shmckpt.megatron": [
        "shmckpt.megatron.ShmckptSaveShardedStrategy",
        "shmckpt.megatron.ShmckptLoadShardedStrategy",
        "shmckpt.megatron.register",
    ],
}
CLASSES_WITH_METHODS = {"shmckpt": ["shmckpt.Checkpointer", "shmckpt.SaveHandle"]}
MODULES = list(REQUIRED)


def import_or_skip(module: str) -> Any:
    if module == "shmckpt.megatron" and os.environ.get("SHMCKPT_REQUIRE_MEGATRON") == "1":
        return importlib.import_module(module)  # a failure, not a skip
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module} does not import here ({e}); its documented signatures are not checked")


def documented() -> Dict[str, str]:
    """{qualified name: "(params)"} from the Signatures block of docs/python.md."""
    text = PYTHON_MD.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "docs/python.md lost its signature markers"
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    m = re.search(r"```python\n(.*?)```", block, re.S)
    assert m, "no ```python block between the signature markers"
    entries: Dict[str, List[str]] = {}
    name = ""
    for line in m.group(1).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():  # a new entry: qualified.name(params
            name, _, rest = line.partition("(")
            assert name not in entries, f"{name} documented twice"
            entries[name] = ["(" + rest]
        else:  # its continuation
            entries[name].append(line)
    return {n: "\n".join(lines) for n, lines in entries.items()}


def parse(name: str, params: str) -> List[Tuple[str, Any, Any]]:
    """[(name, kind, default node or None)] of one documented signature."""
    src = f"def f{params}:\n    pass\n"
    try:
        fn = ast.parse(src).body[0]
    except SyntaxError as e:
        raise AssertionError(f"docs/python.md: the signature of {name} does not parse: {e}") from None
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    P = inspect.Parameter
    out: List[Tuple[str, Any, Any]] = []
    positional = [(x, P.POSITIONAL_ONLY) for x in a.posonlyargs] + [(x, P.POSITIONAL_OR_KEYWORD) for x in a.args]
    defaults: List[Any] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out += [(x.arg, k, d) for (x, k), d in zip(positional, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, P.VAR_POSITIONAL, None))
    out += [(x.arg, P.KEYWORD_ONLY, d) for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, P.VAR_KEYWORD, None))
    return out


def resolve(qualname: str) -> Any:
    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise AssertionError(f"docs/python.md documents {qualname}, which does not exist")


def actual(qualname: str) -> inspect.Signature:
    obj = resolve(qualname)
    sig = inspect.signature(obj)
    owner = qualname.rsplit(".", 1)[0]
    if inspect.isfunction(obj) and inspect.isclass(resolve(owner)):
        # A method read off its class: drop ``self``.
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def render(qualname: str, sig: inspect.Signature) -> str:
    """What the documented line should be: the signature without annotations."""
    e = inspect.Parameter.empty
    bare = sig.replace(parameters=[p.replace(annotation=e) for p in sig.parameters.values()], return_annotation=e)
    return f"{qualname}{bare}"


def module_of(qualname: str) -> str:
    return max((m for m in MODULES if qualname == m or qualname.startswith(m + ".")), key=len)


def public_methods(qualname: str) -> List[str]:
    cls = resolve(qualname)
    names = []
    for n in dir(cls):
        if n.startswith("_"):
            continue
        if inspect.isfunction(inspect.getattr_static(cls, n)):
            names.append(f"{qualname}.{n}")
    return names


@pytest.mark.parametrize("module", MODULES)
def test_documented_signatures_match_the_code(module):
    import_or_skip(module)
    docs = {q: p for q, p in documented().items() if module_of(q) == module}
    required = list(REQUIRED[module])
    for cls in CLASSES_WITH_METHODS.get(module, []):
        required += public_methods(cls)
    problems = [f"not documented: {render(q, actual(q))}" for q in required if q not in docs]
    for q, params in docs.items():
        sig = actual(q)
        want = [(p.name, p.kind, p.default) for p in sig.parameters.values()]
        got = parse(q, params)
        if [(n, k) for n, k, _ in got] != [(n, k) for n, k, _ in want]:
            problems.append(f"{q}: parameters or kinds differ; the code has {render(q, sig)}")
            continue
        for (n, _, node), (_, _, default) in zip(got, want):
            if node is None:
                if default is not inspect.Parameter.empty:
                    problems.append(f"{q}: {n} has the default {default!r} in the code, none documented")
                continue
            if default is inspect.Parameter.empty:
                problems.append(f"{q}: {n} has no default in the code, {ast.unparse(node)} documented")
                continue
            try:
                doc_default = ast.literal_eval(node)
                same = type(doc_default) is type(default) and doc_default == default
            except ValueError:
                same = ast.unparse(node) == repr(default)
            if not same:
                problems.append(f"{q}: {n} defaults to {default!r} in the code, {ast.unparse(node)} documented")
    assert not problems, "docs/python.md's signatures are out of date:\n" + "\n".join(problems)


# -- docs/migration.md -----------------------------------------------------------------


def migration_text() -> str:
    return MIGRATION_MD.read_text()


def test_migration_snippets_use_names_that_exist():
    text = migration_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    names = set(re.findall(r"\b(shmckpt(?:\.[A-Za-z_]\w*)+)", code))
    for mod, imported in re.findall(r"from (shmckpt(?:\.\w+)*) import ([\w, ]+)", code):
        names |= {f"{mod}.{n.strip()}" for n in imported.split(",")}
    assert len(names) >= 8, names
    checked = 0
    for q in sorted(names):
        mod = q.split(".")[1]
        if mod in ("lightning", "megatron", "dcp"):
            try:
                importlib.import_module(f"shmckpt.{mod}")
            except ImportError:
                continue
        resolve(q)  # AttributeError when a snippet names something that does not exist
        checked += 1
    assert checked >= 3


def snippet(what: str) -> str:
    """The code block after the marker ``<!-- migration: WHAT (run by ...) -->``."""
    text = migration_text()
    marker = f"<!-- migration: {what} (run by python/tests/test_docs.py) -->"
    assert text.count(marker) == 1, marker
    m = re.search(r"```python\n(.*?)```", text[text.index(marker) :], re.S)
    assert m
    return textwrap.dedent(m.group(1))


def torch_save_snippet() -> str:
    return snippet("torch.save after")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def run_snippet(ckpt_dir: str, steps: int, code: str) -> Dict[str, Any]:
    """Runs the snippet as a fresh process would: seeds, a new model and optimizer, the
    train step drawing from torch's, numpy's and Python's RNGs."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step() -> None:
        x = torch.randn(4, 3) * float(np.random.rand()) + random.random()
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    g = {"model": model, "opt": opt, "train_step": train_step, "CKPT_DIR": ckpt_dir, "STEPS": steps, "EVERY": 2}
    exec(compile(code, "docs/migration.md", "exec"), g)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_torch_save_migration_resumes_bit_for_bit(tmp_path):
    code = torch_save_snippet()
    assert "close()" in code and "latest()" in code
    reference = run_snippet(str(tmp_path / "ref"), 9, code)
    # Stop after step 4 (steps 0, 2, 4 saved), start again: resumes at 5 with every RNG.
    run_snippet(str(tmp_path / "run"), 5, code)
    with shmckpt.Checkpointer(str(tmp_path / "run")) as ck:
        assert ck.list() == [0, 2, 4]
    resumed = run_snippet(str(tmp_path / "run"), 9, code)
    assert resumed.keys() == reference.keys()
    for k in reference:
        assert torch.equal(resumed[k], reference[k]), k
    # Without the RNG restore the resumed run would differ: the check can fail.
    no_rng = code.replace("random.setstate(", "(lambda s: None)(")
    assert no_rng != code
    run_snippet(str(tmp_path / "run2"), 5, code)
    diverged = run_snippet(str(tmp_path / "run2"), 9, no_rng)
    assert any(not torch.equal(diverged[k], reference[k]) for k in reference)


def test_the_lightning_migration_reads_a_plugin_checkpoint_outside_a_trainer(tmp_path):
    """What docs/migration.md says of a ShmckptCheckpointIO path: load_from_checkpoint and
    torch.load of the plain path raise IsADirectoryError, and its snippet (Lightning's own
    load_from_checkpoint given the shmckpt:// URL) restores the model outside a Trainer
    (hyper-parameters and weights, exactly)."""
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install lightning)")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from shmckpt.lightning import ShmckptCheckpointIO
    from test_lightning import Net, data, trainer

    trained = Net(lr=0.01, width=12)
    d = tmp_path / "run1"
    trainer(tmp_path, 1, [ShmckptCheckpointIO()], [ModelCheckpoint(dirpath=str(d), save_last=True)]).fit(trained, data())
    last = str(d / "last.ckpt")
    assert os.readlink(last) == "step-1"
    with pytest.raises(IsADirectoryError):
        Net.load_from_checkpoint(last)
    with pytest.raises(IsADirectoryError):
        torch.load(last, weights_only=False)
    code = snippet("lightning outside a Trainer").replace("/ckpt/run1/last.ckpt", last)
    assert f"shmckpt://{last}" in code
    g: Dict[str, Any] = {"MyModel": Net}
    exec(compile(code, "docs/migration.md", "exec"), g)
    model = g["model"]
    assert dict(model.hparams) == {"lr": 0.01, "width": 12, "tag": "tiny"}
    want = trained.state_dict()
    assert list(model.state_dict()) == list(want)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
