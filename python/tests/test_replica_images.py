"""Replica images (docs/replicas.md): received straight into their final memory, sealed
(read-only, every tensor's CRC-32C against the committed manifest) before anything is
published or served, and checked on every path that reads them (exact bytes)."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

import shmckpt
from shmckpt import _shmckpt
from shmckpt.replicas import list_replicas

from replica_support import droot, save_rank_step  # noqa: F401 (droot: a fixture)


def test_images_are_checked_on_every_path(droot):
    """Stored, served and written back only when size, header and every CRC-32C match the
    committed manifest; never through a link."""
    root = droot
    save_rank_step(root, 0, 9)
    good = np.asarray(_shmckpt.replica_read_committed(str(root), 9, 0)).tobytes()
    fname = json.loads((root / "step-9" / "manifest.json").read_text())["files"][0]["file"]
    assert good == (root / "step-9" / fname).read_bytes()
    tampered = bytearray(good)
    tampered[len(good) // 2] ^= 0x80
    name = _shmckpt.replica_name(str(root), 0, 9)
    shm = pathlib.Path("/dev/shm") / name
    with pytest.raises(shmckpt.ChecksumError):
        _shmckpt.replica_store(str(root), 9, 0, bytes(tampered))
    assert not shm.exists()
    with pytest.raises(shmckpt.Truncated):
        _shmckpt.replica_store(str(root), 9, 0, good[:-1])
    with pytest.raises(shmckpt.CorruptError):
        _shmckpt.replica_store(str(root), 9, 0, good + b"\0")
    header_bad = bytearray(good)
    header_bad[10] = ord("#")  # inside the JSON header
    with pytest.raises(shmckpt.CorruptError):
        _shmckpt.replica_store(str(root), 9, 0, bytes(header_bad))
    with pytest.raises(shmckpt.NotFound):
        _shmckpt.replica_store(str(root), 10, 0, good)
    assert not shm.exists()

    # Temporary files of writers that died are removed by the next store of that rank's
    # replica; those of live processes (pid 1) are not.
    dead = shm.parent / f"{name}.tmp999999999"
    live = shm.parent / f"{name}.tmp1"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    try:
        assert _shmckpt.replica_store(str(root), 9, 0, good) == name
        assert not dead.exists() and live.read_bytes() == b"partial"
        assert [r["name"] for r in list_replicas() if r["name"].startswith(name)] == [name]
    finally:
        live.unlink()
        if dead.exists():
            dead.unlink()
    assert np.asarray(_shmckpt.replica_load(str(root), 9, 0)).tobytes() == good
    # A link in the replica's place is never followed.
    shm.unlink()
    target = root / "elsewhere"
    target.write_bytes(good)
    shm.symlink_to(target)
    try:
        with pytest.raises(shmckpt.UnsafePath):
            _shmckpt.replica_load(str(root), 9, 0)
    finally:
        shm.unlink()
    # Nor a FIFO (opened without blocking, refused as not a regular file).
    os.mkfifo(shm)
    try:
        with pytest.raises(shmckpt.UnsafePath):
            _shmckpt.replica_load(str(root), 9, 0)
    finally:
        shm.unlink()
    # A damaged image is never written back as the rank's file.
    (root / "step-9" / fname).unlink()
    with pytest.raises(shmckpt.ChecksumError):
        _shmckpt.replica_restore_file(str(root), 9, 0, bytes(tampered))
    assert sorted(p.name for p in (root / "step-9").iterdir()) == ["manifest.json"]
    assert _shmckpt.replica_restore_file(str(root), 9, 0, good) == str(root / "step-9" / fname)
    assert (root / "step-9" / fname).read_bytes() == good


def test_received_images_are_sealed_before_served(droot):
    """Images received straight into their final memory (``replica_receive``: a replica
    arena in /dev/shm; ``replica_receive_restore``: a lost rank's private memory) are never
    listed, served or written back before ``seal()`` checked them against the committed
    manifest; a sealed replica holds exactly the source file's bytes, read-only; a failed
    check removes the arena; a sealed restore writes the file back and serves its tensors
    bit-exactly from that memory."""
    import torch
    from replica_worker import rank_state

    root = droot
    save_rank_step(root, 1, 5)
    entry = json.loads((root / "step-5" / "manifest.json").read_text())["files"][0]
    fname = entry["file"]
    good = (root / "step-5" / fname).read_bytes()
    name = _shmckpt.replica_name(str(root), 0, 5)
    shm = pathlib.Path("/dev/shm") / name
    tmp = shm.parent / f"{name}.tmp{os.getpid()}"

    def names():
        return [r["name"] for r in list_replicas() if r["name"].startswith(name)]

    # A replica arena: unlisted and unserved while open; sealed, exactly the file's bytes.
    img = _shmckpt.replica_receive(str(root), 5, 0)
    assert img.state == "open" and img.nbytes == len(good) == entry["bytes"]
    view = np.asarray(img)
    assert view.flags.writeable and view.size == len(good)
    view[:] = np.frombuffer(good, dtype=np.uint8)
    assert tmp.is_file() and not shm.exists() and names() == []
    with pytest.raises(shmckpt.errors.IoError, match="No such file"):
        _shmckpt.replica_load(str(root), 5, 0)
    with pytest.raises(shmckpt.ConfigError, match="not sealed"):
        img.tensors()
    assert img.seal() == str(shm)
    assert img.state == "sealed" and not tmp.exists() and names() == [name]
    assert shm.read_bytes() == good
    assert np.asarray(_shmckpt.replica_load(str(root), 5, 0)).tobytes() == good
    after = np.asarray(img)
    assert not after.flags.writeable and after.tobytes() == good
    with pytest.raises(ValueError):
        after[0] = 1
    with pytest.raises(shmckpt.ConfigError, match="sealed already"):
        img.seal()
    del view, after, img
    assert shm.read_bytes() == good  # the arena outlives the object that received it
    # Served to a lost rank: mapped read-only, checked in place, exactly the bytes.
    served = _shmckpt.replica_serve(str(root), 5, 0)
    sv = np.asarray(served)
    assert served.state == "sealed" and not sv.flags.writeable and sv.tobytes() == good
    del sv, served

    # A flipped data byte or a damaged header: refused, removed, the older replica kept.
    for at, err in ((entry["data_start"] + 5, shmckpt.ChecksumError), (10, shmckpt.CorruptError)):
        bad = bytearray(good)
        bad[at] ^= 0x5A
        img = _shmckpt.replica_receive(str(root), 5, 0)
        np.asarray(img)[:] = np.frombuffer(bytes(bad), dtype=np.uint8)
        with pytest.raises(err):
            img.seal()
        assert img.state == "refused" and not tmp.exists()
        assert shm.read_bytes() == good and names() == [name]
        with pytest.raises(shmckpt.ConfigError):
            img.tensors()
        del img
    # A held replica damaged in place, a link or another kind of file: never served.
    flipped = bytearray(good)
    flipped[entry["data_start"] + 7] ^= 0x10
    shm.write_bytes(bytes(flipped))
    with pytest.raises(shmckpt.ChecksumError):
        _shmckpt.replica_serve(str(root), 5, 0)
    shm.write_bytes(good[:-1])
    with pytest.raises(shmckpt.Truncated):
        _shmckpt.replica_serve(str(root), 5, 0)
    shm.unlink()
    (root / "elsewhere").write_bytes(good)
    shm.symlink_to(root / "elsewhere")
    with pytest.raises(shmckpt.UnsafePath):
        _shmckpt.replica_serve(str(root), 5, 0)
    shm.unlink()
    shm.write_bytes(good)
    # An arena dropped unsealed (a transfer that failed) leaves nothing behind.
    img = _shmckpt.replica_receive(str(root), 5, 0)
    assert tmp.is_file()
    del img
    assert not tmp.exists() and names() == [name]
    with pytest.raises(shmckpt.NotFound):
        _shmckpt.replica_receive(str(root), 6, 0)

    # Checked as it arrives: received(end) freezes the bytes before `end` (whole pages) and
    # checks what they complete (the header, each tensor wholly inside); seal() the rest.
    # Here the header is the first page, "model.i" the next 32 bytes.
    assert entry["data_start"] == 4096 and len(good) > 2 * 4096
    first = next(t for t in entry["tensors"] if t["data_offsets"][0] == 0)
    assert first["data_offsets"][1] <= 4096
    img = _shmckpt.replica_receive(str(root), 5, 0)
    v = np.asarray(img)
    v[:] = np.frombuffer(good, dtype=np.uint8)
    img.received(2 * 4096 - 1)  # rounded down to a page: the header only
    assert img.checked_tensors == 0
    img.received(2 * 4096)
    assert img.checked_tensors == 1 and tmp.is_file()  # checked, not published yet
    img.received(len(good))
    assert img.checked_tensors == len(entry["tensors"])
    assert img.seal() == str(shm) and shm.read_bytes() == good
    del v, img
    # A damaged tensor is found when it arrives, and the seal refuses the image.
    bad = bytearray(good)
    bad[4096 + 3] ^= 0x01
    img = _shmckpt.replica_receive(str(root), 5, 0)
    np.asarray(img)[:] = np.frombuffer(bytes(bad), dtype=np.uint8)
    with pytest.raises(shmckpt.ChecksumError, match=first["name"]):
        img.received(2 * 4096)
    with pytest.raises(shmckpt.ChecksumError, match=first["name"]):
        img.seal()
    assert img.state == "refused" and not tmp.exists() and shm.read_bytes() == good
    del img
    # A write into received bytes faults (they are frozen): the process dies of SIGSEGV.
    child = subprocess.run(
        [sys.executable, "-c", (
            "import sys, numpy as np; from shmckpt import _shmckpt\n"
            f"img = _shmckpt.replica_receive({str(root)!r}, 5, 0)\n"
            f"v = np.asarray(img); v[:] = np.fromfile({str(root / 'step-5' / fname)!r}, dtype=np.uint8)\n"
            "img.received(8192); print('frozen', flush=True)\n"
            "v[100] = 1\nprint('wrote', flush=True)\n"
        )],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.returncode == -signal.SIGSEGV and child.stdout == "frozen\n", (child.returncode, child.stdout, child.stderr)
    assert shm.read_bytes() == good
    for left in shm.parent.glob(f"{name}.tmp*"):  # the dead child's arena (exact name)
        left.unlink()

    # An arena made ahead, before its step is committed (sized by a guess): unlisted, and
    # received into once the step is committed, its size then the manifest's; the same
    # file (made once), exact bytes once sealed.
    for guess in (len(good), len(good) // 3, 3 * len(good)):
        prep = _shmckpt.replica_prepare(str(root), 5, 0, guess)
        assert prep.nbytes == guess and tmp.stat().st_size == guess and names() == [name]
        ino = tmp.stat().st_ino
        img = _shmckpt.replica_receive(str(root), 5, 0, prep)
        assert prep.nbytes == 0 and img.nbytes == len(good)
        assert tmp.stat().st_ino == ino and tmp.stat().st_size == len(good)
        np.asarray(img)[:] = np.frombuffer(good, dtype=np.uint8)
        img.received(len(good))
        assert img.seal() == str(shm) and shm.read_bytes() == good and not tmp.exists()
        del img
        with pytest.raises(shmckpt.ConfigError, match="used already"):
            _shmckpt.replica_receive(str(root), 5, 0, prep)
    # Dropped unused, or for another step or rank, or a step never committed: removed.
    prep = _shmckpt.replica_prepare(str(root), 5, 0, len(good))
    assert tmp.is_file()
    del prep
    assert not tmp.exists()
    prep = _shmckpt.replica_prepare(str(root), 5, 0, len(good))
    with pytest.raises(shmckpt.ConfigError, match="prepared for rank 0 of step 5"):
        _shmckpt.replica_receive(str(root), 5, 1, prep)
    assert not tmp.exists()
    tmp7 = shm.parent / f"{_shmckpt.replica_name(str(root), 0, 7)}.tmp{os.getpid()}"
    prep = _shmckpt.replica_prepare(str(root), 7, 0, len(good))
    assert tmp7.is_file()
    with pytest.raises(shmckpt.NotFound):
        _shmckpt.replica_receive(str(root), 7, 0, prep)
    assert not tmp7.exists() and shm.read_bytes() == good and names() == [name]
    with pytest.raises(shmckpt.ConfigError):
        _shmckpt.replica_prepare(str(root), 5, 0, 0)

    # The sender's image: its file, opened checked, read piece by piece as it is sent.
    src = _shmckpt.replica_source(str(root), 5, 0)
    sv = np.asarray(src)
    assert src.nbytes == len(good) and not sv.flags.writeable
    src.read_range(0, 100)
    assert sv[:100].tobytes() == good[:100]
    src.read_range(100, len(good) + 4096)  # clamped to the file
    assert sv.tobytes() == good
    del sv, src
    fpath = root / "step-5" / fname
    src = _shmckpt.replica_source(str(root), 5, 0)
    os.truncate(fpath, len(good) // 2)  # the file shrinks under the sender: refused
    with pytest.raises(shmckpt.Truncated):
        src.read_range(0, len(good))
    del src
    with pytest.raises(shmckpt.Truncated):
        _shmckpt.replica_source(str(root), 5, 0)
    hdr = bytearray(good)
    hdr[10] ^= 0x20
    fpath.write_bytes(bytes(hdr))
    with pytest.raises(shmckpt.CorruptError):
        _shmckpt.replica_source(str(root), 5, 0)
    fpath.unlink()
    fpath.symlink_to(root / "elsewhere")
    with pytest.raises(shmckpt.UnsafePath):
        _shmckpt.replica_source(str(root), 5, 0)
    fpath.unlink()
    fpath.write_bytes(good)

    # A lost rank's restore: refused when damaged (its file is not written) ...
    (root / "step-5" / fname).unlink()
    bad = bytearray(good)
    bad[-1] ^= 0x01
    img = _shmckpt.replica_receive_restore(str(root), 5, 0)
    np.asarray(img)[:] = np.frombuffer(bytes(bad), dtype=np.uint8)
    with pytest.raises(shmckpt.ChecksumError):
        img.seal()
    assert sorted(p.name for p in (root / "step-5").iterdir()) == ["manifest.json"]
    del img
    # Written while it arrives (received), then refused: the early file is removed.
    early = root / "step-5" / f".{fname}.tmp{os.getpid()}"
    img = _shmckpt.replica_receive_restore(str(root), 5, 0)
    assert img.restore
    half = len(good) // 2
    np.asarray(img)[:] = np.frombuffer(bytes(bad), dtype=np.uint8)
    img.received(half)
    assert early.read_bytes() == good[: half - half % 4096]  # whole pages, frozen
    with pytest.raises(shmckpt.ChecksumError):
        img.seal()
    assert sorted(p.name for p in (root / "step-5").iterdir()) == ["manifest.json"]
    del img
    # Written while it arrives, then sealed: the file holds exactly the image.
    img = _shmckpt.replica_receive_restore(str(root), 5, 0)
    whole = np.asarray(img)
    whole[:half] = np.frombuffer(good[:half], dtype=np.uint8)
    img.received(half)
    assert early.read_bytes() == good[: half - half % 4096] and not (root / "step-5" / fname).exists()
    whole[half:] = np.frombuffer(good[half:], dtype=np.uint8)
    assert img.seal() == str(root / "step-5" / fname)
    assert (root / "step-5" / fname).read_bytes() == good and not early.exists()
    with pytest.raises(shmckpt.ConfigError):  # a sealed image receives nothing more
        img.received(4096)
    del whole, img
    (root / "step-5" / fname).unlink()
    # ... else the file is written back from memory, and the tensors served from it.
    img = _shmckpt.replica_receive_restore(str(root), 5, 0)
    np.asarray(img)[:] = np.frombuffer(good, dtype=np.uint8)
    assert img.seal() == str(root / "step-5" / fname)
    assert (root / "step-5" / fname).read_bytes() == good
    whole = np.asarray(img)
    assert whole.flags.writeable  # the holder's memory again
    want = rank_state(1, 5)["model"]
    got = {}
    for tname, dtype, shape, a, b in img.tensors():
        t = next(t for t in entry["tensors"] if t["name"] == tname)
        assert (dtype, shape) == (t["dtype"], t["shape"])
        assert (a, b) == (entry["data_start"] + t["data_offsets"][0], entry["data_start"] + t["data_offsets"][1])
        got[tname] = torch.from_numpy(whole[a:b])
    assert sorted(got) == ["model.h", "model.i", "model.w"]
    for k, v in want.items():  # exact bytes
        assert got[f"model.{k}"].equal(v.contiguous().view(-1).view(torch.uint8))


def test_older_replicas_are_removed_after_the_newer_one_is_sealed(droot):
    """``seal()`` removes this user's older replicas of the same root and rank once the newer
    one is published; ``seal(keep_older=True)`` (the replication's: freeing a large replica's
    pages is not part of its time to k-safe) leaves them to ``replica_remove_older``."""
    root = droot
    tag = _shmckpt.replica_tag(str(root))

    def held():
        return sorted(r["step"] for r in list_replicas() if r["root_tag"] == tag and r["source_rank"] == 0)

    for step in (1, 2, 3):
        save_rank_step(root, 1, step)
    for step, keep in ((1, False), (2, True), (3, False)):
        entry = json.loads((root / f"step-{step}" / "manifest.json").read_text())["files"][0]
        good = (root / f"step-{step}" / entry["file"]).read_bytes()
        img = _shmckpt.replica_receive(str(root), step, 0)
        np.asarray(img)[:] = np.frombuffer(good, dtype=np.uint8)
        img.seal(keep_older=keep)
        del img
        if step == 2:
            assert held() == [1, 2]  # kept
            _shmckpt.replica_remove_older(str(root), 0, 2)
            assert held() == [2]
            shm = pathlib.Path("/dev/shm") / _shmckpt.replica_name(str(root), 0, 2)
            assert shm.read_bytes() == good
    assert held() == [3]


class _Net:
    """The state :meth:`ReplicaNet._agree` reads, on rank ``rank`` of 3 (every rank's
    pieces: 1 MiB chunks, unbounded bandwidth: 64 MiB), with ``_gather`` answering
    ``others`` (rank -> what that rank announced) and this rank's own announcement."""

    def __init__(self, rank, others):
        from shmckpt._replica_net import ReplicaNet

        class Ck:
            world_size = 3

        self.net = ReplicaNet()
        self.net.ckpt = Ck()
        self.net.ckpt.rank = rank
        self.net.bandwidths = [None] * 3
        self.net.chunk_sizes = [1 << 20] * 3
        self.net._gather = lambda mine, what: [others.get(r, mine) if r != rank else mine for r in range(3)]


class _Image:
    def __init__(self, n):
        self.nbytes = n


def test_sizes_are_agreed_before_any_receive():
    """`_agree` (one gather, no transfer): a pair refused when the two ends disagree on
    the bytes or the piece size, when one end announces it and the other does not, and
    when an announcement is not a map of ranks to sizes; both ends name the same reason."""
    piece = 64 << 20
    buf = np.zeros(1000, dtype=np.uint8)
    # Rank 1 expects 1000 bytes from rank 0, which announces 1001.
    net = _Net(1, {0: ({1: (1001, piece)}, {}), 2: ({}, {})}).net
    assert net._agree([], [(0, buf)]) == {
        (0, 1): f"rank 0 announced 1001 bytes in pieces of {piece}, rank 1 expects 1000 bytes in pieces of {piece}"
    }
    # The sender's side of the same pair, from the same announcements.
    net = _Net(0, {1: ({}, {0: (1000, piece)}), 2: ({}, {})}).net
    assert net._agree([(_Image(1001), [1])], []) == {
        (0, 1): f"rank 0 announced 1001 bytes in pieces of {piece}, rank 1 expects 1000 bytes in pieces of {piece}"
    }
    # Agreed: nothing refused.
    net = _Net(1, {0: ({1: (1000, piece)}, {}), 2: ({}, {})}).net
    assert net._agree([], [(0, buf)]) == {}
    # Another piece size (the ends would cut the image differently).
    net = _Net(1, {0: ({1: (1000, 1 << 20)}, {}), 2: ({}, {})}).net
    assert net._agree([], [(0, buf)]) == {
        (0, 1): f"rank 0 announced 1000 bytes in pieces of {1 << 20}, rank 1 expects 1000 bytes in pieces of {piece}"
    }
    # Expected from a rank that sends nothing; sent to a rank that expects nothing.
    net = _Net(1, {0: ({}, {}), 2: ({1: (5, piece)}, {})}).net
    assert net._agree([], [(0, buf)]) == {
        (0, 1): f"rank 1 expects 1000 bytes in pieces of {piece} from rank 0, which sends it nothing",
        (2, 1): f"rank 2 announced 5 bytes in pieces of {piece} to rank 1, which expects nothing from it",
    }
    # Announcements that are not sizes: negative, not integers, ranks outside the world,
    # a zero piece, not a pair.
    for bad in [{1: (-1, piece)}, {1: (1000.0, piece)}, {7: (1000, piece)}, {1: (1000, 0)}, {1: [1000, piece]}, "x"]:
        net = _Net(1, {0: (bad, {}), 2: ({}, {})}).net
        assert net._agree([], [(0, buf)]) == {(0, 1): "rank 0 announced sizes that are not sizes"}, bad
    net = _Net(1, {0: None, 2: ({}, {})}).net
    assert net._agree([], [(0, buf)]) == {(0, 1): "rank 0 announced sizes that are not sizes"}
