"""Shared fixtures of the shmckpt Python tests.

GPU tests carry the ``gpu`` marker: they are skipped without a CUDA GPU, and with
``SHMCKPT_REQUIRE_GPU=1`` a missing GPU fails them instead.
"""

import os
import pathlib
import re
import shutil
import socket

import pytest

import shmckpt

REPO = pathlib.Path(__file__).resolve().parents[2]
SMALL = 32 << 20  # staging capacity of most tests (the default 2 GiB is pre-faulted)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for a process group, a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_runtest_setup(item):
    if "gpu" not in item.keywords:
        return
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("SHMCKPT_REQUIRE_GPU") == "1":
        pytest.fail("SHMCKPT_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
    pytest.skip("no CUDA GPU (set SHMCKPT_REQUIRE_GPU=1 to make this a failure)")


#: A staging arena's default name: ``shmckpt.<pid>.r<rank>.<n>`` (see docs/design.md).
_STAGING = re.compile(r"^shmckpt\.(\d+)\.r\d+\.\d+$")


def _staging_arenas():
    try:
        return {n for n in os.listdir("/dev/shm") if _STAGING.match(n)}
    except OSError:
        return set()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _arena_roots(names):
    """The checkpoint root recorded in each named arena, read by ``shmckpt recover --list``
    (the one reader of arena descriptors); names it cannot read are left out."""
    exe = shmckpt_bin()
    if not exe or not names:
        return {}
    import subprocess

    try:
        out = subprocess.run([exe, "recover", "--list"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    roots = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+)  .*  root (.+)  \[[^]]*\]$", line)
        if m and m.group(1) in names:
            roots[m.group(1)] = m.group(2)
    return roots


@pytest.fixture(autouse=True)
def _no_orphan_staging_arenas(tmp_path_factory):
    """A test that kills a child trainer leaves the child's staging arena in ``/dev/shm``:
    by design (a crashed trainer's staged bytes survive for recovery), but nothing of a
    test's temporary root ever recovers it. Remove the arenas that appeared during the test,
    whose process is gone and whose recorded root lies under this session's temporary
    directory, so a test run leaks no shared memory. Arenas of any other root (another
    test run on the machine, whose own test may be about to recover them) are left alone."""
    before = _staging_arenas()
    yield
    dead = [n for n in _staging_arenas() - before if not _alive(int(_STAGING.match(n).group(1)))]
    if not dead:
        return
    base = tmp_path_factory.getbasetemp()
    mine = (str(base) + os.sep, os.path.realpath(base) + os.sep)
    for name, root in _arena_roots(set(dead)).items():
        if root.startswith(mine):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass


@pytest.fixture
def root(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


@pytest.fixture
def ck(root):
    c = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20))
    yield c
    c.close()


def shm_arenas_of(root, kind=None):
    """The names of the shmckpt arenas in ``/dev/shm`` whose recorded root is ``root``
    (``kind``: ``"kept"`` or ``"staging"``; any when None), as ``shmckpt shm list --json``
    reads them. Scoped by root, never by name alone: other test runs on the machine (run
    side by side, scripts/test.sh) have arenas of their own."""
    import json
    import subprocess

    exe = shmckpt_bin()
    if not exe:
        pytest.fail("the shmckpt command line is needed to list arenas (SHMCKPT_BIN)")
    out = subprocess.run([exe, "shm", "list", "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
    want = {str(root), os.path.realpath(str(root))}
    return sorted(a["name"] for a in json.loads(out) if a.get("root") in want and (kind is None or a.get("kind") == kind))


def remove_arenas_of(root, kind=None):
    """Remove the arenas :func:`shm_arenas_of` finds (a test's cleanup)."""
    for n in shm_arenas_of(root, kind):
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except FileNotFoundError:
            pass


def shmckpt_bin():
    """The `shmckpt` command line (SHMCKPT_BIN, else target/{debug,release}/shmckpt)."""
    env = os.environ.get("SHMCKPT_BIN")
    if env:
        return env
    for p in (REPO / "target" / "debug" / "shmckpt", REPO / "target" / "release" / "shmckpt"):
        if p.is_file():
            return str(p)
    return shutil.which("shmckpt")


def listing(root):
    """Every path under root (relative), to compare before/after."""
    root = pathlib.Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def descriptors_under(root):
    """Files under root this process holds a descriptor of (deleted ones too), except the
    engines' root locks (`.shmckpt-rank-N.lock`, held while an engine is open)."""
    root = os.path.realpath(root)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing (e.g. the listing's own descriptor)
            continue
        name = os.path.basename(target.removesuffix(" (deleted)"))
        if target.startswith(root + os.sep) and not (name.startswith(".shmckpt-rank-") and name.endswith(".lock")):
            found.append(target)
    return sorted(found)
