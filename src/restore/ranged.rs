//! Ranged reads: only the requested tensors of a rank file, into the caller's buffers.
//!
//! A request names a tensor, optionally a byte sub-range `[begin, end)` of it, and where
//! its bytes go ([`RangeDest`]). The reader reads only the byte ranges of the requested
//! tensors, with the same backend, O_DIRECT and staging buffers as [`super::read_file`]:
//!
//! * **Whole tensors are read, always.** The manifest's CRC-32C covers a tensor's bytes as
//!   a whole, so a sub-range cannot be verified by itself: a request for a sub-range reads
//!   the whole tensor once, verifies its CRC-32C and copies the sub-range out. Several
//!   requests for one tensor (sub-ranges, or the same range into several buffers) share
//!   that one read.
//! * **Coalescing.** The requested tensors' ranges, sorted by offset, are merged into one
//!   read when the gap between two of them is at most [`RangedOptions::gap`] bytes
//!   ([`DEFAULT_GAP`], 128 KiB, by default; 0 merges only ranges that touch): one larger
//!   request costs less than two small ones separated by a small gap, whose bytes are read
//!   and dropped. With O_DIRECT every merged range is then widened to whole 4 KiB pages
//!   (never past the end of the file) and ranges that share a page are merged, so no byte
//!   is read twice. [`RangedStats::bytes`] counts every byte read, gaps and page padding
//!   included.
//! * **Checks.** The file is checked like every read (a regular file, no link followed, of
//!   the manifest's size, its header matching the manifest) before any destination is
//!   written or allocated, and every requested tensor's CRC-32C is verified: a mismatch is
//!   [`Error::Checksum`] naming the file and the tensor (the bytes are copied as they pass,
//!   so the destinations may hold some of them then). Tensors that were not requested are
//!   never checked, even when a gap read some of their bytes.
//! * **Destinations**: a caller buffer must be exactly the requested range's length; a
//!   request naming a tensor the rank file does not hold, or a range outside the tensor,
//!   is [`Error::Destination`] naming the tensor, before anything is read. Caller buffers
//!   are `&mut` slices, so two of them never overlap (the Python binding checks the raw
//!   addresses it is given before making them slices).
#![allow(unsafe_code)]

use std::path::Path;
use std::sync::Arc;

use super::device::DeviceRing;
use super::extents::{align_extents, check_wanted, chunks_of, read_chunks};
use super::header::open_checked;
use super::sink::DeviceSink;
use super::{ReadOptions, ReadSink};
use crate::error::{Error, Result};
use crate::manifest::{FileEntry, Manifest};
use crate::tensor::{AlignedBytes, DeviceSlice};

/// Default [`RangedOptions::gap`]: requested ranges at most this far apart are read as one.
pub const DEFAULT_GAP: u64 = 128 << 10;

/// How to read ranges.
#[derive(Debug, Clone)]
pub struct RangedOptions {
    /// Backend, queue depth, O_DIRECT, staging buffers, manifest name rule.
    pub read: ReadOptions,
    /// Two requested ranges of the file separated by at most this many bytes are read as
    /// one (the gap is read and dropped).
    pub gap: u64,
}

impl Default for RangedOptions {
    fn default() -> Self {
        RangedOptions {
            read: ReadOptions::default(),
            gap: DEFAULT_GAP,
        }
    }
}

/// Where the bytes of a [`RangeRequest`] go.
#[derive(Debug)]
pub enum RangeDest<'b> {
    /// A buffer of the reader's own, returned in [`RangedLoad::owned`].
    Owned,
    /// The caller's host buffer, exactly the range's length.
    Host(&'b mut [u8]),
    /// Device memory, exactly the range's length (only through [`DeviceRing::load_ranges`]).
    Device(DeviceSlice<'b>),
}

/// One requested tensor, or a byte range of it.
#[derive(Debug)]
pub struct RangeRequest<'b> {
    /// The tensor's name in the rank file.
    pub name: &'b str,
    /// Bytes `[begin, end)` of the tensor; `None`: all of it.
    pub range: Option<(u64, u64)>,
    /// Where they go.
    pub dest: RangeDest<'b>,
}

impl<'b> RangeRequest<'b> {
    /// The whole tensor `name`, into a buffer of the reader's own.
    pub fn owned(name: &'b str) -> Self {
        RangeRequest {
            name,
            range: None,
            dest: RangeDest::Owned,
        }
    }

    /// The whole tensor `name`, into `buf` (exactly its size).
    pub fn host(name: &'b str, buf: &'b mut [u8]) -> Self {
        RangeRequest {
            name,
            range: None,
            dest: RangeDest::Host(buf),
        }
    }
}

/// What a ranged read did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RangedStats {
    /// Bytes read from the file's data section (gaps and O_DIRECT page padding included).
    pub bytes: u64,
    /// Reads after coalescing (each at most a staging buffer long).
    pub reads: u64,
    /// Distinct tensors read and verified.
    pub tensors: usize,
    /// Whether O_DIRECT was used.
    pub direct_io: bool,
}

/// The result of [`load_ranges`] / [`DeviceRing::load_ranges`].
#[derive(Debug)]
pub struct RangedLoad {
    /// The checkpoint's manifest.
    pub manifest: Manifest,
    /// The rank's file entry (every tensor, file order).
    pub entry: FileEntry,
    /// Per request, in request order: the bytes of an [`RangeDest::Owned`] request, `None`
    /// for the others.
    pub owned: Vec<Option<AlignedBytes>>,
    /// What was read.
    pub stats: RangedStats,
}

/// The requested tensor ranges of the data section `[begin, end)` (sorted by begin), with
/// neighbours at most `gap` bytes apart merged. Empty ranges are dropped.
pub fn coalesce(ranges: impl IntoIterator<Item = (u64, u64)>, gap: u64) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = ranges.into_iter().filter(|(b, e)| e > b).collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (b, e) in v {
        match out.last_mut() {
            Some(last) if b <= last.1.saturating_add(gap) => last.1 = last.1.max(e),
            _ => out.push((b, e)),
        }
    }
    out
}

/// A request resolved against the file entry.
struct Resolved {
    tensor: usize,
    begin: u64,
    end: u64,
}

/// Check every request against `entry` (tensor present, range inside it, destination of
/// the range's length; a device destination only when `device_ok`).
fn resolve(
    path: &Path,
    entry: &FileEntry,
    requests: &[RangeRequest<'_>],
    device_ok: bool,
) -> Result<Vec<Resolved>> {
    let mut by_name = std::collections::BTreeMap::new();
    for (i, t) in entry.tensors.iter().enumerate() {
        if by_name.insert(t.name.as_str(), i).is_some() {
            return Err(Error::corrupt(path, Some(&t.name), "listed twice"));
        }
    }
    let dest_err = |name: &str, reason: String| Error::Destination {
        name: name.to_owned(),
        reason,
    };
    requests
        .iter()
        .map(|r| {
            let &tensor = by_name
                .get(r.name)
                .ok_or_else(|| dest_err(r.name, format!("not in the rank file {}", entry.file)))?;
            let len = entry.tensors[tensor].len();
            let (begin, end) = r.range.unwrap_or((0, len));
            if begin > end || end > len {
                return Err(dest_err(
                    r.name,
                    format!("byte range [{begin}, {end}) is outside the tensor's {len} bytes"),
                ));
            }
            let want = end - begin;
            let have = match &r.dest {
                RangeDest::Owned => None,
                RangeDest::Host(b) => Some(b.len() as u64),
                RangeDest::Device(_) if !device_ok => {
                    return Err(dest_err(
                        r.name,
                        "a device destination needs a DeviceRing".into(),
                    ));
                }
                RangeDest::Device(d) => Some(d.len() as u64),
            };
            if let Some(have) = have
                && have != want
            {
                return Err(dest_err(
                    r.name,
                    format!("buffer holds {have} bytes, the range has {want}"),
                ));
            }
            Ok(Resolved { tensor, begin, end })
        })
        .collect()
}

/// Where one request's bytes go, while reading.
enum Out<'a> {
    Caller(&'a mut [u8]),
    Owned(AlignedBytes),
    Device,
}

/// Copies the pieces of each requested tensor into the requests' destinations.
struct RangeSink<'a> {
    /// Per tensor (file order): the requests that want it.
    by_tensor: Vec<Vec<usize>>,
    /// Per request: its byte range of the tensor and destination.
    ranges: Vec<(u64, u64)>,
    outs: Vec<Out<'a>>,
    /// Device destinations, indexed by request.
    device: Option<DeviceSink>,
}

impl ReadSink for RangeSink<'_> {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let end = at + bytes.len() as u64;
        for &r in self.by_tensor.get(tensor).map(Vec::as_slice).unwrap_or(&[]) {
            let (b, e) = self.ranges[r];
            let (s, f) = (at.max(b), end.min(e));
            if s >= f {
                continue;
            }
            let src = &bytes[(s - at) as usize..(f - at) as usize];
            let into = (s - b) as usize;
            match &mut self.outs[r] {
                Out::Caller(buf) => buf[into..into + src.len()].copy_from_slice(src),
                Out::Owned(a) => a.as_bytes_mut()[into..into + src.len()].copy_from_slice(src),
                Out::Device => match &mut self.device {
                    Some(d) => d.piece(r, s - b, src)?,
                    None => return Err(Error::Internal("no device sink".into())),
                },
            }
        }
        Ok(())
    }

    fn chunk_end(&mut self) -> Result<()> {
        match &mut self.device {
            Some(d) => d.chunk_end(),
            None => Ok(()),
        }
    }
}

/// Read the requested tensors of `path` (described by `entry`) into their destinations:
/// see the module documentation for the rules. Returns the owned buffers (per request)
/// and what was read.
pub fn read_ranges(
    path: &Path,
    entry: &FileEntry,
    requests: &mut [RangeRequest<'_>],
    opts: &RangedOptions,
) -> Result<(Vec<Option<AlignedBytes>>, RangedStats)> {
    let resolved = resolve(path, entry, requests, false)?;
    read_resolved(path, entry, requests, &resolved, opts, None)
}

/// [`read_ranges`] on `rank`'s file of the checkpoint directory `dir` (its manifest read
/// as [`ReadOptions::read_manifest`] says).
pub fn load_ranges(
    dir: &Path,
    rank: u32,
    requests: &mut [RangeRequest<'_>],
    opts: &RangedOptions,
) -> Result<RangedLoad> {
    let manifest = opts.read.read_manifest(dir)?;
    let entry = super::rank_entry(&manifest, dir, rank)?.clone();
    let (owned, stats) = read_ranges(&dir.join(&entry.file), &entry, requests, opts)?;
    Ok(RangedLoad {
        manifest,
        entry,
        owned,
        stats,
    })
}

impl DeviceRing {
    /// [`load_ranges`] through this ring's registered buffers, so that requests may also
    /// go to device memory ([`RangeDest::Device`]; copied from the ring as the reads
    /// complete). The ring is registered with CUDA only when a request has a device
    /// destination; its read size is the largest read.
    ///
    /// # Safety
    /// Every device destination must be device memory of its device, valid for writes of
    /// its length, and not accessed by anyone else until this call returns.
    pub unsafe fn load_ranges(
        &self,
        dir: &Path,
        rank: u32,
        requests: &mut [RangeRequest<'_>],
        opts: &RangedOptions,
    ) -> Result<RangedLoad> {
        let manifest = opts.read.read_manifest(dir)?;
        let entry = super::rank_entry(&manifest, dir, rank)?.clone();
        let path = dir.join(&entry.file);
        let resolved = resolve(&path, &entry, requests, true)?;
        let devices: Vec<Option<DeviceSlice<'_>>> = requests
            .iter()
            .map(|r| match &r.dest {
                RangeDest::Device(d) => Some(*d),
                _ => None,
            })
            .collect();
        let (owned, stats) = if devices.iter().all(Option::is_none) {
            read_resolved(&path, &entry, requests, &resolved, opts, None)?
        } else {
            let _one_at_a_time = crate::util::lock(&self.busy);
            // SAFETY: forwarded from this function's contract; each device destination is
            // exactly its range's length (`resolve`), and the sink indexes them by request.
            let sink = unsafe { DeviceSink::new(&self.staging, devices)? };
            let opts = RangedOptions {
                read: ReadOptions {
                    queue_depth: self.depth,
                    arena: Some(Arc::clone(self.staging.arena())),
                    ..opts.read.clone()
                },
                gap: opts.gap,
            };
            read_resolved(&path, &entry, requests, &resolved, &opts, Some(sink))?
        };
        Ok(RangedLoad {
            manifest,
            entry,
            owned,
            stats,
        })
    }
}

fn read_resolved(
    path: &Path,
    entry: &FileEntry,
    requests: &mut [RangeRequest<'_>],
    resolved: &[Resolved],
    opts: &RangedOptions,
    device: Option<DeviceSink>,
) -> Result<(Vec<Option<AlignedBytes>>, RangedStats)> {
    // The file, its size and header are checked before a byte of it is trusted or any
    // buffer sized by the manifest is allocated.
    let target = open_checked(path, entry, opts.read.direct_io)?;
    let mut wanted = vec![false; entry.tensors.len()];
    let mut by_tensor: Vec<Vec<usize>> = vec![Vec::new(); entry.tensors.len()];
    for (k, r) in resolved.iter().enumerate() {
        wanted[r.tensor] = true;
        by_tensor[r.tensor].push(k);
    }
    let mut outs = Vec::with_capacity(requests.len());
    for (req, r) in requests.iter_mut().zip(resolved) {
        outs.push(match &mut req.dest {
            RangeDest::Host(b) => Out::Caller(b),
            RangeDest::Device(_) => Out::Device,
            RangeDest::Owned => {
                let len = usize::try_from(r.end - r.begin).map_err(|_| {
                    Error::corrupt(path, Some(req.name), "tensor larger than the address space")
                })?;
                Out::Owned(AlignedBytes::zeroed(len))
            }
        });
    }
    let mut sink = RangeSink {
        by_tensor,
        ranges: resolved.iter().map(|r| (r.begin, r.end)).collect(),
        outs,
        device,
    };
    let stats = read_wanted_from(path, &target, entry, &wanted, opts, &mut sink)?;
    let owned = sink
        .outs
        .into_iter()
        .map(|o| match o {
            Out::Owned(a) => Some(a),
            Out::Caller(_) | Out::Device => None,
        })
        .collect();
    Ok((owned, stats))
}

/// Read only the tensors `wanted` (file order) of `path`, described by `entry`, handing
/// each one's bytes to `sink` in file order, and verify their CRC-32C: the checks and the
/// reads of [`read_ranges`] (file checked before any byte is trusted, wanted ranges merged
/// across gaps of at most `opts.gap`, O_DIRECT pages, staging buffers), for a caller that
/// consumes the bytes as they pass (the export's streaming writer). A mismatch is
/// [`Error::Checksum`] after the sink saw the bytes: the caller discards what it made.
pub(crate) fn read_wanted(
    path: &Path,
    entry: &FileEntry,
    wanted: &[bool],
    opts: &RangedOptions,
    sink: &mut dyn ReadSink,
) -> Result<RangedStats> {
    if wanted.len() != entry.tensors.len() {
        return Err(Error::Internal(format!(
            "{} wanted flags for {} tensors",
            wanted.len(),
            entry.tensors.len()
        )));
    }
    let target = open_checked(path, entry, opts.read.direct_io)?;
    read_wanted_from(path, &target, entry, wanted, opts, sink)
}

fn read_wanted_from(
    path: &Path,
    target: &Arc<crate::io::file::FileTarget>,
    entry: &FileEntry,
    wanted: &[bool],
    opts: &RangedOptions,
    sink: &mut dyn ReadSink,
) -> Result<RangedStats> {
    // The wanted tensors' ranges, in file offsets (inside the file: `open_checked` tied
    // `data_start` + every offset to the file's size), merged across small gaps.
    let ranges = entry
        .tensors
        .iter()
        .zip(wanted)
        .filter(|(_, w)| **w)
        .map(|(t, _)| t.data_offsets);
    let mut extents = Vec::new();
    for (b, e) in coalesce(ranges.map(|[b, e]| (b, e)), opts.gap) {
        let file = |x: u64| {
            entry
                .data_start
                .checked_add(x)
                .filter(|&o| o <= entry.bytes)
                .ok_or_else(|| Error::corrupt(path, None, "tensor offsets past the file's end"))
        };
        extents.push((file(b)?, file(e)?));
    }
    if target.is_direct() {
        extents = align_extents(&extents, entry.bytes);
    }
    let cs = match &opts.read.arena {
        Some(a) => a.chunk_size(),
        None => super::extents::PRIVATE_CHUNK,
    };
    let chunks = chunks_of(&extents, cs);
    let read = read_chunks(path, target, entry, &chunks, wanted, &opts.read, sink)?;
    check_wanted(path, entry, wanted, &read)?;
    Ok(RangedStats {
        bytes: read.bytes,
        reads: chunks.len() as u64,
        tensors: wanted.iter().filter(|w| **w).count(),
        direct_io: target.is_direct(),
    })
}

#[cfg(test)]
#[path = "ranged_tests.rs"]
mod tests;
