//! The sender's side of a replica transfer: its committed file read piece by piece while
//! the pieces already read travel, or a held memory-only step copied out of staging with
//! its checksums computed ([`Outgoing::memory_step`]).

#![allow(unsafe_code)]

use std::ffi::c_void;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use super::check::crcs;
use super::committed_entry;
use super::incoming::image_len;
use crate::error::{Error, Result};
use crate::fsx::{self, Create};
use crate::manifest::FileEntry;

/// `rank`'s committed file of a step, read into private memory piece by piece while the
/// pieces already read are sent ([`Outgoing::read_range`]): the sender's read overlaps the
/// transfer. The file is opened without following a link, must be a regular file of
/// exactly the manifest's size with a header that passes the checks of every disk read
/// (its CRC-32C against the manifest's); its data is checked by the receiver (every
/// tensor's CRC-32C, [`super::Incoming::seal`]), which never publishes an image that fails.
/// Or a held memory-only step, copied whole at once ([`Outgoing::memory_step`]).
#[derive(Debug)]
pub struct Outgoing {
    ptr: NonNull<u8>,
    len: usize,
    /// The committed file read from; `None` for a memory-only step, copied whole.
    file: Option<std::fs::File>,
    path: PathBuf,
    /// A memory-only step's manifest entry, its checksums computed from the copy.
    entry: Option<FileEntry>,
    /// Bytes `[0, done)` are read.
    done: usize,
    /// Whether the descriptor reads with `O_DIRECT` (`None`: not tried yet).
    direct: Option<bool>,
}

// SAFETY: `Outgoing` owns its mapping and its file; nothing ties them to a thread. Rust
// never makes a reference to the mapping's bytes (the kernel writes them, `read_range`).
unsafe impl Send for Outgoing {}

impl Outgoing {
    /// Open `rank`'s committed file of `step` of `root` for sending (see the type).
    pub fn open(root: &Path, step: u64, rank: u32) -> Result<Outgoing> {
        let (dir, entry) = committed_entry(root, step, rank)?;
        let len = image_len(&entry)?;
        let dfd = fsx::open_dir(&dir)?;
        let path = dir.join(&entry.file);
        let file = fsx::open_file(dfd.as_fd(), &dir, &entry.file, false, Create::No, None)?;
        let actual = file
            .metadata()
            .map_err(|e| Error::io("stat", &path, e))?
            .len();
        if actual != entry.bytes {
            return Err(Error::Truncated {
                path,
                expected: entry.bytes,
                actual,
            });
        }
        crate::restore::check_header(&file, &path, &entry)?;
        let ptr = super::anonymous_map(len)?;
        Ok(Outgoing {
            ptr,
            len,
            file: Some(file),
            path,
            entry: None,
            done: 0,
            direct: None,
        })
    }

    /// The held memory-only step `step` of `engine` (`EngineConfig::with_disk_cadence`), to
    /// send to its partners: its image copied out of the staging chunks into private
    /// memory under the memory tier's lock ([`crate::Engine::copy_memory_image`]: the
    /// step cannot be given up mid-copy, and the copy is the step's bytes whatever
    /// happens to it afterwards), then, off that lock, every tensor's CRC-32C and the
    /// header's computed from the copy ([`Outgoing::entry`]: the entry the step's manifest
    /// will have once it goes to disk, as the writers compute the same checksums from the
    /// same bytes). The receiver checks the image against that entry
    /// ([`super::Incoming::replica_of_memory_step`]). [`Error::NotFound`] when the step is
    /// not held (given up before the copy): nothing is sent. Costs the image's size in
    /// private memory while the value lives.
    pub fn memory_step(engine: &crate::Engine, step: u64) -> Result<Outgoing> {
        let what = || PathBuf::from(format!("<memory-only step {step}>"));
        let mut entry = engine.memory_entry(step).ok_or_else(|| Error::NotFound {
            what: format!("memory-only step {step}"),
            step: Some(step),
            root: engine.config().root().to_owned(),
        })?;
        let len = image_len(&entry)?;
        let ptr = super::anonymous_map(len)?;
        let mut out = Outgoing {
            ptr,
            len,
            file: None,
            path: what(),
            entry: None,
            done: len,
            direct: None,
        };
        // SAFETY: the mapping is this value's own, `len` bytes, fresh (no other reference
        // to it exists); the borrow ends before the value is handed out.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.ptr.as_ptr(), len) };
        engine.copy_memory_image(step, &entry, dst)?;
        let bytes: &[u8] = dst;
        let data_start = super::check::mem_len(entry.data_start, &what())?;
        let (header, data) = bytes
            .split_at_checked(data_start)
            .ok_or_else(|| Error::corrupt(what(), None, "the data section starts past the end"))?;
        let mut pieces = Vec::with_capacity(entry.tensors.len());
        for t in &entry.tensors {
            let [b, e] = t.data_offsets;
            let (b, e) = (
                super::check::mem_len(b, &what())?,
                super::check::mem_len(e, &what())?,
            );
            let piece = data.get(b..e).ok_or_else(|| {
                Error::corrupt(what(), Some(&t.name), "lies outside the data section")
            })?;
            pieces.push(piece);
        }
        let sums = crcs(&pieces);
        for (t, c) in entry.tensors.iter_mut().zip(sums) {
            t.crc32c = c;
        }
        entry.header_crc32c = Some(crc32c::crc32c(header));
        out.entry = Some(entry);
        Ok(out)
    }

    /// A memory-only step's manifest entry with its checksums ([`Outgoing::memory_step`]);
    /// `None` for a committed file (the receiver has its manifest).
    pub fn entry(&self) -> Option<&FileEntry> {
        self.entry.as_ref()
    }

    /// The first byte of the image's memory (page aligned; `[0, read())` holds the file's
    /// bytes).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The image's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the image is empty (never: a safetensors file has a header).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes read or skipped so far (the position the next read starts from at least).
    pub fn read(&self) -> usize {
        self.done
    }

    /// Read bytes `[start, end)` of the file (`end` at most its length) into the memory:
    /// with `O_DIRECT` when the file system takes it (whole pages; the tail past the end of
    /// the file comes back short), in up to 4 parts read at once. Bytes are only ever read
    /// once, from the current position ([`Outgoing::read`]) on, and written by the kernel
    /// (`pread` into the mapping, no Rust reference made), so a transport reading what was
    /// read before is never disturbed. Bytes between the previous position and `start`
    /// (rounded down to a page) are skipped, never read (their memory stays zero): the
    /// sender of a held image reads only the pieces that staging gave back. Afterwards
    /// [`Outgoing::read`] is `end` (rounded up to a page, at most the length).
    /// [`Error::Truncated`] when the file ends early (it shrank).
    pub fn read_range(&mut self, start: usize, end: usize) -> Result<()> {
        // A memory-only step is copied whole (`done == len`): nothing to read.
        let Some(file) = self.file.take() else {
            return Ok(());
        };
        let r = self.read_file_range(&file, start, end);
        self.file = Some(file);
        r
    }

    /// [`Outgoing::read_range`] from `file`, the committed file.
    fn read_file_range(&mut self, file: &std::fs::File, start: usize, end: usize) -> Result<()> {
        let end = end.min(self.len);
        let page = rustix::param::page_size();
        let from = (start / page * page).max(self.done);
        if from >= end {
            return Ok(());
        }
        self.done = from;
        if self.direct.is_none() {
            // O_DIRECT on the open descriptor, where the file system takes it.
            let fl = rustix::fs::fcntl_getfl(file).unwrap_or(rustix::fs::OFlags::empty());
            self.direct =
                Some(rustix::fs::fcntl_setfl(file, fl | rustix::fs::OFlags::DIRECT).is_ok());
        }
        // `done` is always a page boundary (or `len`): whole pages up to `end`, at most to
        // the mapping's last page (mapped: the kernel maps whole pages).
        let stop = end.div_ceil(page) * page;
        let parts = ((stop - self.done) / (16 << 20)).clamp(1, 4);
        let per = (stop - self.done).div_ceil(parts).div_ceil(page) * page;
        let ranges: Vec<(usize, usize)> = (0..parts)
            .map(|k| (self.done + k * per, (self.done + (k + 1) * per).min(stop)))
            .filter(|(a, b)| a < b)
            .collect();
        let fd = std::os::fd::AsRawFd::as_raw_fd(file);
        let base = self.ptr.as_ptr() as usize;
        let len = self.len;
        let read_range = |a: usize, b: usize| -> std::result::Result<(), (usize, std::io::Error)> {
            let mut at = a;
            while at < b.min(len) {
                let want = (b - at).min(1 << 30);
                // SAFETY: `at + want <= stop <= len` rounded up to a page: inside this value's
                // mapping (whole pages), alive for the call; each range is written by one
                // thread only, by the kernel, and nothing reads past `done` meanwhile.
                let n =
                    unsafe { libc::pread(fd, (base + at) as *mut c_void, want, at as libc::off_t) };
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err((at, e));
                }
                if n == 0 {
                    return Err((at, std::io::Error::from(std::io::ErrorKind::UnexpectedEof)));
                }
                at += n as usize;
            }
            Ok(())
        };
        let results: Vec<_> = if ranges.len() == 1 {
            vec![read_range(ranges[0].0, ranges[0].1)]
        } else {
            std::thread::scope(|scope| {
                let hs: Vec<_> = ranges
                    .iter()
                    .map(|&(a, b)| scope.spawn(move || read_range(a, b)))
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err((0, std::io::Error::other("a read thread panicked")))
                        })
                    })
                    .collect()
            })
        };
        let mut first_err = None;
        for r in results {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            None => {
                // Read whole pages up to `stop` (or to the end of the file).
                self.done = stop.min(self.len);
                Ok(())
            }
            Some((at, e))
                if e.raw_os_error() == Some(libc::EINVAL) && self.direct == Some(true) =>
            {
                // The file system refused O_DIRECT for these reads: read buffered.
                let fl = rustix::fs::fcntl_getfl(file).unwrap_or(rustix::fs::OFlags::empty());
                rustix::fs::fcntl_setfl(file, fl - rustix::fs::OFlags::DIRECT)
                    .map_err(|e2| Error::io_at("read", &self.path, at as u64, e2.into()))?;
                self.direct = Some(false);
                self.read_file_range(file, self.done, end)
            }
            Some((at, e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(Error::Truncated {
                    path: self.path.clone(),
                    expected: self.len as u64,
                    actual: at as u64,
                })
            }
            Some((at, e)) => Err(Error::io_at("read", &self.path, at as u64, e)),
        }
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        // SAFETY: the mapping is this value's own; holders of its address keep `self` alive
        // (the binding's views own it).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
    }
}
