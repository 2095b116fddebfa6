"""Runs an upstream project's own tests (a checkout the user provides; none of their code
is in this repository) with one of shmckpt's swap plugins (python/tests/third_party/),
in a pytest subprocess, and reports its outcome counts. Used by test_upstream_lightning.py
and test_upstream_dcp.py.

Without the checkout (its environment variable unset) the runner test is skipped with
how to get it; ``SHMCKPT_REQUIRE_UPSTREAM_TESTS=1`` makes that a failure.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Dict, List, Sequence

import pytest

import shmckpt

REPO = pathlib.Path(__file__).resolve().parents[2]
THIRD_PARTY = pathlib.Path(__file__).resolve().parent / "third_party"
REQUIRE_ENV = "SHMCKPT_REQUIRE_UPSTREAM_TESTS"
#: The counts pytest's summary line reports (pytest says "error" for one, "errors" else).
OUTCOMES = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed", "deselected")


def checkout(env: str, how: str) -> pathlib.Path:
    """The directory named by ``env``; skips (or fails under ``REQUIRE_ENV=1``) when unset."""
    value = os.environ.get(env, "")
    if not value:
        msg = f"{env} is not set: no upstream checkout to run. {how}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1, but {msg}")
        pytest.skip(msg)
    path = pathlib.Path(value).expanduser().resolve()
    if not path.is_dir():
        pytest.fail(f"{env}={value} is not a directory")
    return path


def require_modules(modules: Sequence[str], why: str) -> None:
    """A checkout was given, so a missing test dependency is a failure, not a skip."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{why} import {', '.join(missing)}: pip install {' '.join(missing)} (scripts/upstream_tests.sh does)")


@dataclasses.dataclass
class Run:
    counts: Dict[str, int]
    #: ``Class::test`` (or ``module::test`` for functions) -> passed, failed, error, skipped, xfailed.
    outcomes: Dict[str, str]
    seconds: float
    output: str


def _summary_counts(output: str) -> Dict[str, int]:
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        return {}
    found = dict((word, int(n)) for n, word in re.findall(r"(\d+) ([a-z]+)", lines[-1]))
    if "error" in found:
        found["errors"] = found.pop("error")
    return {k: found.get(k, 0) for k in OUTCOMES if found.get(k, 0)}


def _junit_outcomes(path: pathlib.Path) -> Dict[str, str]:
    outcomes: Dict[str, str] = {}
    if not path.exists():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = case.get("classname", "").rsplit(".", 1)[-1] + "::" + case.get("name", "")
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        outcomes[tid] = outcome
    return outcomes


def run_pytest(
    files: List[pathlib.Path],
    plugin: str,
    plugin_dir: pathlib.Path,
    rootdir: pathlib.Path,
    tmp_path: pathlib.Path,
    env: Dict[str, str],
    timeout: float,
) -> Run:
    """``python -m pytest -p PLUGIN FILES`` in a subprocess: pytest's settings empty (not
    the checkout's own, which CI flags of the project would change), no conftest above
    ``rootdir``, its temporary directories and working directory under ``tmp_path``."""
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    junit = tmp_path / "junit.xml"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    paths = [str(plugin_dir)]
    src = pathlib.Path(shmckpt.__file__).resolve().parent.parent
    if src == REPO / "python":  # the source tree (PYTHONPATH=python), not an installed wheel
        paths.append(str(src))
    environ = dict(os.environ)
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    cmd = [
        sys.executable, "-m", "pytest", "-p", plugin, "-p", "no:cacheprovider",
        "-c", str(ini), "--rootdir", str(rootdir), "--confcutdir", str(rootdir),
        "--basetemp", str(tmp_path / "basetemp"), "--junitxml", str(junit),
        "-q", "-rfEX", *map(str, files),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    print(output[-3000:])
    return Run(_summary_counts(proc.stdout), _junit_outcomes(junit), seconds, output)
