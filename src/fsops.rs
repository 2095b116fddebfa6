//! The one funnel for what the engine changes in a checkpoint root: every creation,
//! write, `fallocate`, `ftruncate`, sync, rename and removal that saves, commits,
//! retention and recovery make goes through these functions (data writes of the write
//! backends go through `io::record` instead). They are thin wrappers over the system
//! calls; with the test-only feature `crash-record` they also report each call to the
//! power-loss recorder (`crate::crashsim::record`), so a test sees every operation in issue
//! order (docs/crash.md). Without the feature they compile to the bare calls.
#![forbid(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

#[cfg(feature = "crash-record")]
use crate::crashsim::record as rec;

/// `mkdir path` (mode 0755 less the umask).
pub fn create_dir(path: &Path) -> io::Result<()> {
    let f = || std::fs::create_dir(path);
    #[cfg(feature = "crash-record")]
    let f = || rec::create_path(path, true, f);
    f()
}

/// `mkdirat(dir, name, mode)`.
pub fn mkdir_at(dir: BorrowedFd<'_>, name: &str, mode: rustix::fs::Mode) -> rustix::io::Result<()> {
    let f = || rustix::fs::mkdirat(dir, name, mode);
    #[cfg(feature = "crash-record")]
    let f = || rec::create_at(dir, name, true, f);
    f()
}

/// Open `path` with `flags`, which include `O_CREAT` (the creation is what is funnelled).
pub fn open_create(
    path: &Path,
    flags: rustix::fs::OFlags,
    mode: rustix::fs::Mode,
) -> rustix::io::Result<OwnedFd> {
    let f = || rustix::fs::open(path, flags, mode);
    #[cfg(feature = "crash-record")]
    let f = || rec::create_path(path, false, f);
    f()
}

/// Open the entry `name` of `dir` with `open`, which may create it (`O_CREAT`).
pub fn open_create_at<T, E>(
    dir: BorrowedFd<'_>,
    name: &str,
    open: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    #[cfg(feature = "crash-record")]
    let open = || rec::create_at(dir, name, false, open);
    #[cfg(not(feature = "crash-record"))]
    let _ = (dir, name);
    open()
}

/// Create the new file `path` (`O_CREAT | O_EXCL`, write-only).
pub fn create_new_file(path: &Path) -> io::Result<File> {
    let f = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
    };
    #[cfg(feature = "crash-record")]
    let f = || rec::create_path(path, false, f);
    f()
}

/// `unlinkat(dir, name, 0)`.
pub fn unlink_at(dir: BorrowedFd<'_>, name: &str) -> rustix::io::Result<()> {
    let f = || rustix::fs::unlinkat(dir, name, rustix::fs::AtFlags::empty());
    #[cfg(feature = "crash-record")]
    let f = || rec::remove_at(dir, name, f);
    f()
}

/// `unlink path`.
pub fn remove_file(path: &Path) -> io::Result<()> {
    let f = || std::fs::remove_file(path);
    #[cfg(feature = "crash-record")]
    let f = || rec::remove_path(path, f);
    f()
}

/// `rmdir path`.
pub fn remove_dir(path: &Path) -> io::Result<()> {
    let f = || std::fs::remove_dir(path);
    #[cfg(feature = "crash-record")]
    let f = || rec::remove_path(path, f);
    f()
}

/// Remove the tree `path` (links inside are removed, never followed).
pub fn remove_dir_all(path: &Path) -> io::Result<()> {
    let f = || std::fs::remove_dir_all(path);
    #[cfg(feature = "crash-record")]
    let f = || rec::remove_tree(path, f);
    f()
}

/// `rename(from, to)`.
pub fn rename(from: &Path, to: &Path) -> io::Result<()> {
    let f = || std::fs::rename(from, to);
    #[cfg(feature = "crash-record")]
    let f = || rec::rename(from, to, f);
    f()
}

/// `fsync(fd)`: a file's data and metadata, or a directory's entries.
pub fn fsync(fd: BorrowedFd<'_>) -> rustix::io::Result<()> {
    let f = || rustix::fs::fsync(fd);
    #[cfg(feature = "crash-record")]
    let f = || rec::sync_fd(fd, false, f);
    f()
}

/// `fdatasync(fd)`: a file's data and size.
pub fn fdatasync(fd: BorrowedFd<'_>) -> rustix::io::Result<()> {
    let f = || rustix::fs::fdatasync(fd);
    #[cfg(feature = "crash-record")]
    let f = || rec::sync_fd(fd, true, f);
    f()
}

/// `ftruncate(fd, len)`.
pub fn ftruncate(fd: BorrowedFd<'_>, len: u64) -> rustix::io::Result<()> {
    let f = || rustix::fs::ftruncate(fd, len);
    #[cfg(feature = "crash-record")]
    let f = || rec::truncate_fd(fd, len, f);
    f()
}

/// `fallocate(fd, 0, 0, len)`.
pub fn fallocate(fd: BorrowedFd<'_>, len: u64) -> rustix::io::Result<()> {
    let f = || rustix::fs::fallocate(fd, rustix::fs::FallocateFlags::empty(), 0, len);
    #[cfg(feature = "crash-record")]
    let f = || rec::fallocate_fd(fd, 0, len, f);
    f()
}

/// Write all of `buf` at `offset` of `file` (`pwrite`, repeated until done).
pub fn write_all_at(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    let f = || file.write_all_at(buf, offset);
    #[cfg(feature = "crash-record")]
    let f = || rec::write_fd(file.as_fd(), offset, buf, f);
    f()
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
