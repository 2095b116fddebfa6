"""The engines (shared-memory arenas) ``ShmckptWriter`` opens in this process, one per
rank and spool directory, reused by every save; ``prepare``/``release``; the spool's
layout (each engine's root, the parts a save left)."""

from __future__ import annotations

import atexit
import collections
import fcntl
import hashlib
import os
import re
import signal
import threading
import uuid
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import _shmckpt
from .items import _Save
from .storage import SPOOL_NAME
from . import bucket as _dcp_remote
from ..config import Tuning, tuning_of
from ..errors import ConfigError


class _EngineSlot:
    """One open engine: its capacity (bytes of staging) and its own root in the spool."""

    def __init__(self, engine: Any, capacity: int, root: str):
        self.engine = engine
        self.capacity = capacity
        self.root = root


#: (spool directory, rank, world size): what one engine serves.
_Key = Tuple[str, int, int]


class DcpSession:
    """The DCP storage state of this process: the engines ``ShmckptWriter`` opened (one
    per spool directory, rank and world size), the number of saves each began (the private
    step numbers the ranks agree on), each engine's generation (its root's name), and the
    gloo groups ``stage()`` exchanges item lists on.

    Why one per process and not per writer: DCP (and torchtitan, Megatron, Lightning
    through them) builds a new ``ShmckptWriter`` for every save, while an engine, whose
    arena is seconds of page faults and CUDA registration for many GiB, must outlive
    writers to keep host memory flat and saves fast; ``prepare()`` opens one before any
    writer exists, and ``release()`` and the interpreter's exit (``atexit``) must find
    them all. That instance is :data:`SESSION`; every writer holds a reference to it
    (``ShmckptWriter._session``), and a test or a program may give one its own. All
    methods are thread-safe (DCP stages and uploads on different threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: Dict[_Key, _EngineSlot] = {}
        self._seq: Dict[_Key, int] = {}
        self._gen: Dict[_Key, int] = {}
        self._role_seq: Dict[Tuple[str, int, int, str], int] = {}
        #: ranks -> (the default group it was made under, the gloo group)
        self._gather_groups: Dict[Tuple[int, ...], Tuple[Any, Any]] = {}
        #: Saves another process staged and handed to this one with their state dict
        #: (``async_save``'s PROCESS checkpointer: see ``staging.StagedState``), oldest
        #: first, until a writer of this process takes them.
        self.received: Deque[_Save] = collections.deque()

    def next_step(self, spool: str, rank: int, world: int, role: str = "") -> int:
        """The private step number of the next save of this rank on ``spool``: the same
        on every rank of the save (a hash of the spool, the world size and how many saves
        this process began there). ``role`` keeps the numbers of the writers that came
        from another process (``"received"``: DCP's checkpoint process, which saves on the
        same spool as the trainer) apart from the trainer's own."""
        if not role:
            key = (spool, rank, world)
            with self._lock:
                seq = self._seq.get(key, 0)
                self._seq[key] = seq + 1
            return _engine_step(spool, world, seq)
        rkey = (spool, rank, world, role)
        with self._lock:
            seq = self._role_seq.get(rkey, 0)
            self._role_seq[rkey] = seq + 1
        return _engine_step(f"{spool}\0{role}", world, seq)

    def receive(self, save: _Save) -> None:
        """Keep ``save``, staged by another process, until a writer here takes it."""
        with self._lock:
            self.received.append(save)

    def take_received(self, save: _Save) -> List[_Save]:
        """Take ``save`` (received) and the received saves before it; returns those
        older ones (saves whose upload failed before DCP wrote them: stale)."""
        with self._lock:
            older: List[_Save] = []
            while self.received:
                sv = self.received.popleft()
                if sv is save:
                    return older
                older.append(sv)
            return older

    def generations(self) -> Dict[_Key, int]:
        """How many engines were opened for each (spool, rank, world), a copy."""
        with self._lock:
            return dict(self._gen)

    def engine(
        self, spool: str, rank: int, world: int, need: int, opts: Tuning, role: str = ""
    ) -> _EngineSlot:
        """This rank's engine for ``spool``, with at least ``need`` bytes of staging.

        Each engine has its own root, ``spool/rank-KKKKK/<pid>-<generation>``: an engine
        (re)opened later never cleans up a directory another save still needs, and ranks
        never share a directory (the engine's own multi-rank commit is not used: see
        ``ShmckptWriter.finish``). ``role``: as in :meth:`next_step`; the first engine of a
        writer that came from another process leaves the spool's assembly directories alone
        (the trainer may be assembling a save of its own there)."""
        key = (spool, rank, world)
        with self._lock:
            slot = self._engines.get(key)
            if slot is not None and slot.capacity >= need:
                return slot
            if slot is not None:
                del self._engines[key]
            gen = self._gen.get(key, 0)
            self._gen[key] = gen + 1
        if slot is not None:
            slot.engine.close()  # finishes its saves in flight; their files stay for finish()
        slot = _open_engine(spool, rank, world, need, opts, gen, assembly=not role)
        if role:
            _release_on_sigterm()
        with self._lock:
            self._engines[key] = slot
        return slot

    def gather_group(self, group: Any) -> Any:
        """A gloo group of the same ranks as ``group`` (DCP's), for ``stage()``'s exchange of
        item lists: a collective on DCP's own group could interleave with the collectives of
        a previous save still uploading in DCP's thread. Made once per set of ranks (and
        again after the default group was destroyed and made anew), by those ranks only
        (``use_local_synchronization``)."""
        world = dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else world))
        with self._lock:
            made = self._gather_groups.get(ranks)
            if made is None or made[0] is not world:
                made = (world, dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True))
                self._gather_groups[ranks] = made
            return made[1]

    def release(self) -> None:
        """Finish the saves in flight and free every engine of this session. The next save
        opens a new engine."""
        with self._lock:
            slots = list(self._engines.values())
            self._engines.clear()
        for s in slots:
            s.engine.close()


#: The process's DCP session (see :class:`DcpSession` for why there is one).
SESSION = DcpSession()


def release() -> None:
    """Finish the saves in flight and free every engine (arena) ``ShmckptWriter`` opened
    in this process, and the registered read buffers of ``ShmckptReader``'s device loads.
    The next save opens a new engine."""
    SESSION.release()
    _shmckpt.release_device_ring()


def prepare(
    parent: Union[str, os.PathLike],
    *,
    staging_capacity: int,
    devices: Optional[Sequence[int]] = None,
    spool: Optional[Union[str, os.PathLike]] = None,
    process_group: Any = None,
    tuning: Optional[Tuning] = None,
    **legacy: Any,
) -> Dict[str, Any]:
    """Open this rank's engine for checkpoints published under ``parent`` now, at start-up,
    instead of in the first save: create and pre-fault its shared-memory arena of
    ``staging_capacity`` bytes (at least the rank's share of the state, plus a few MiB of
    header room) and register it with CUDA for ``devices`` (default: the current device
    when CUDA is available; ``[]`` for none). Every later ``ShmckptWriter(path)`` whose
    ``path`` is in ``parent`` (same ``spool`` and process group) reuses it, so no save
    pays these costs (seconds for many GiB: the first save of a process otherwise stalls
    that much longer). Call it on every rank, with the same arguments ``ShmckptWriter``
    gets (``tuning``: a :class:`shmckpt.Tuning`, whose ``staging_capacity`` this one
    raises; the flat tuning keywords of earlier versions are accepted, deprecated).
    Returns ``{"open_s", "cuda_registration_s", "staging_capacity", "shm_name"}``. A save
    that needs more staging than this still reopens a larger engine."""
    import time

    opts = tuning_of(
        "prepare", tuning, legacy, ("staging_capacity", "devices", "spool", "process_group", "tuning")
    ).with_staging_at_least(staging_capacity)
    if _dcp_remote.is_remote(parent):
        raise ConfigError(f"prepare({parent!r}): an s3:// checkpoint's engine opens at its first save")
    rank, world = _rank_world(process_group)
    parent_abs = os.path.abspath(os.fspath(parent))
    sp = os.path.abspath(os.fspath(spool)) if spool is not None else os.path.join(parent_abs, SPOOL_NAME)
    t = time.perf_counter()
    slot = SESSION.engine(sp, rank, world, int(staging_capacity), opts)
    open_s = time.perf_counter() - t
    if devices is None:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    reg = None
    if devices:
        t = time.perf_counter()
        slot.engine.prepare_cuda([int(d) for d in devices])
        reg = time.perf_counter() - t
    return {
        "open_s": open_s,
        "cuda_registration_s": reg,
        "staging_capacity": slot.capacity,
        "shm_name": slot.engine.describe()[0],
    }


atexit.register(release)


def _remove_tree(path: str) -> None:
    """Remove a directory of ours (rename first, so it vanishes at once)."""
    import shutil

    trash = f"{path}.trash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _release_on_sigterm() -> None:
    """In a child process of ``multiprocessing`` where a writer arrived pickled (DCP's
    checkpoint process, which opens an engine when it writes a save the trainer did not
    stage), free the engines on
    ``SIGTERM`` too: the trainer's interpreter ends its daemon children with ``SIGTERM``
    at exit (``multiprocessing.util._exit_function``), where no ``atexit`` handler runs,
    and the arena would stay in ``/dev/shm``. The handler finishes the saves in flight,
    closes the engines, then takes the signal's default action. Installed once, from the
    main thread, and only where ``SIGTERM`` still has its default action (a program's own
    handler is left alone: its clean exit runs ``atexit``)."""
    global _SIGTERM_HOOKED
    import multiprocessing

    if _SIGTERM_HOOKED or multiprocessing.parent_process() is None:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        try:
            release()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    _SIGTERM_HOOKED = True


_SIGTERM_HOOKED = False


def _rank_dir(spool: str, rank: int) -> str:
    return os.path.join(spool, f"rank-{rank:05d}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _root_in_use(root: str, rank: int) -> bool:
    """Whether an engine may own the engine root ``root`` (``<pid>-<gen>``): its process
    is alive on this host, or a process holds its rank lock (``.shmckpt-rank-K.lock``,
    taken by every open engine; probed with a shared non-blocking ``flock``, without
    following a link). A root whose lock cannot be probed counts as in use."""
    m = re.fullmatch(r"(\d+)-\d+", os.path.basename(root))
    if m is None or _pid_alive(int(m.group(1))):
        return True
    try:
        fd = os.open(os.path.join(root, f".shmckpt-rank-{rank}.lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK), or cannot be told
        return True
    finally:
        os.close(fd)
    return False


def _clean_spool(spool: str, rank: int, assembly: bool = True) -> None:
    """Leftovers of runs that died before publishing: this rank's engine roots of other
    processes that are gone (``_root_in_use``: the trainer and DCP's checkpoint process
    both have roots here), and assembly directories. Runs once per process, at this
    rank's first save: no rank of this run can have written anything the coordinator
    still needs (the first save needs this rank's file before anything is assembled)."""
    mine = f"{os.getpid()}-"
    rd = _rank_dir(spool, rank)
    if os.path.isdir(rd):
        for name in os.listdir(rd):
            p = os.path.join(rd, name)
            if name.startswith(mine) or not os.path.isdir(p) or os.path.islink(p):
                continue
            if not _root_in_use(p, rank):
                _remove_tree(p)
    if rank == 0 and assembly:
        for name in os.listdir(spool):
            p = os.path.join(spool, name)
            if (re.fullmatch(r"step-\d+", name) or ".trash-" in name) and os.path.isdir(p) and not os.path.islink(p):
                _remove_tree(p)


def _open_engine(
    spool: str, rank: int, world: int, need: int, opts: Tuning, gen: int, assembly: bool = True
) -> _EngineSlot:
    """Open engine number ``gen`` of this process for ``rank`` on ``spool`` (at its root
    ``spool/rank-KKKKK/<pid>-<gen>``), with at least ``need`` bytes of staging; the first
    one (``gen`` 0) removes the leftovers of dead runs first (``_clean_spool``; with
    ``assembly`` its stale assembly directories too)."""
    remote: Dict[str, Any] = {}
    if _dcp_remote.is_remote(spool):  # `spool` is a bucket root: a remote-only engine
        root, remote = _dcp_remote.engine_root(spool, world)
    else:
        if gen == 0:
            os.makedirs(spool, exist_ok=True)
            _clean_spool(spool, rank, assembly)
        root = os.path.join(_rank_dir(spool, rank), f"{os.getpid()}-{gen}")
        os.makedirs(root, exist_ok=True)
    chunk = opts.chunk_size or (8 << 20)
    cap = max(opts.staging_capacity or 0, -(-need // chunk) * chunk)
    settings = dict(opts.given(), rank=rank, world_size=world, staging_capacity=cap, **remote)
    engine = _shmckpt.Engine(root, settings)
    return _EngineSlot(engine, int(engine.describe()[1]), root)


def _engine_step(path: str, world: int, seq: int) -> int:
    h = hashlib.blake2b(f"{path}\0{world}\0{seq}".encode(), digest_size=7).digest()
    return int.from_bytes(h, "little")


def _rank_world(group: Any) -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _sources(save: _Save, rank: int) -> List[str]:
    """Where ``rank``'s engines left their part of ``save``: the partial directories of
    its part-only save in the rank's engine roots (``shmckpt::commit::find_parts``)."""
    return list(_shmckpt.find_parts(_rank_dir(save.spool, rank), save.step))