//! Opening checkpoint files for direct I/O, with a buffered fallback, and fsync helpers.
#![deny(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use crate::error::{Error, Result};

/// A file being written or read, with an O_DIRECT descriptor when the filesystem allows it
/// and always a buffered one (for unaligned remainders and for the final `ftruncate`).
#[derive(Debug)]
pub struct FileTarget {
    path: PathBuf,
    direct: Option<OwnedFd>,
    buffered: OwnedFd,
}

impl FileTarget {
    /// Create `path` (it must not exist) for writing. With `direct`, try O_DIRECT first and
    /// fall back (logged) when the filesystem refuses it.
    pub fn create(path: &Path, direct: bool) -> Result<FileTarget> {
        let base = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC;
        let mode = Mode::from_raw_mode(0o644);
        let buffered = crate::fsops::open_create(path, base, mode)
            .map_err(|e| Error::io("create", path, e.into()))?;
        let direct = if direct {
            open_direct(path, OFlags::WRONLY | OFlags::CLOEXEC)?
        } else {
            None
        };
        Ok(FileTarget {
            path: path.to_owned(),
            direct,
            buffered,
        })
    }

    /// Open an existing file for reading, O_DIRECT when asked and allowed.
    pub fn open_read(path: &Path, direct: bool) -> Result<FileTarget> {
        let flags = OFlags::RDONLY | OFlags::CLOEXEC;
        let buffered = rustix::fs::open(path, flags, Mode::empty())
            .map_err(|e| Error::io("open", path, e.into()))?;
        let direct = if direct {
            open_direct(path, flags)?
        } else {
            None
        };
        Ok(FileTarget {
            path: path.to_owned(),
            direct,
            buffered,
        })
    }

    /// Whether an O_DIRECT descriptor is open.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The descriptor to use for a request at `offset` of `len` bytes from `buf`: the direct
    /// one when everything is aligned, else the buffered one.
    pub fn fd_for(&self, buf: *const u8, offset: u64, len: u64) -> RawFd {
        let a = super::DIRECT_ALIGN;
        match &self.direct {
            Some(d)
                if (buf as u64).is_multiple_of(a)
                    && offset.is_multiple_of(a)
                    && len.is_multiple_of(a) =>
            {
                d.as_raw_fd()
            }
            _ => self.buffered.as_raw_fd(),
        }
    }

    /// Reserve `len` bytes on disk, so a full disk fails here and not halfway through the
    /// writes. Filesystems without `fallocate` are accepted silently.
    pub fn preallocate(&self, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        match crate::fsops::fallocate(self.buffered.as_fd(), len) {
            Ok(()) => Ok(()),
            Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => Ok(()),
            Err(e) => Err(Error::io("fallocate", &self.path, e.into())),
        }
    }

    /// Set the exact length and make data and length durable (`ftruncate` + `fdatasync`).
    pub fn finish(&self, len: u64) -> Result<()> {
        crate::fsops::ftruncate(self.buffered.as_fd(), len)
            .map_err(|e| Error::io("ftruncate", &self.path, e.into()))?;
        crate::fsops::fdatasync(self.buffered.as_fd())
            .map_err(|e| Error::io("fdatasync", &self.path, e.into()))
    }

    /// Current file length.
    #[allow(clippy::len_without_is_empty)] // a fallible fstat, not a container length
    pub fn len(&self) -> Result<u64> {
        rustix::fs::fstat(&self.buffered)
            .map(|s| s.st_size as u64)
            .map_err(|e| Error::io("fstat", &self.path, e.into()))
    }
}

fn open_direct(path: &Path, flags: OFlags) -> Result<Option<OwnedFd>> {
    match rustix::fs::open(path, flags | OFlags::DIRECT, Mode::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(e) if e == rustix::io::Errno::INVAL => {
            tracing::warn!(path = %path.display(), "filesystem refuses O_DIRECT; using buffered I/O + fdatasync");
            Ok(None)
        }
        Err(e) => Err(Error::io("open(O_DIRECT)", path, e.into())),
    }
}

/// `fsync` a directory so that entries created, renamed or removed in it are durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let f = File::open(dir).map_err(|e| Error::io("open", dir, e))?;
    crate::fsops::fsync(f.as_fd()).map_err(|e| Error::io("fsync", dir, e.into()))
}

/// Write `bytes` to a new file `path` and make it durable (`fsync`).
pub fn write_durable(path: &Path, bytes: &[u8]) -> Result<()> {
    let f = crate::fsops::create_new_file(path).map_err(|e| Error::io("create", path, e))?;
    crate::fsops::write_all_at(&f, bytes, 0).map_err(|e| Error::io("write", path, e))?;
    crate::fsops::fsync_file(&f).map_err(|e| Error::io("fsync", path, e))
}
