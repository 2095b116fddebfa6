//! Reading checkpoint files into device memory: [`DeviceRing`], a small ring of
//! CUDA-registered host buffers that O_DIRECT reads fill and host-to-device copies drain,
//! and [`DeviceRing::load_split`], which sends some tensors of a rank file to device
//! memory and returns the others in host memory, reading the file once.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::sink::DeviceSink;
use super::{ReadOptions, ReadSink, ReadStats, extents, read_file, reader};
use crate::device::pipeline::CudaStaging;
use crate::error::{Error, Result};
use crate::manifest::{FileEntry, Manifest};
use crate::staging::{Arena, ArenaSpec};
use crate::tensor::{AlignedBytes, DeviceSlice};

/// Registered read buffers for loads into device memory: `depth + 4` buffers of
/// `read_size` bytes in a private shared-memory segment, registered with CUDA at the first
/// load (`cuMemHostRegister`), so that every host-to-device copy runs at the pinned rate.
/// Reads keep `depth` requests in flight; a buffer is checksummed and its copy queued as
/// soon as its read completes, and it is reused once that copy finished.
///
/// One ring serves one load at a time (a second load waits for the first). Made without
/// touching the driver: a machine without CUDA can build one, and its loads then fail with
/// [`Error::Cuda`], as do loads to device memory anywhere else.
pub struct DeviceRing {
    pub(crate) staging: CudaStaging,
    pub(super) depth: u32,
    pub(crate) busy: std::sync::Mutex<()>,
}

impl std::fmt::Debug for DeviceRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRing")
            .field("read_size", &self.read_size())
            .field("depth", &self.depth)
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// What [`DeviceRing::load_split`] read.
#[derive(Debug)]
pub struct SplitLoad {
    /// The checkpoint's manifest (step, metadata, every rank's file).
    pub manifest: Manifest,
    /// The rank's file: its tensors (names, dtypes, shapes, offsets, CRC-32C), in file
    /// order.
    pub entry: FileEntry,
    /// Per tensor of `entry` (file order): its bytes, or `None` for a tensor that went to
    /// a destination of the caller's.
    pub host: Vec<Option<AlignedBytes>>,
    /// How the data section was read.
    pub stats: ReadStats,
}

/// Device-load read settings ([`crate::EngineConfig::with_device_read`],
/// [`DeviceRing::new`]): `bytes` a multiple of 4096 between 1 MiB and
/// 1 GiB, `depth` 1..=64.
pub(crate) fn check_device_read(bytes: u64, depth: u32) -> Result<()> {
    if !bytes.is_multiple_of(4096) || !(1 << 20..=1 << 30).contains(&bytes) {
        return Err(Error::Config(format!(
            "device read size {bytes} must be a multiple of 4096 between 1 MiB and 1 GiB"
        )));
    }
    if !(1..=64).contains(&depth) {
        return Err(Error::Config("device read depth must be 1..=64".into()));
    }
    Ok(())
}

impl DeviceRing {
    /// A ring for reads of `read_size` bytes (a multiple of 4096, 1 MiB to 1 GiB), `depth`
    /// in flight (1 to 64).
    pub fn new(read_size: u64, depth: u32) -> Result<DeviceRing> {
        check_device_read(read_size, depth)?;
        let arena = Arena::create(&ArenaSpec {
            name: None,
            capacity: read_size * extents::buffers_needed(depth),
            chunk_size: read_size,
            slots: 1,
            rank: 0,
            world_size: 1,
            root: PathBuf::new(),
        })?;
        Ok(DeviceRing {
            // Only its registration and streams are used (no save is staged here): the
            // batch and copy-ahead settings are unused.
            staging: CudaStaging::new(arena, false, 0, false),
            depth,
            busy: std::sync::Mutex::new(()),
        })
    }

    /// Host memory the ring holds.
    pub fn bytes(&self) -> u64 {
        self.staging.arena().capacity()
    }

    /// Size of each read (the ring's buffer size).
    pub fn read_size(&self) -> u64 {
        self.staging.arena().chunk_size()
    }

    /// Reads in flight.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Read the data section of `path` (described by `entry`) into device memory:
    /// tensor `i` (file order) goes to `dest[i]`, which must be exactly its size; every
    /// CRC-32C is verified (the bytes are copied as they pass, so a load that fails with
    /// [`Error::Checksum`] may have left some of them in the destinations).
    ///
    /// # Safety
    /// Every destination must be device memory of its device, valid for writes of its
    /// length, and not accessed by anyone else until this call returns.
    pub(crate) unsafe fn read_to_device(
        &self,
        path: &Path,
        entry: &FileEntry,
        dest: Vec<Option<DeviceSlice<'_>>>,
        opts: &ReadOptions,
        host: Option<&mut [Buf<'_>]>,
    ) -> Result<ReadStats> {
        check_device_dest(entry, &dest)?;
        let _one_at_a_time = crate::util::lock(&self.busy);
        // SAFETY: forwarded from this function's contract.
        let device = unsafe { DeviceSink::new(&self.staging, dest)? };
        let opts = ReadOptions {
            queue_depth: self.depth,
            arena: Some(Arc::clone(self.staging.arena())),
            ..opts.clone()
        };
        match host {
            None => {
                let mut sink = device;
                read_file(path, entry, &opts, &mut sink)
            }
            Some(host) => {
                let mut sink = SplitSink { device, host };
                read_file(path, entry, &opts, &mut sink)
            }
        }
    }

    /// Read `rank`'s file of the committed step directory `dir` once: each tensor named
    /// in `device` is copied to its device range straight from the registered ring, each
    /// tensor named in `host` into its caller buffer, each range exactly the tensor's size;
    /// every other tensor comes back in host memory ([`SplitLoad::host`]). Every CRC-32C
    /// is verified against the manifest (a load that fails may have written some bytes to
    /// the destinations). With no destinations at all the file is read like
    /// [`super::load_owned`] (straight into one host allocation). The ring is registered
    /// with CUDA only when `device` is not empty.
    ///
    /// # Safety
    /// Every device range must be device memory of its device, valid for writes of its
    /// length, and not accessed by anyone else until this call returns.
    pub unsafe fn load_split(
        &self,
        dir: &Path,
        rank: u32,
        device: &[(&str, DeviceSlice<'_>)],
        host: &mut [(&str, &mut [u8])],
        opts: &ReadOptions,
    ) -> Result<SplitLoad> {
        if device.is_empty() && host.is_empty() {
            return load_split_host(dir, rank, opts);
        }
        let manifest = opts.read_manifest(dir)?;
        let entry = super::rank_entry(&manifest, dir, rank)?.clone();
        let path = dir.join(&entry.file);
        let mut by_name: BTreeMap<&str, Target<'_, '_>> = BTreeMap::new();
        let names = device
            .iter()
            .map(|(n, d)| (*n, Target::Device(*d)))
            .chain(host.iter_mut().map(|(n, b)| (*n, Target::Host(b))));
        for (name, t) in names {
            if by_name.insert(name, t).is_some() {
                return Err(Error::Destination {
                    name: name.to_owned(),
                    reason: "given twice".into(),
                });
            }
        }
        let mut dest: Vec<Option<DeviceSlice<'_>>> = Vec::with_capacity(entry.tensors.len());
        let mut bufs: Vec<Buf<'_>> = Vec::with_capacity(entry.tensors.len());
        for t in &entry.tensors {
            match by_name.remove(t.name.as_str()) {
                Some(Target::Device(d)) => {
                    dest.push(Some(d));
                    bufs.push(Buf::Device);
                }
                Some(Target::Host(b)) => {
                    if b.len() as u64 != t.len() {
                        return Err(Error::Destination {
                            name: t.name.clone(),
                            reason: format!(
                                "buffer holds {} bytes, the tensor has {}",
                                b.len(),
                                t.len()
                            ),
                        });
                    }
                    dest.push(None);
                    bufs.push(Buf::Caller(b));
                }
                None => {
                    let len = usize::try_from(t.len()).map_err(|_| {
                        Error::corrupt(&path, Some(&t.name), "tensor larger than the address space")
                    })?;
                    dest.push(None);
                    bufs.push(Buf::Owned(AlignedBytes::zeroed(len)));
                }
            }
        }
        if let Some(name) = by_name.keys().next() {
            return Err(Error::Destination {
                name: (*name).to_owned(),
                reason: "not in the checkpoint".into(),
            });
        }
        // SAFETY: forwarded from this function's contract.
        let stats = unsafe { self.read_to_device(&path, &entry, dest, opts, Some(&mut bufs))? };
        let host = bufs
            .into_iter()
            .map(|b| match b {
                Buf::Owned(a) => Some(a),
                Buf::Device | Buf::Caller(_) => None,
            })
            .collect();
        Ok(SplitLoad {
            manifest,
            entry,
            host,
            stats,
        })
    }
}

/// Each device destination is exactly its tensor's size.
pub(crate) fn check_device_dest(entry: &FileEntry, dest: &[Option<DeviceSlice<'_>>]) -> Result<()> {
    if dest.len() != entry.tensors.len() {
        return Err(Error::Destination {
            name: String::new(),
            reason: format!(
                "{} destinations for {} tensors",
                dest.len(),
                entry.tensors.len()
            ),
        });
    }
    for (t, d) in entry.tensors.iter().zip(dest) {
        if let Some(d) = d
            && d.len() as u64 != t.len()
        {
            return Err(Error::Destination {
                name: t.name.clone(),
                reason: format!(
                    "device buffer holds {} bytes, the tensor has {}",
                    d.len(),
                    t.len()
                ),
            });
        }
    }
    Ok(())
}

/// A caller's destination, by name.
enum Target<'d, 'b> {
    Device(DeviceSlice<'d>),
    Host(&'b mut [u8]),
}

/// Where one tensor's bytes go (file order).
pub(crate) enum Buf<'b> {
    /// Its device destination.
    Device,
    /// The caller's host buffer.
    Caller(&'b mut [u8]),
    /// A buffer of our own, returned in [`SplitLoad::host`].
    Owned(AlignedBytes),
}

/// [`DeviceRing::load_split`] with no device destinations (no ring needed): every tensor
/// of `rank`'s file in `dir` comes back in host memory, read with O_DIRECT straight into
/// one allocation (as [`super::load_owned`]), every CRC-32C verified; the manifest is read
/// once.
pub fn load_split_host(dir: &Path, rank: u32, opts: &ReadOptions) -> Result<SplitLoad> {
    let manifest = opts.read_manifest(dir)?;
    let entry = super::rank_entry(&manifest, dir, rank)?.clone();
    let (data, stats) = reader::read_to_slab(&dir.join(&entry.file), &entry, opts, None)?;
    Ok(SplitLoad {
        manifest,
        entry,
        host: data.into_iter().map(Some).collect(),
        stats,
    })
}

/// Pieces of tensors with a device destination go to the device; the others into their
/// host buffers.
struct SplitSink<'a, 'b> {
    device: DeviceSink,
    host: &'a mut [Buf<'b>],
}

impl ReadSink for SplitSink<'_, '_> {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let at = at as usize;
        let buf: &mut [u8] = match self.host.get_mut(tensor) {
            Some(Buf::Owned(a)) => a.as_bytes_mut(),
            Some(Buf::Caller(b)) => b,
            _ => return self.device.piece(tensor, at as u64, bytes),
        };
        buf[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn chunk_end(&mut self) -> Result<()> {
        self.device.chunk_end()
    }
}
