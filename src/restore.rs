//! Reading checkpoints back: through the same I/O backend (O_DIRECT where possible), chunk
//! by chunk through staging buffers, checking the safetensors header against the manifest
//! and every tensor's CRC-32C.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::io::file::FileTarget;
use crate::io::queue::{LeaseQueue, Request};
use crate::io::{BackendKind, BackendOptions, OpKind, align_up, open_backend};
use crate::manifest::{FileEntry, Manifest, Metadata};
use crate::plan::MAX_HEADER_LEN;
use crate::staging::{Arena, ArenaSpec, ChunkLease};
use crate::tensor::{AlignedBytes, LoadedTensor};

/// Chunk size of the private buffers used when no engine arena is given.
const PRIVATE_CHUNK: u64 = 4 << 20;

/// How to read.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// Backend (io_uring or pread).
    pub backend: BackendKind,
    /// Reads in flight.
    pub queue_depth: u32,
    /// Try O_DIRECT.
    pub direct_io: bool,
    /// Staging arena to borrow buffers from; `None` allocates private buffers.
    pub arena: Option<Arc<Arena>>,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            backend: BackendKind::Auto,
            queue_depth: 4,
            direct_io: true,
            arena: None,
        }
    }
}

/// A loaded checkpoint (one rank's file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// Step.
    pub step: u64,
    /// Directory it was read from.
    pub dir: PathBuf,
    /// User metadata.
    pub metadata: Metadata,
    /// Tensors, in file order.
    pub tensors: Vec<LoadedTensor>,
}

impl Checkpoint {
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&LoadedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Receives the bytes of a file as they are read, in file order.
pub trait ReadSink {
    /// `bytes` are the bytes of tensor `tensor` (index in the manifest's file entry)
    /// starting at offset `at` inside the tensor.
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()>;
    /// The staging buffer that held the last pieces is about to be reused: finish any
    /// asynchronous use of it.
    fn chunk_end(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Discards the bytes (checksums are still verified).
#[derive(Debug, Default)]
pub struct Discard;

impl ReadSink for Discard {
    fn piece(&mut self, _: usize, _: u64, _: &[u8]) -> Result<()> {
        Ok(())
    }
}

struct HostSink<'a> {
    dest: Vec<&'a mut [u8]>,
}

impl ReadSink for HostSink<'_> {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let at = at as usize;
        self.dest[tensor][at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
}

/// What `read_file` measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes read from the data section.
    pub bytes: u64,
    /// Whether O_DIRECT was used.
    pub direct_io: bool,
}

/// Load `rank`'s file of the checkpoint in `dir` into owned tensors.
pub fn load_owned(dir: &Path, rank: u32, opts: &ReadOptions) -> Result<Checkpoint> {
    let manifest = Manifest::read(dir)?;
    let entry = rank_entry(&manifest, dir, rank)?;
    // Check the size before allocating what the manifest claims: a lying manifest must be
    // an error, not an allocation failure (the parser ties the tensors' sizes to `bytes`).
    let path = dir.join(&entry.file);
    let actual = std::fs::metadata(&path)
        .map_err(|e| Error::io("stat", &path, e))?
        .len();
    if actual < entry.bytes {
        return Err(Error::Truncated {
            path,
            expected: entry.bytes,
            actual,
        });
    }
    let mut bufs: Vec<AlignedBytes> = entry
        .tensors
        .iter()
        .map(|t| AlignedBytes::zeroed(t.len() as usize))
        .collect();
    {
        let mut sink = HostSink {
            dest: bufs.iter_mut().map(|b| b.as_bytes_mut()).collect(),
        };
        read_file(&dir.join(&entry.file), entry, opts, &mut sink)?;
    }
    let tensors = entry
        .tensors
        .iter()
        .zip(bufs)
        .map(|(t, data)| LoadedTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            data,
        })
        .collect();
    Ok(Checkpoint {
        step: manifest.step,
        dir: dir.to_owned(),
        metadata: manifest.metadata.clone(),
        tensors,
    })
}

/// Load `rank`'s file into caller buffers matched by name. Every tensor needs a buffer of
/// exactly its size.
pub fn load_into(
    dir: &Path,
    rank: u32,
    dest: &mut [(&str, &mut [u8])],
    opts: &ReadOptions,
) -> Result<()> {
    let manifest = Manifest::read(dir)?;
    let entry = rank_entry(&manifest, dir, rank)?;
    let named: Vec<(&str, u64)> = dest.iter().map(|(n, b)| (*n, b.len() as u64)).collect();
    let order = match_destinations(entry, &named)?;
    // Reorder the caller's buffers into file order.
    let mut slots: Vec<Option<&mut [u8]>> = dest.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
    let ordered: Vec<&mut [u8]> = order
        .iter()
        .map(|&i| slots[i].take().expect("each destination used once"))
        .collect();
    let mut sink = HostSink { dest: ordered };
    read_file(&dir.join(&entry.file), entry, opts, &mut sink)?;
    Ok(())
}

/// Match caller destinations `(name, byte length)` with the tensors of `entry`: returns,
/// for each tensor in file order, the index of its destination. Every tensor needs exactly
/// one destination of exactly its size, and every destination a tensor.
pub fn match_destinations(entry: &FileEntry, dest: &[(&str, u64)]) -> Result<Vec<usize>> {
    let mut by_name: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, (name, _)) in dest.iter().enumerate() {
        if by_name.insert(*name, i).is_some() {
            return Err(Error::Destination {
                name: (*name).to_owned(),
                reason: "given twice".into(),
            });
        }
    }
    let mut order = Vec::with_capacity(entry.tensors.len());
    for t in &entry.tensors {
        let i = *by_name
            .get(t.name.as_str())
            .ok_or_else(|| Error::Destination {
                name: t.name.clone(),
                reason: "no destination buffer given".into(),
            })?;
        if dest[i].1 != t.len() {
            return Err(Error::Destination {
                name: t.name.clone(),
                reason: format!(
                    "buffer holds {} bytes, the tensor has {}",
                    dest[i].1,
                    t.len()
                ),
            });
        }
        order.push(i);
    }
    if order.len() != dest.len() {
        let known: std::collections::HashSet<&str> =
            entry.tensors.iter().map(|t| t.name.as_str()).collect();
        let extra = dest
            .iter()
            .find(|(n, _)| !known.contains(n))
            .map(|(n, _)| n.to_string())
            .unwrap_or_default();
        return Err(Error::Destination {
            name: extra,
            reason: "not in the checkpoint".into(),
        });
    }
    Ok(order)
}

/// Read and parse the manifest of `dir` and return `rank`'s file entry with it.
pub fn rank_file(dir: &Path, rank: u32) -> Result<(Manifest, FileEntry)> {
    let manifest = Manifest::read(dir)?;
    let entry = rank_entry(&manifest, dir, rank)?.clone();
    Ok((manifest, entry))
}

/// Verify every file of the checkpoint in `dir`: header against manifest, sizes, checksums.
/// Returns the bytes read.
pub fn verify_dir(dir: &Path, opts: &ReadOptions) -> Result<u64> {
    let manifest = Manifest::read(dir)?;
    let mut total = 0;
    for f in &manifest.files {
        total += read_file(&dir.join(&f.file), f, opts, &mut Discard)?.bytes;
    }
    Ok(total)
}

fn rank_entry<'m>(m: &'m Manifest, dir: &Path, rank: u32) -> Result<&'m FileEntry> {
    m.file_of_rank(rank).ok_or_else(|| {
        Error::corrupt(
            dir.join(crate::manifest::MANIFEST),
            None,
            format!("no file for rank {rank}"),
        )
    })
}

/// Read and check the safetensors header of `path` against `entry`.
pub fn check_header(file: &std::fs::File, path: &Path, entry: &FileEntry) -> Result<()> {
    let mut n8 = [0u8; 8];
    file.read_exact_at(&mut n8, 0)
        .map_err(|e| Error::io_at("read", path, 0, e))?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER_LEN {
        return Err(Error::corrupt(
            path,
            None,
            format!("header length {n} exceeds the safetensors limit of {MAX_HEADER_LEN}"),
        ));
    }
    if 8 + n != entry.data_start {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "header ends at {} but the manifest says data starts at {}",
                8 + n,
                entry.data_start
            ),
        ));
    }
    let mut hdr = vec![0u8; n as usize];
    file.read_exact_at(&mut hdr, 8)
        .map_err(|e| Error::io_at("read", path, 8, e))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&hdr)
        .map_err(|e| Error::corrupt(path, None, format!("invalid safetensors header: {e}")))?;
    let data_len = entry.bytes - entry.data_start;
    if meta.data_len() as u64 != data_len {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "header describes {} data bytes, the manifest {data_len}",
                meta.data_len()
            ),
        ));
    }
    if meta.tensors().len() != entry.tensors.len() {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "header lists {} tensors, the manifest {}",
                meta.tensors().len(),
                entry.tensors.len()
            ),
        ));
    }
    for t in &entry.tensors {
        let info = meta
            .info(&t.name)
            .ok_or_else(|| Error::corrupt(path, Some(&t.name), "missing from the header"))?;
        let same = format!("{:?}", info.dtype) == t.dtype.as_str()
            && info.shape == t.shape
            && [info.data_offsets.0 as u64, info.data_offsets.1 as u64] == t.data_offsets;
        if !same {
            return Err(Error::corrupt(
                path,
                Some(&t.name),
                format!(
                    "header says {:?} {:?} at {:?}, the manifest {} {:?} at {:?}",
                    info.dtype, info.shape, info.data_offsets, t.dtype, t.shape, t.data_offsets
                ),
            ));
        }
    }
    Ok(())
}

/// A chunk being read.
#[derive(Debug, Clone, Copy)]
struct Pending {
    chunk: u64,
    want: usize,
    got: usize,
}

/// Read the data section of `path` (described by `entry`) chunk by chunk, handing every
/// tensor's bytes to `sink` in file order, and verify every checksum. Fails with an error
/// naming file and tensor on any mismatch.
pub fn read_file(
    path: &Path,
    entry: &FileEntry,
    opts: &ReadOptions,
    sink: &mut dyn ReadSink,
) -> Result<ReadStats> {
    // Opened first without following a link and without blocking, and refused unless it is
    // a regular file: a FIFO or device in place of a rank file must not hang or be read.
    let checked = crate::fsx::open_path(path, false)?;
    let target = Arc::new(FileTarget::open_read(path, opts.direct_io)?);
    let actual = target.len()?;
    if actual < entry.bytes {
        return Err(Error::Truncated {
            path: path.to_owned(),
            expected: entry.bytes,
            actual,
        });
    }
    if actual > entry.bytes {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "{} trailing bytes after the last tensor",
                actual - entry.bytes
            ),
        ));
    }
    check_header(&checked, path, entry)?;
    drop(checked);

    let qd = opts.queue_depth.max(1) as usize;
    let arena = match &opts.arena {
        Some(a) => Arc::clone(a),
        None => Arena::create(&ArenaSpec {
            name: None,
            capacity: PRIVATE_CHUNK * qd as u64,
            chunk_size: PRIVATE_CHUNK,
            slots: 1,
            rank: 0,
            world_size: 1,
            root: PathBuf::new(),
        })?,
    };
    let cs = arena.chunk_size();
    let backend = open_backend(&BackendOptions {
        kind: opts.backend,
        queue_depth: qd as u32,
        fixed: None,
        #[cfg(feature = "fault-injection")]
        faults: None,
    })
    .map_err(|e| Error::io("io setup", path, e))?;
    let mut q: LeaseQueue<Pending> = LeaseQueue::new(backend);

    let data_len = entry.bytes - entry.data_start;
    let n = data_len.div_ceil(cs);
    let mut crcs = vec![0u32; entry.tensors.len()];
    let mut ready: BTreeMap<u64, (ChunkLease, Pending)> = BTreeMap::new();
    let mut next_issue = 0u64;
    let mut next_process = 0u64;
    let mut error: Option<Error> = None;
    let issue = |q: &mut LeaseQueue<Pending>, lease: ChunkLease, p: Pending| {
        let offset = entry.data_start + p.chunk * cs + p.got as u64;
        // Whole pages when possible (O_DIRECT); a tail past EOF just comes back short.
        let rest = (p.want - p.got) as u64;
        let len = align_up(rest).min(cs - p.got as u64) as usize;
        q.push(
            lease,
            p,
            &target,
            Request {
                kind: OpKind::Read,
                at: p.got,
                len,
                offset,
            },
        )
        .map_err(|(_, _, e)| Error::io_at("read", path, offset, e))
    };

    loop {
        // Hold at most `qd` buffers, in flight or waiting for an earlier chunk.
        while error.is_none() && next_issue < n && ready.len() + q.in_flight() < qd {
            let (lease, _) = arena.acquire();
            let k = next_issue;
            let want = (data_len - k * cs).min(cs) as usize;
            if let Err(e) = issue(
                &mut q,
                lease,
                Pending {
                    chunk: k,
                    want,
                    got: 0,
                },
            ) {
                error = Some(e);
                break;
            }
            next_issue += 1;
        }
        if q.in_flight() == 0 {
            break;
        }
        let done = q.wait(1).map_err(|b| Error::io("io wait", path, b.error))?;
        for d in done {
            let mut p = d.tag;
            let offset = entry.data_start + p.chunk * cs + p.got as u64;
            let r = d.result;
            if r == -libc::EINTR || r == -libc::EAGAIN {
            } else if r < 0 {
                let e = std::io::Error::from_raw_os_error(-r);
                error.get_or_insert(Error::io_at("read", path, offset, e));
                continue;
            } else if r == 0 {
                error.get_or_insert(Error::Truncated {
                    path: path.to_owned(),
                    expected: entry.bytes,
                    actual: offset,
                });
                continue;
            } else {
                p.got += r as usize;
                if p.got >= p.want {
                    ready.insert(p.chunk, (d.lease, p));
                    continue;
                }
            }
            if error.is_none()
                && let Err(e) = issue(&mut q, d.lease, p)
            {
                error = Some(e);
            }
        }
        while error.is_none()
            && let Some((lease, p)) = ready.remove(&next_process)
        {
            if let Err(e) = process_chunk(
                entry,
                cs,
                &lease.as_slice()[..p.want],
                p.chunk,
                &mut crcs,
                sink,
            ) {
                error = Some(e);
            }
            next_process += 1;
        }
    }
    if let Some(e) = error {
        return Err(e);
    }
    debug_assert_eq!(next_process, n);
    for (t, &crc) in entry.tensors.iter().zip(&crcs) {
        if crc != t.crc32c {
            return Err(Error::Checksum {
                path: path.to_owned(),
                tensor: t.name.clone(),
                expected: t.crc32c,
                actual: crc,
            });
        }
    }
    Ok(ReadStats {
        bytes: data_len,
        direct_io: target.is_direct(),
    })
}

fn process_chunk(
    entry: &FileEntry,
    cs: u64,
    bytes: &[u8],
    chunk: u64,
    crcs: &mut [u32],
    sink: &mut dyn ReadSink,
) -> Result<()> {
    let start = chunk * cs; // relative to the data section
    let end = start + bytes.len() as u64;
    let first = entry
        .tensors
        .partition_point(|t| t.data_offsets[1] <= start);
    for (i, t) in entry.tensors.iter().enumerate().skip(first) {
        let [b, e] = t.data_offsets;
        if b >= end {
            break;
        }
        if e == b {
            continue;
        }
        let s = b.max(start);
        let f = e.min(end);
        let piece = &bytes[(s - start) as usize..(f - start) as usize];
        crcs[i] = crc32c::crc32c_append(crcs[i], piece);
        if let Err(e) = sink.piece(i, s - b, piece) {
            // The sink may still be using earlier pieces of this buffer.
            let _ = sink.chunk_end();
            return Err(e);
        }
    }
    sink.chunk_end()
}
