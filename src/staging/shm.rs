//! POSIX shared-memory segments: the only place that maps staging memory.
//!
//! A segment is created with `shm_open(O_CREAT|O_EXCL)` and either sized with `fallocate`
//! (which reserves every page in tmpfs up front, so a too-small `/dev/shm` is an `ENOSPC`
//! here and never a `SIGBUS` later) and mapped `MAP_SHARED|MAP_POPULATE` (pre-faulted), or
//! sized with `ftruncate`, mapped without pre-faulting and allocated range by range with
//! [`Segment::populate`] before anything touches it (the background prefault of
//! `Arena::create_prefaulting`). Unlinked by its owner on clean shutdown.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::io;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;

use rustix::fs::{FallocateFlags, Mode};
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};

/// Mount where POSIX shared memory lives on Linux.
pub const SHM_MOUNT: &str = "/dev/shm";

/// A mapped shared-memory segment (or an anonymous mapping for private buffers).
///
/// A named segment is mapped at most once in a process at a time (see [`MAPPED_HERE`]): the
/// arena built on it, and the chunk leases it hands out, are then the only Rust handles to
/// its bytes in this process.
#[derive(Debug)]
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    name: Option<String>,
    /// `(device, inode)` of a named segment, registered in [`MAPPED_HERE`] while mapped.
    id: Option<(u64, u64)>,
    _fd: Option<OwnedFd>,
}

/// `(device, inode)` of every named segment this process maps now, from its mapping until
/// the `Segment` drops. Mapping one segment twice in one process would give two arenas over
/// the same bytes, each handing out a unique `&mut` to the same chunk: `map_named` refuses
/// a segment already here. (The unlinked name of a segment still mapped cannot be reused
/// for the same inode, so a new segment of the same name is a different key.)
static MAPPED_HERE: std::sync::Mutex<std::collections::BTreeSet<(u64, u64)>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

// SAFETY: a `Segment` is an owned mapping; the raw pointer is not tied to the creating
// thread. Access to the bytes is coordinated by the arena's chunk leases.
unsafe impl Send for Segment {}
// SAFETY: `&Segment` hands out only the pointer and length; writes go through leases that are
// unique per chunk.
unsafe impl Sync for Segment {}

impl Segment {
    /// Create a new named segment of `len` bytes (a multiple of the page size), reserving
    /// and pre-faulting all of it. `name` is the shm name without the leading slash.
    pub fn create(name: &str, len: usize) -> Result<Segment> {
        let shm_name = format!("/{name}");
        let fd = rustix::shm::open(
            shm_name.as_str(),
            rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| Error::Shm {
            name: name.to_owned(),
            op: "shm_open",
            source: e.into(),
        })?;
        // Any failure from here on must not leave the name behind.
        let cleanup = |err: Error| {
            let _ = rustix::shm::unlink(shm_name.as_str());
            err
        };
        if let Err(e) = rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64) {
            let err = if e == rustix::io::Errno::NOSPC || e == rustix::io::Errno::NOMEM {
                Error::ShmTooSmall {
                    name: name.to_owned(),
                    requested: len as u64,
                    available: shm_available(),
                    mount: SHM_MOUNT.to_owned(),
                }
            } else {
                Error::Shm {
                    name: name.to_owned(),
                    op: "fallocate",
                    source: e.into(),
                }
            };
            return Err(cleanup(err));
        }
        Segment::map_named(name, fd, len).map_err(cleanup)
    }

    /// Create a new named segment of `len` bytes (a multiple of the page size) with no page
    /// allocated yet: it is sized with `ftruncate` and mapped without pre-faulting. The
    /// caller allocates pages with [`Segment::populate`] before anything touches them (a
    /// page touched without it could raise `SIGBUS` on a full tmpfs). Fails with
    /// `ShmTooSmall` when `/dev/shm` has less than `len` bytes free right now.
    pub fn create_sparse(name: &str, len: usize) -> Result<Segment> {
        let available = shm_available();
        if available < len as u64 {
            return Err(Error::ShmTooSmall {
                name: name.to_owned(),
                requested: len as u64,
                available,
                mount: SHM_MOUNT.to_owned(),
            });
        }
        let shm_name = format!("/{name}");
        let fd = rustix::shm::open(
            shm_name.as_str(),
            rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| Error::Shm {
            name: name.to_owned(),
            op: "shm_open",
            source: e.into(),
        })?;
        let made = rustix::fs::ftruncate(&fd, len as u64)
            .map_err(|e| Error::Shm {
                name: name.to_owned(),
                op: "ftruncate",
                source: e.into(),
            })
            .and_then(|()| {
                let st = rustix::fs::fstat(&fd).map_err(|e| Error::Shm {
                    name: name.to_owned(),
                    op: "fstat",
                    source: e.into(),
                })?;
                // A new inode: never in the set yet; registered so that no second mapping
                // of it can be made in this process while this one lives.
                let id = (st.st_dev, st.st_ino);
                mapped_here().insert(id);
                let ptr = map(&fd, len, false).map_err(|e| {
                    mapped_here().remove(&id);
                    Error::Shm {
                        name: name.to_owned(),
                        op: "mmap",
                        source: e,
                    }
                })?;
                Ok(Segment {
                    ptr,
                    len,
                    name: Some(name.to_owned()),
                    id: Some(id),
                    _fd: Some(fd),
                })
            });
        if made.is_err() {
            let _ = rustix::shm::unlink(shm_name.as_str());
        }
        made
    }

    /// Allocate and map every page of bytes `offset .. offset + len` of the mapping
    /// (`MADV_POPULATE_WRITE`, which never changes their contents). A full tmpfs is an
    /// error here (`EFAULT` or `ENOMEM`), never a `SIGBUS`. `EINVAL` means the kernel has
    /// no `MADV_POPULATE_WRITE` (before Linux 5.14).
    pub fn populate(&self, offset: usize, len: usize) -> io::Result<()> {
        let in_range = offset
            .checked_add(len)
            .is_some_and(|end| end <= self.len && offset.is_multiple_of(4096));
        if !in_range {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "populate {offset}+{len} outside the mapping of {} bytes",
                    self.len
                ),
            ));
        }
        if len == 0 {
            return Ok(());
        }
        // SAFETY: `offset..offset+len` lies inside this mapping (checked above) and
        // `offset` is page aligned (the mapping's base is); MADV_POPULATE_WRITE only faults
        // pages in for writing, without changing their contents, so no Rust reference to
        // these bytes is affected.
        unsafe {
            rustix::mm::madvise(
                self.ptr.as_ptr().add(offset).cast::<c_void>(),
                len,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        }
        .map_err(Into::into)
    }

    /// Map the named segment open as `fd` (`len` bytes, pre-faulted) as a `Segment`,
    /// unless this process maps it already ([`MAPPED_HERE`]).
    fn map_named(name: &str, fd: OwnedFd, len: usize) -> Result<Segment> {
        let shm_err = |op: &'static str, source: io::Error| Error::Shm {
            name: name.to_owned(),
            op,
            source,
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| shm_err("fstat", e.into()))?;
        let id = (st.st_dev, st.st_ino);
        if !mapped_here().insert(id) {
            return Err(shm_err(
                "map",
                io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "this process maps the segment already (an engine of this process uses it)",
                ),
            ));
        }
        let ptr = match map(&fd, len, true) {
            Ok(p) => p,
            Err(e) => {
                mapped_here().remove(&id);
                return Err(shm_err("mmap", e));
            }
        };
        Ok(Segment {
            ptr,
            len,
            name: Some(name.to_owned()),
            id: Some(id),
            _fd: Some(fd),
        })
    }

    /// Map the existing segment `name` (opened read-write as `file`, a regular file of this
    /// user, checked by the caller) to take it over as an arena: only when it is exactly
    /// `len` bytes and every page is allocated (no hole that a full tmpfs could leave
    /// unbacked), then pre-faulted like a new one. Fails when this process maps the
    /// segment already (a live arena of this process: a second mapping would alias it).
    pub fn map_existing(name: &str, file: std::fs::File, len: usize) -> Result<Segment> {
        let fd: OwnedFd = file.into();
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::Shm {
            name: name.to_owned(),
            op: "fstat",
            source: e.into(),
        })?;
        let size = u64::try_from(st.st_size).unwrap_or(0);
        let allocated = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
        if size != len as u64 || allocated < size {
            return Err(Error::Shm {
                name: name.to_owned(),
                op: "take over",
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{size} bytes, {allocated} allocated: not a whole arena of {len} bytes"
                    ),
                ),
            });
        }
        Segment::map_named(name, fd, len)
    }

    /// A private anonymous mapping of `len` bytes, pre-faulted; used where no other process
    /// needs the bytes (standalone `verify`).
    pub fn anonymous(len: usize) -> Result<Segment> {
        // SAFETY: a fresh anonymous mapping with a null hint aliases no existing memory.
        let raw = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::POPULATE,
            )
        }
        .map_err(|e| Error::Shm {
            name: "(anonymous)".to_owned(),
            op: "mmap",
            source: e.into(),
        })?;
        Ok(Segment {
            ptr: NonNull::new(raw.cast()).expect("mmap never returns null on success"),
            len,
            name: None,
            id: None,
            _fd: None,
        })
    }

    /// First byte of the mapping (page aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length of the mapping in bytes.
    pub fn mapped_len(&self) -> usize {
        self.len
    }

    /// The shm name (without slash), `None` for anonymous mappings.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Remove the name from `/dev/shm`; the mapping stays valid until dropped.
    pub fn unlink(&self) -> io::Result<()> {
        match &self.name {
            Some(n) => rustix::shm::unlink(format!("/{n}").as_str()).map_err(Into::into),
            None => Ok(()),
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in the constructor, and every
        // borrower of the bytes (chunk leases hold an `Arc` of the arena that owns this
        // segment) is gone when the segment is dropped.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len);
        }
        if let Some(id) = self.id {
            mapped_here().remove(&id);
        }
    }
}

fn mapped_here() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<(u64, u64)>> {
    MAPPED_HERE.lock().unwrap_or_else(|p| p.into_inner())
}

fn map(fd: &OwnedFd, len: usize, populate: bool) -> io::Result<NonNull<u8>> {
    let mut flags = MapFlags::SHARED;
    if populate {
        flags |= MapFlags::POPULATE;
    }
    // SAFETY: mapping a file descriptor we own with a null hint creates new memory that
    // aliases no Rust object; the segment's size was fixed before mapping (`fallocate` of a
    // new segment, or `fstat` size and allocated blocks of one taken over), so every page
    // of `len` is backed.
    let raw = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            flags,
            fd,
            0,
        )
    }?;
    Ok(NonNull::new(raw.cast()).expect("mmap never returns null on success"))
}

/// Bytes free on the shm mount, 0 when unknown.
pub fn shm_available() -> u64 {
    rustix::fs::statvfs(SHM_MOUNT)
        .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
        .unwrap_or(0)
}

/// Open the existing segment `/dev/shm/<name>` for reading (and writing when `write`),
/// without following a symbolic link, without blocking, and only if it is a regular file
/// owned by the caller's effective uid (or by anyone, when `allow_foreign`). Returns the
/// file, its real size and the bytes it occupies (less than the size for a sparse file).
///
/// Nothing is mapped: callers read the descriptor with `pread` (no `SIGBUS` on a truncated
/// or sparse segment of a full tmpfs, no reference to memory another process writes).
pub fn open_existing(
    name: &str,
    write: bool,
    allow_foreign: bool,
) -> Result<(std::fs::File, u64, u64)> {
    use std::os::fd::AsFd;
    let mount = std::path::Path::new(SHM_MOUNT);
    let dir = crate::fsx::open_dir(mount)?;
    let uid = (!allow_foreign).then(|| rustix::process::geteuid().as_raw());
    let f = crate::fsx::open_file(dir.as_fd(), mount, name, write, crate::fsx::Create::No, uid)
        .map_err(|e| match e {
            Error::Io { op, source, .. } => Error::Shm {
                name: name.to_owned(),
                op,
                source,
            },
            other => other,
        })?;
    let (size, blocks) = crate::fsx::check_regular(f.as_fd(), &mount.join(name), None)?;
    Ok((f, size, blocks))
}

/// Names of segments in `/dev/shm` starting with `prefix`.
pub fn list_segments(prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(SHM_MOUNT)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}
