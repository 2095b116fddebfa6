"""PyTorch Lightning: ``ShmckptCheckpointIO``, a ``CheckpointIO`` plugin that saves
Lightning's checkpoints through shmckpt.

    trainer = lightning.Trainer(plugins=[ShmckptCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")

Each checkpoint Lightning asks for at ``DIR/NAME.ckpt`` is saved as a shmckpt checkpoint
``DIR/step-N/`` (committed atomically by the engine, one safetensors file and
``manifest.json``), and ``DIR/NAME.ckpt`` becomes a symbolic link to ``step-N`` once that
checkpoint is committed (until then a new name holds a small reservation file, so that the
path exists when ``save_checkpoint`` returns). Lightning's ``ModelCheckpoint`` keeps
deciding which paths exist (top-k, ``last``) and removes them through :meth:`ShmckptCheckpointIO.remove_checkpoint`,
which removes the link and the step. See ``docs/lightning.md``.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from typing import Any, Callable, Dict, Optional, Set, Tuple, Type, TypeVar

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shmckpt.lightning needs PyTorch Lightning: pip install lightning"
    ) from e

from . import _named, _shmckpt
from .checkpointer import Checkpointer
from .config import TUNING_FIELDS, Tuning, tuning_of
from .errors import NotFound

__all__ = ["ShmckptCheckpointIO", "load_from_checkpoint", "to_torch_file"]

M = TypeVar("M")

#: Metadata key recording the Lightning file name a shmckpt step was saved for.
PATH_KEY = _named.PATH_KEY


def _local(path: Any) -> str:
    """The absolute local path of a Lightning checkpoint path. A URL is refused
    (``ValueError`` naming it): it is never taken for a local path (``s3://b/x`` is not
    ``./s3:/b/x``). ``file://`` and ``shmckpt://`` URLs are local paths."""
    return _named.local_path(path)


def _split(path: Any) -> Tuple[str, str]:
    """(directory, name) of a Lightning checkpoint path, absolute (see :func:`_local`)."""
    return os.path.split(_local(path))


_load_step = _named.load_step


#: Every plugin of this process: a load waits for the saves all of them have queued.
_PLUGINS: "weakref.WeakSet[ShmckptCheckpointIO]" = weakref.WeakSet()


def _wait_for_plugins(exclude: Optional["ShmckptCheckpointIO"] = None) -> None:
    for io in list(_PLUGINS):
        if io is not exclude:
            concurrent.futures.wait(list(io._queued))


#: The engine's lock file of rank 0 in a checkpoint root (``lock_name`` in src/commit.rs):
#: held (``flock``) by the open engine of the directory, removed by ``teardown``.
RANK_LOCK = ".shmckpt-rank-0.lock"


def _remove_rank_lock(d: str) -> None:
    """Remove ``d``'s rank lock file once its engine is closed, so that Lightning's
    directory holds only checkpoints. Done as an engine takes it: opened without following
    a link, locked exclusively without waiting, and unlinked only while locked and only if
    the path is still that file. Left as it is when anyone else holds it (another engine
    of the directory, or ``shmckpt recover`` / ``shm`` probing it): it is theirs."""
    import fcntl
    import stat

    p = os.path.join(d, RANK_LOCK)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # missing, or a link (never the engine's): left as it is
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        held = os.fstat(fd)
        try:
            now = os.lstat(p)
        except FileNotFoundError:
            return
        if stat.S_ISREG(held.st_mode) and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            os.unlink(p)
    finally:
        os.close(fd)


class ShmckptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through shmckpt without blocking the
    training loop: ``Trainer(plugins=[ShmckptCheckpointIO()])``.

    ``save_checkpoint`` captures the checkpoint dict at the call (tensors copied to host
    memory, plain values serialized), reserves ``DIR/NAME.ckpt`` when that name is new (a
    small regular file, so that the path exists as ``ModelCheckpoint`` checks when it picks
    a free name) and returns; the engine writes and commits it in the background, and a
    worker thread of this plugin then publishes ``DIR/NAME.ckpt`` as a link to the
    committed ``DIR/step-N`` (replacing the reservation, or replacing, then removing, the
    step an earlier save of the same name published; a step some other name still names
    is never removed). ``remove_checkpoint`` runs on the same worker, after
    every save queued before it. ``load_checkpoint`` waits for that worker, then loads the
    step the link names (every CRC-32C verified); a path that is a regular file is loaded
    with Lightning's ``TorchCheckpointIO`` (checkpoints written before the switch).
    ``teardown`` (Lightning calls it at the end of ``fit``) waits for every save to be
    committed and published, closes the engines and raises the first error of a save
    (an error is also raised by the next ``save_checkpoint``).

    ``tuning`` (a :class:`shmckpt.Tuning`), ``recover_on_open`` and ``keep_in_memory``
    are the :class:`shmckpt.Checkpointer` settings of the same names, checked here (any
    other keyword is a ``TypeError`` naming it and listing these); the
    checkpointer of a directory is opened on its first save (rank 0 of 1: Lightning saves
    on global rank zero only). Loads open no engine, so every rank of a DDP job loads at
    once.
    """

    #: The keyword arguments of the constructor: :class:`shmckpt.Checkpointer` settings
    #: (the :class:`shmckpt.Tuning` fields as flat keywords are those of earlier versions,
    #: accepted with a ``DeprecationWarning``).
    SETTINGS = TUNING_FIELDS + ("recover_on_open", "keep_in_memory", "tuning")

    def __init__(
        self,
        *,
        tuning: Optional[Tuning] = None,
        recover_on_open: Optional[bool] = None,
        keep_in_memory: bool = False,
        **unknown: Any,
    ) -> None:
        for k in unknown:
            if k in TUNING_FIELDS:
                continue
            why = (
                " (Lightning saves on rank zero and decides retention through ModelCheckpoint)"
                if k in ("rank", "world_size", "keep_last")
                else ""
            )
            raise TypeError(
                f"ShmckptCheckpointIO: unknown setting {k!r}{why}; the settings are "
                f"{', '.join(self.SETTINGS)}"
            )
        #: The engine settings of its checkpointers.
        self._tuning = tuning_of("ShmckptCheckpointIO", tuning, unknown, self.SETTINGS)
        self._recover_on_open = recover_on_open
        self._keep_in_memory = bool(keep_in_memory)
        #: The settings given, flat (what ``repr`` and the tests compare).
        self._settings: Dict[str, Any] = dict(self._tuning.given())
        if recover_on_open is not None:
            self._settings["recover_on_open"] = recover_on_open
        self._settings["keep_in_memory"] = self._keep_in_memory
        self._cks: Dict[str, Checkpointer] = {}
        self._next: Dict[str, int] = {}
        #: ``(directory, step)`` of the saves not published yet: never removed meanwhile.
        self._inflight: Set[Tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._queued: list = []
        self._error: Optional[BaseException] = None
        _PLUGINS.add(self)

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled as its settings (``torch.save(trainer)``, a spawned process): a copy is
        a new plugin with the same settings, without the engines, saves or worker."""
        return {
            "tuning": self._tuning,
            "recover_on_open": self._recover_on_open,
            "keep_in_memory": self._keep_in_memory,
        }

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "settings" in state:  # pickled by an earlier version: flat settings
            self.__init__(**state["settings"])  # type: ignore[misc]
        else:
            self.__init__(**state)  # type: ignore[misc]

    # -- internals ------------------------------------------------------------------------
    def _checkpointer(self, d: str) -> Checkpointer:
        with self._lock:
            ck = self._cks.get(d)
            if ck is None:
                ck = Checkpointer(
                    d,
                    rank=0,
                    world_size=1,
                    tuning=self._tuning,
                    recover_on_open=self._recover_on_open,
                    keep_in_memory=self._keep_in_memory,
                )
                self._cks[d] = ck
                # After every committed step and every step a name still names (a
                # reservation an earlier process left): no step is saved twice.
                taken = [s for s in (ck.latest(), *_shmckpt.linked_steps(d)) if s is not None]
                self._next[d] = max(taken) + 1 if taken else 0
            return ck

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="shmckpt-lightning"
            )

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # kept and raised on the trainer's thread
                if self._error is None:
                    self._error = e
                raise

        self._queued.append(self._worker.submit(run))

    def _raise_error(self) -> None:
        e = self._error
        if e is not None:
            self._error = None
            raise e

    def _drain(self) -> None:
        """Wait for everything queued on the worker (errors are kept in ``_error``)."""
        queued, self._queued = self._queued, []
        concurrent.futures.wait(queued)

    def _wait_others(self) -> None:
        """Wait for the saves and removals queued by every other plugin of this process
        (a checkpoint saved by one Trainer and loaded by the next: it is published first;
        their errors stay theirs)."""
        _wait_for_plugins(exclude=self)

    def _publish(self, ck: Checkpointer, d: str, name: str, step: int, handle: Any) -> None:
        try:
            try:
                handle.wait()  # durable and committed
            except BaseException:
                # Never committed: the name no longer reserved for it (unless published meanwhile).
                if _shmckpt.resolve_name(d, name) == (step, name):
                    _shmckpt.unlink_name(d, name)
                raise
            old = _shmckpt.link_step(d, name, step)  # atomic and durable (shmckpt::links)
        finally:
            with self._lock:
                self._inflight.discard((d, step))
        if old is not None and old != step:
            self._release(ck, d, old)

    def _release(self, ck: Checkpointer, d: str, step: int) -> None:
        """Remove ``step`` unless a name still names it (a link or a reservation) or a save
        of it is still in flight (a name this worker has not published yet)."""
        with self._lock:
            if (d, step) in self._inflight:
                return
        if step in _shmckpt.linked_steps(d):
            return
        try:
            ck.remove(step)
        except NotFound:
            pass

    def _remove(self, d: str, name: str) -> None:
        step = _shmckpt.unlink_name(d, name)
        if step is not None:
            self._release(self._checkpointer(d), d, step)

    # -- CheckpointIO -----------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Save Lightning's checkpoint dict as ``path`` without waiting for the disk.

        Returns once the state is captured, ``path`` existing: a new name is reserved at
        once (a small regular file), and becomes a link to the committed ``step-N`` beside
        it when the checkpoint is durable (a name saved before keeps naming its earlier
        step until then). Values the shmckpt format cannot hold raise ``TypeError`` naming
        their key path before anything is written (see ``docs/lightning.md``). A URL
        (``s3://``, ``memory://``) is refused (``ValueError``). ``storage_options`` is not
        supported.
        """
        if storage_options is not None:
            raise TypeError(
                "Trainer.save_checkpoint(..., storage_options=...) is not supported by ShmckptCheckpointIO"
            )
        self._raise_error()
        d, name = _split(path)
        _shmckpt.linked_step(d, name)  # refuses a name that is not one of ours to give
        ck = self._checkpointer(d)
        with self._lock:
            step = self._next[d]
            self._next[d] = step + 1
        handle = ck.save(step, checkpoint, blocking=False, metadata={PATH_KEY: name})
        with self._lock:
            self._inflight.add((d, step))
        try:
            # The path exists from now on (ModelCheckpoint picks NAME-vN by existence).
            _shmckpt.reserve_name(d, name, step)
        finally:
            self._submit(self._publish, ck, d, name, step, handle)

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        """Load the checkpoint saved as ``path`` (after the saves queued before it, by any
        plugin of this process, are published), every CRC-32C verified, its manifest of the step the link names
        (``CorruptError`` naming both otherwise). A name reserved by a save that was not
        published (its process ended first) loads the step it was reserved for when that
        save committed, else ``NotFound`` says so. A ``step-N`` directory beside it loads
        that step. A regular file
        is loaded by Lightning's ``TorchCheckpointIO``. ``FileNotFoundError`` when ``path``
        does not exist. Tensors come back on the CPU (Lightning moves them where the model
        is); ``map_location`` applies to ``TorchCheckpointIO`` files only. No engine is
        opened: every process of a DDP job loads at once."""
        self._drain()
        self._raise_error()
        self._wait_others()
        state = _named.load_path(path)
        if state is None:  # a regular file: a torch.save checkpoint
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

            kw: Dict[str, Any] = {"weights_only": weights_only}
            if map_location is not None:
                kw["map_location"] = map_location
            return TorchCheckpointIO().load_checkpoint(_local(path), **kw)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint saved as ``path``: the link, then its step (unless another
        link still names it), on the worker after the saves queued before."""
        self._raise_error()
        d, name = _split(path)
        self._submit(self._remove, d, name)

    def teardown(self) -> None:
        """Wait until every save is committed and published, close the engines, and raise
        the first error a save or removal met."""
        self._drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        with self._lock:
            cks, self._cks = self._cks, {}
            self._next.clear()
        for d, ck in cks.items():
            ck.close()
            _remove_rank_lock(d)
        self._raise_error()


# -- outside a Trainer ----------------------------------------------------------------------


def load_from_checkpoint(cls: Type[M], path: Any, **kwargs: Any) -> M:
    """``cls.load_from_checkpoint(path, **kwargs)`` for a checkpoint the plugin saved as
    ``path`` (``DIR/NAME.ckpt``, a ``step-N`` directory, or a ``torch.save`` file):
    ``cls`` is a ``LightningModule`` or ``LightningDataModule`` class, ``kwargs`` those of
    Lightning's method (``map_location``, ``strict``, ``weights_only``, hyper-parameter
    overrides). Lightning's own method builds the object (hyper-parameters, weights,
    ``on_load_checkpoint``) from the checkpoint streamed as ``torch.save`` bytes
    (``shmckpt.fs``); every CRC-32C is verified. Equivalent to
    ``cls.load_from_checkpoint("shmckpt://" + abspath)``."""
    _wait_for_plugins()
    with _named.torch_stream(path) as f:
        return cls.load_from_checkpoint(f, **kwargs)  # type: ignore[attr-defined,no-any-return]


def to_torch_file(path: Any, out: Any) -> str:
    """Write the checkpoint the plugin saved as ``path`` to ``out`` as one ``torch.save``
    file, what ``torch.load``, ``LightningModule.load_from_checkpoint`` and tools outside
    shmckpt read (as Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` does for
    DeepSpeed directories). Every CRC-32C of the source is verified; ``out`` is written
    under a temporary name beside it, ``fsync``ed and renamed (its directory ``fsync``ed),
    so it is whole or absent. ``out`` may not be a plugin checkpoint, a link or a
    directory (``ValueError``: converting in place would replace the link the plugin
    manages). Returns ``out``'s absolute path."""
    dst = os.path.abspath(os.fspath(out))
    src = _local(path)
    if os.path.islink(dst) or os.path.isdir(dst):
        raise ValueError(f"to_torch_file: {dst} is a link or a directory; give a new file name")
    if os.path.exists(dst) and _named.named(dst) is not None:
        raise ValueError(f"to_torch_file: {dst} is a checkpoint of ShmckptCheckpointIO (a reservation)")
    if dst == src:
        raise ValueError(f"to_torch_file: {dst} is the checkpoint itself; give a new file name")
    d = os.path.dirname(dst)
    tmp = os.path.join(d, f".{os.path.basename(dst)}.tmp-{os.getpid()}")
    _wait_for_plugins()
    with _named.torch_stream(src) as f:
        try:
            with open(tmp, "xb") as w:
                while True:
                    b = f.read(8 << 20)
                    if not b:
                        break
                    w.write(b)
                w.flush()
                os.fsync(w.fileno())
            os.replace(tmp, dst)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return dst


def _register_protocol() -> None:
    """``shmckpt://`` for fsspec (the wheel's entry point does it too; this covers a source
    checkout on ``PYTHONPATH``, where no entry point is installed)."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - Lightning depends on fsspec
        return
    from .fs import ShmckptFileSystem

    fsspec.register_implementation("shmckpt", ShmckptFileSystem, clobber=True)


_register_protocol()
