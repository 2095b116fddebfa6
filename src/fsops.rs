//! The one funnel for what the engine changes in a checkpoint root: every creation,
//! write, `fallocate`, `ftruncate`, sync, rename and removal that saves, commits,
//! retention and recovery make goes through these functions (data writes of the write
//! backends go through `io::record` instead). They are thin wrappers over the system
//! calls; with the feature `fs-observer` they also show each call to the installed
//! [`FsObserver`](crate::observe::FsObserver) (the power-loss recorder of the tests, crate
//! `shmckpt-crashsim`, sees every operation in issue order: docs/crash.md). Without the
//! feature they compile to the bare calls.
#![forbid(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

#[cfg(feature = "fs-observer")]
use crate::observe::FsOp;

/// Make the call `$f` (a closure), shown to the filesystem observer as `$op` with the
/// feature `fs-observer`; the bare call without it.
macro_rules! funnel {
    ($op:expr, $f:expr) => {{
        #[cfg(feature = "fs-observer")]
        let r = crate::observe::around(|| $op, $f);
        #[cfg(not(feature = "fs-observer"))]
        let r = $f();
        r
    }};
}

/// `mkdir path` (mode 0755 less the umask).
pub fn create_dir(path: &Path) -> io::Result<()> {
    funnel!(FsOp::Create { path, dir: true }, || std::fs::create_dir(
        path
    ))
}

/// `mkdirat(dir, name, mode)`.
pub fn mkdir_at(dir: BorrowedFd<'_>, name: &str, mode: rustix::fs::Mode) -> rustix::io::Result<()> {
    funnel!(
        FsOp::CreateAt {
            parent: dir,
            name,
            dir: true
        },
        || rustix::fs::mkdirat(dir, name, mode)
    )
}

/// Open `path` with `flags`, which include `O_CREAT` (the creation is what is funnelled).
pub fn open_create(
    path: &Path,
    flags: rustix::fs::OFlags,
    mode: rustix::fs::Mode,
) -> rustix::io::Result<OwnedFd> {
    funnel!(FsOp::Create { path, dir: false }, || rustix::fs::open(
        path, flags, mode
    ))
}

/// Open the entry `name` of `dir` with `open`, which may create it (`O_CREAT`).
pub fn open_create_at<T, E>(
    dir: BorrowedFd<'_>,
    name: &str,
    open: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    #[cfg(not(feature = "fs-observer"))]
    let _ = (dir, name);
    funnel!(
        FsOp::CreateAt {
            parent: dir,
            name,
            dir: false
        },
        open
    )
}

/// Create the new file `path` (`O_CREAT | O_EXCL`, write-only).
pub fn create_new_file(path: &Path) -> io::Result<File> {
    funnel!(FsOp::Create { path, dir: false }, || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
    })
}

/// `unlinkat(dir, name, 0)`.
pub fn unlink_at(dir: BorrowedFd<'_>, name: &str) -> rustix::io::Result<()> {
    funnel!(FsOp::RemoveAt { parent: dir, name }, || {
        rustix::fs::unlinkat(dir, name, rustix::fs::AtFlags::empty())
    })
}

/// `unlink path`.
pub fn remove_file(path: &Path) -> io::Result<()> {
    funnel!(FsOp::Remove { path }, || std::fs::remove_file(path))
}

/// `rmdir path`.
pub fn remove_dir(path: &Path) -> io::Result<()> {
    funnel!(FsOp::Remove { path }, || std::fs::remove_dir(path))
}

/// Remove the tree `path` (links inside are removed, never followed).
pub fn remove_dir_all(path: &Path) -> io::Result<()> {
    funnel!(FsOp::RemoveTree { path }, || std::fs::remove_dir_all(path))
}

/// `rename(from, to)`.
pub fn rename(from: &Path, to: &Path) -> io::Result<()> {
    funnel!(FsOp::Rename { from, to }, || std::fs::rename(from, to))
}

/// `fsync(fd)`: a file's data and metadata, or a directory's entries.
pub fn fsync(fd: BorrowedFd<'_>) -> rustix::io::Result<()> {
    funnel!(
        FsOp::Sync {
            fd,
            data_only: false
        },
        || rustix::fs::fsync(fd)
    )
}

/// `fdatasync(fd)`: a file's data and size.
pub fn fdatasync(fd: BorrowedFd<'_>) -> rustix::io::Result<()> {
    funnel!(
        FsOp::Sync {
            fd,
            data_only: true
        },
        || rustix::fs::fdatasync(fd)
    )
}

/// `ftruncate(fd, len)`.
pub fn ftruncate(fd: BorrowedFd<'_>, len: u64) -> rustix::io::Result<()> {
    funnel!(FsOp::Truncate { fd, len }, || rustix::fs::ftruncate(
        fd, len
    ))
}

/// `fallocate(fd, 0, 0, len)`.
pub fn fallocate(fd: BorrowedFd<'_>, len: u64) -> rustix::io::Result<()> {
    funnel!(FsOp::Fallocate { fd, offset: 0, len }, || {
        rustix::fs::fallocate(fd, rustix::fs::FallocateFlags::empty(), 0, len)
    })
}

/// Write all of `buf` at `offset` of `file` (`pwrite`, repeated until done).
pub fn write_all_at(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    funnel!(
        FsOp::Write {
            fd: file.as_fd(),
            offset,
            data: buf
        },
        || file.write_all_at(buf, offset)
    )
}

/// `fsync` of the open directory or file `file`.
pub fn fsync_file(file: &File) -> io::Result<()> {
    fsync(file.as_fd()).map_err(io::Error::from)
}

/// `fdatasync` of the open file `file`.
pub fn fdatasync_file(file: &File) -> io::Result<()> {
    fdatasync(file.as_fd()).map_err(io::Error::from)
}

/// `ftruncate` of the open file `file`.
pub fn set_len(file: &File, len: u64) -> io::Result<()> {
    ftruncate(file.as_fd(), len).map_err(io::Error::from)
}
