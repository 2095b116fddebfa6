"""The swap that scripts/dcp_peer_tests.sh runs PyTorch DCP's own tests with
(python/tests/third_party/dcp): checked here without DCP's test files, which CI cannot
fetch, so that a stage printing NOT RUN still has its machinery tested. Runs in a fresh
interpreter, as the peer tests' processes do (sitecustomize installs the swap)."""

import os
import pathlib
import subprocess
import sys
import textwrap

HERE = pathlib.Path(__file__).resolve().parent
PEER = HERE / "third_party" / "dcp"

SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint._storage_utils as su
    import swap
    from shmckpt.dcp import ShmckptReader, ShmckptWriter

    warnings.simplefilter("ignore")
    assert dcp.FileSystemWriter is fs.FileSystemWriter is su.FileSystemWriter is swap.SwappedWriter
    assert dcp.FileSystemReader is fs.FileSystemReader is su.FileSystemReader is swap.SwappedReader
    assert issubclass(swap.SwappedWriter, ShmckptWriter) and issubclass(swap.SwappedReader, ShmckptReader)
    path = sys.argv[1]
    # FileSystemWriter's arguments, as DCP's tests pass them; twice into one directory.
    for v in (1.0, 2.0):
        w = dcp.FileSystemWriter(path=path, thread_count=2, sync_files=False)
        assert type(w) is swap.SwappedWriter and w._opts["writer_threads"] == 2
        dcp.save({"w": torch.full((3, 4), v), "b": b"blob"}, storage_writer=w)
    # checkpoint_id only: DCP picks the writer and reader through _storage_utils.
    dcp.save({"w": torch.full((3, 4), 3.0), "b": b"last"}, checkpoint_id=path)
    assert sorted(os.listdir(path)) == [".metadata", "manifest.json", "rank-00000-of-00001.safetensors"]
    dst = {"w": torch.zeros(3, 4), "b": b""}
    dcp.load(dst, checkpoint_id=path)
    assert torch.equal(dst["w"], torch.full((3, 4), 3.0)) and dst["b"] == b"last", dst
    dst = {"w": torch.zeros(3, 4), "b": b""}
    dcp.load(dst, storage_reader=dcp.FileSystemReader(path, _extension_registry=None))
    assert torch.equal(dst["w"], torch.full((3, 4), 3.0))
    # A storage extension is refused, never ignored.
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example
    try:
        dcp.FileSystemWriter(path=path, _extensions=[Rot13Example()])
    except NotImplementedError as e:
        assert "Rot13Example" in str(e), e
    else:
        raise AssertionError("an extension was accepted")
    # The plugin refuses to run where the swap is missing.
    import dcp_peer_plugin, pytest
    dcp_peer_plugin.pytest_configure(None)
    fs.FileSystemWriter = swap.ORIGINAL["writer"]
    dcp.FileSystemWriter = swap.ORIGINAL["writer"]
    try:
        dcp_peer_plugin.pytest_configure(None)
    except pytest.UsageError:
        pass
    else:
        raise AssertionError("the plugin ran without the swap")
    print("swap ok")
    """
)


def test_the_swap_replaces_dcps_filesystem_classes(tmp_path):
    env = dict(os.environ)
    env["SHMCKPT_DCP_SWAP"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(PEER / "site"), str(PEER), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "ck")], env=env, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("swap ok"), r.stdout + r.stderr


def test_every_expected_failure_has_a_reason_and_names_a_listed_file():
    sys.path.insert(0, str(PEER))
    try:
        import dcp_peer_plugin
    finally:
        sys.path.remove(str(PEER))
    files = [
        os.path.basename(line.strip())
        for line in (PEER / "FILES").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert files == ["test_file_system_checkpoint_cpu.py"]
    assert dcp_peer_plugin.EXPECTED_FAILURES
    for pattern, reason in dcp_peer_plugin.EXPECTED_FAILURES.items():
        assert pattern.split("::")[0] in files, pattern
        assert len(reason) > 40, (pattern, reason)
        assert dcp_peer_plugin.RAISES[pattern] == (NotImplementedError,)
