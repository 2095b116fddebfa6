//! Opening files inside a directory that other users may write (a checkpoint root,
//! `/dev/shm`) without being turned against the caller: every open is relative to a
//! directory fd, never follows a symbolic link (`openat2` with `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS` where the kernel has it, else `openat` with `O_NOFOLLOW` on a single
//! name), never blocks (`O_NONBLOCK`, so a FIFO cannot hang us), and checks with `fstat` on
//! the opened fd that the file is a regular file (and, where asked, the caller's own) before
//! a byte is read or written.
//!
//! The directory itself is opened as named by the caller (the checkpoint root is the user's
//! choice); what lies inside it is not trusted.
#![forbid(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// How to treat a missing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Create {
    /// It must exist.
    No,
    /// Create it if missing (`O_CREAT`), else open the existing regular file.
    IfMissing,
    /// It must not exist (`O_CREAT | O_EXCL`).
    New,
}

/// Open the directory `path` (following the path as given: it is the caller's choice).
pub(crate) fn open_dir(path: &Path) -> Result<OwnedFd> {
    rustix::fs::open(
        path,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io("open", path, e.into()))
}

/// A name of one directory entry: not empty, no slash, not `.` or `..`.
fn check_name(dir_path: &Path, name: &str) -> Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(Error::UnsafePath {
            path: dir_path.join(name),
            reason: "not a plain file name".into(),
        });
    }
    Ok(())
}

/// `openat` of the single entry `name` of `dir` that never follows a symbolic link.
fn openat_nofollow(
    dir: BorrowedFd<'_>,
    name: &str,
    flags: OFlags,
    mode: Mode,
) -> rustix::io::Result<OwnedFd> {
    let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY;
    // openat2 refuses a mode without O_CREAT.
    let mode = if flags.contains(OFlags::CREATE) {
        mode
    } else {
        Mode::empty()
    };
    match rustix::fs::openat2(
        dir,
        name,
        flags,
        mode,
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    ) {
        Err(Errno::NOSYS) | Err(Errno::PERM) | Err(Errno::INVAL) => {
            rustix::fs::openat(dir, name, flags, mode)
        }
        // openat2 retries on EAGAIN when the rename seqlock moved; fall back rather than spin.
        Err(Errno::AGAIN) => rustix::fs::openat(dir, name, flags, mode),
        other => other,
    }
}

fn open_error(op: &'static str, path: PathBuf, e: Errno) -> Error {
    if e == Errno::LOOP || e == Errno::XDEV {
        Error::UnsafePath {
            path,
            reason: "is a symbolic link (shmckpt never follows links here)".into(),
        }
    } else {
        Error::io(op, path, e.into())
    }
}

/// Open the directory `name` inside `dir` (never following a link).
pub(crate) fn open_subdir(dir: BorrowedFd<'_>, dir_path: &Path, name: &str) -> Result<OwnedFd> {
    check_name(dir_path, name)?;
    let path = dir_path.join(name);
    let fd = openat_nofollow(dir, name, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty())
        .map_err(|e| {
            if e == Errno::NOTDIR {
                Error::UnsafePath {
                    path: path.clone(),
                    reason: "is not a directory".into(),
                }
            } else {
                open_error("open", path.clone(), e)
            }
        })?;
    Ok(fd)
}

/// Create the directory `name` inside `dir` (fails if anything of that name exists).
pub(crate) fn mkdir_in(dir: BorrowedFd<'_>, dir_path: &Path, name: &str) -> Result<()> {
    check_name(dir_path, name)?;
    crate::fsops::mkdir_at(dir, name, Mode::from_raw_mode(0o755))
        .map_err(|e| Error::io("mkdir", dir_path.join(name), e.into()))
}

/// What kind of thing an `fstat` mode describes, for messages.
fn kind_of(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "of an unknown type",
    }
}

/// Check that `fd` (opened from `path`) is a regular file, owned by `uid` when given.
/// Returns its size and the blocks it occupies, in bytes.
pub(crate) fn check_regular(
    fd: BorrowedFd<'_>,
    path: &Path,
    uid: Option<u32>,
) -> Result<(u64, u64)> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::io("fstat", path, e.into()))?;
    let mode = st.st_mode;
    if mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Error::UnsafePath {
            path: path.to_owned(),
            reason: format!("is {}, not a regular file", kind_of(mode)),
        });
    }
    if let Some(want) = uid
        && st.st_uid != want
    {
        return Err(Error::UnsafePath {
            path: path.to_owned(),
            reason: format!("belongs to uid {}, not to uid {want}", st.st_uid),
        });
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    let blocks = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
    Ok((size, blocks))
}

/// Open the regular file `name` inside `dir`: never through a link, never blocking, and
/// refused unless `fstat` says it is a regular file (owned by `uid` when given).
pub(crate) fn open_file(
    dir: BorrowedFd<'_>,
    dir_path: &Path,
    name: &str,
    write: bool,
    create: Create,
    uid: Option<u32>,
) -> Result<File> {
    check_name(dir_path, name)?;
    let path = dir_path.join(name);
    let mut flags = if write { OFlags::RDWR } else { OFlags::RDONLY } | OFlags::NONBLOCK;
    match create {
        Create::No => {}
        Create::IfMissing => flags |= OFlags::CREATE,
        Create::New => flags |= OFlags::CREATE | OFlags::EXCL,
    }
    let open = || openat_nofollow(dir, name, flags, Mode::from_raw_mode(0o644));
    let fd = if create == Create::No {
        open()
    } else {
        crate::fsops::open_create_at(dir, name, open)
    }
    .map_err(|e| open_error("open", path.clone(), e))?;
    check_regular(fd.as_fd(), &path, uid)?;
    // Regular files ignore O_NONBLOCK for reads and writes, but clear it all the same.
    if let Ok(fl) = rustix::fs::fcntl_getfl(&fd) {
        let _ = rustix::fs::fcntl_setfl(&fd, fl - OFlags::NONBLOCK);
    }
    Ok(File::from(fd))
}

/// Open the regular file at `path` (its last component is never followed, nor blocked on).
pub(crate) fn open_path(path: &Path, write: bool) -> Result<File> {
    let (dir_path, name) = split(path)?;
    let dir = open_dir(&dir_path)?;
    open_file(dir.as_fd(), &dir_path, &name, write, Create::No, None)
}

fn split(path: &Path) -> Result<(PathBuf, String)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::UnsafePath {
            path: path.to_owned(),
            reason: "has no UTF-8 file name".into(),
        })?
        .to_owned();
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    Ok((dir, name))
}

/// Remove the entry `name` of `dir` if it is not a directory (a link is removed, never
/// followed). Missing is fine.
pub(crate) fn unlink_in(dir: BorrowedFd<'_>, dir_path: &Path, name: &str) -> Result<()> {
    check_name(dir_path, name)?;
    match crate::fsops::unlink_at(dir, name) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(Error::io("unlink", dir_path.join(name), e.into())),
    }
}

/// What `lstat` says the entry `name` of `dir` is: `None` when missing.
pub(crate) fn entry_kind(dir: BorrowedFd<'_>, dir_path: &Path, name: &str) -> Result<Option<u32>> {
    check_name(dir_path, name)?;
    match rustix::fs::statat(dir, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st.st_mode & libc::S_IFMT)),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(Error::io("stat", dir_path.join(name), e.into())),
    }
}
