//! Observing what the engine changes in checkpoint roots (feature `fs-observer`).
//!
//! Every creation, write, `fallocate`, `ftruncate`, sync, rename and removal that saves,
//! commits, retention and recovery make in a root goes through one funnel in the crate;
//! with this feature, each of those calls is shown to the installed [`FsObserver`]
//! *around* the system call ([`FsObserver::around`]: the observer runs the call itself,
//! so it can look at the filesystem before and after it and order the calls of every
//! thread), each data write a write backend completes is reported with its bytes
//! ([`FsObserver::written`]), and so is each save the engine reports committed to its
//! caller ([`FsObserver::committed`]). The power-loss recorder of the tests (crate
//! `shmckpt-crashsim`, docs/crash.md) is such an observer.
//!
//! Without the feature none of this is compiled: the funnel is the bare system calls.
#![forbid(unsafe_code)]

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::OnceLock;

/// One filesystem mutation of the engine, as [`FsObserver::around`] sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum FsOp<'a> {
    /// Create `path`: a directory when `dir` (`mkdir`), else a file (`O_CREAT`). The call
    /// may find it already there.
    Create {
        /// The path.
        path: &'a Path,
        /// Whether a directory is created.
        dir: bool,
    },
    /// Create the entry `name` of the open directory `parent` (`mkdirat`, `openat` with
    /// `O_CREAT`).
    CreateAt {
        /// The directory.
        parent: BorrowedFd<'a>,
        /// The entry.
        name: &'a str,
        /// Whether a directory is created.
        dir: bool,
    },
    /// Remove the file or empty directory `path` (`unlink`, `rmdir`).
    Remove {
        /// The path.
        path: &'a Path,
    },
    /// Remove the entry `name` of the open directory `parent` (`unlinkat`).
    RemoveAt {
        /// The directory.
        parent: BorrowedFd<'a>,
        /// The entry.
        name: &'a str,
    },
    /// Remove the tree `path` (links inside are removed, never followed).
    RemoveTree {
        /// The tree's root.
        path: &'a Path,
    },
    /// `rename(from, to)`.
    Rename {
        /// The old path.
        from: &'a Path,
        /// The new path.
        to: &'a Path,
    },
    /// `fsync(fd)`, or `fdatasync(fd)` when `data_only`.
    Sync {
        /// The file or directory.
        fd: BorrowedFd<'a>,
        /// `fdatasync` rather than `fsync`.
        data_only: bool,
    },
    /// `ftruncate(fd, len)`.
    Truncate {
        /// The file.
        fd: BorrowedFd<'a>,
        /// The new length.
        len: u64,
    },
    /// `fallocate(fd, 0, offset, len)`.
    Fallocate {
        /// The file.
        fd: BorrowedFd<'a>,
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// Write all of `data` at `offset` of `fd` (`pwrite` of the funnel; the backends'
    /// writes are [`FsObserver::written`]).
    Write {
        /// The file.
        fd: BorrowedFd<'a>,
        /// Where.
        offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
}

/// What the engine's filesystem mutations are shown to (see the [module](self) docs).
/// Installed once per process with [`install`].
pub trait FsObserver: Send + Sync {
    /// `op` is to be made: call `run` exactly once, which makes the system call and
    /// returns whether it succeeded. An observer that does not call it has the call made
    /// right after it returns.
    fn around(&self, op: &FsOp<'_>, run: &mut dyn FnMut() -> bool);

    /// Whether the write backends should track their writes for [`FsObserver::written`]
    /// now (checked once per write request: keep it cheap).
    fn tracking_writes(&self) -> bool;

    /// A write backend completed a write: `data` reached `fd` at `offset`.
    fn written(&self, fd: BorrowedFd<'_>, offset: u64, data: &[u8]);

    /// The engine reported step `step` of `root` committed to its caller.
    fn committed(&self, root: &Path, step: u64);
}

static OBSERVER: OnceLock<&'static dyn FsObserver> = OnceLock::new();

/// Install `observer` for the rest of the process. Only the first call installs one: it
/// returns whether `observer` is the one installed.
pub fn install(observer: &'static dyn FsObserver) -> bool {
    let mut ours = false;
    OBSERVER.get_or_init(|| {
        ours = true;
        observer
    });
    ours
}

/// The installed observer.
pub(crate) fn observer() -> Option<&'static dyn FsObserver> {
    OBSERVER.get().copied()
}

/// Make the call `f`, shown to the observer as `op` (built only when there is one).
pub(crate) fn around<'a, T, E>(
    op: impl FnOnce() -> FsOp<'a>,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let Some(obs) = observer() else { return f() };
    let mut f = Some(f);
    let mut out = None;
    obs.around(&op(), &mut || match f.take() {
        Some(f) => {
            let r = f();
            let ok = r.is_ok();
            out = Some(r);
            ok
        }
        None => out.as_ref().is_some_and(Result::is_ok),
    });
    match (out, f) {
        (Some(r), _) => r,
        (None, Some(f)) => f(),
        (None, None) => unreachable!("the call ran and left its result"),
    }
}
