//! Reading a committed step back from the bucket: ranged GETs in parallel, every check of
//! a local read (object size, safetensors header against the manifest, CRC-32C of every
//! tensor), never trusting what the bucket returns.

use std::path::PathBuf;
use std::time::Instant;

use futures::StreamExt;
use object_store::ObjectStoreExt;

use super::Remote;
use crate::error::{Error, Result};
use crate::manifest::{FileEntry, Manifest, Metadata};
use crate::restore::header::{check_header_json, header_len};
use crate::restore::{Checkpoint, DeviceRing, Discard, ReadSink, for_pieces};
use crate::tensor::{AlignedBytes, DeviceSlice, LoadedTensor};
use crate::tier::RemoteLoad;

/// Fills one owned buffer per tensor.
struct Owned {
    bufs: Vec<AlignedBytes>,
}

impl ReadSink for Owned {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        // `at + len` is within the tensor: `for_pieces` cuts pieces at tensor bounds.
        let at = at as usize;
        self.bufs[tensor].as_bytes_mut()[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
}

impl Remote {
    /// Read `rank`'s object of committed step `step` into `sink` (file order), checking
    /// the object's size and header against the manifest and every tensor's CRC-32C.
    /// Returns the manifest and what was read.
    pub fn read_rank(
        &self,
        step: u64,
        rank: u32,
        sink: &mut dyn ReadSink,
    ) -> Result<(Manifest, RemoteLoad)> {
        let t = Instant::now();
        let m = self.manifest(step)?;
        let entry = self.entry_of_rank(&m, step, rank)?;
        let (bytes, _) = self.read_entry(step, entry, sink)?;
        let load = RemoteLoad {
            step,
            bytes,
            elapsed: t.elapsed(),
            staged: 0,
            staging: 0,
        };
        Ok((m, load))
    }

    /// The object `key` has exactly the size `entry` says (checked before anything is
    /// allocated or read on the manifest's word).
    async fn check_size(&self, key: &object_store::path::Path, entry: &FileEntry) -> Result<()> {
        let path = self.display(key);
        let meta = self
            .store
            .head(key)
            .await
            .map_err(|e| self.err("head", &e))?;
        if meta.size < entry.bytes {
            return Err(Error::Truncated {
                path,
                expected: entry.bytes,
                actual: meta.size,
            });
        }
        if meta.size > entry.bytes {
            return Err(Error::corrupt(
                &path,
                None,
                format!(
                    "{} trailing bytes after the last tensor",
                    meta.size - entry.bytes
                ),
            ));
        }
        Ok(())
    }

    /// Check `key`'s size and read its header, checked against `entry`; returns the
    /// header's `__metadata__`.
    async fn read_header(
        &self,
        key: &object_store::path::Path,
        entry: &FileEntry,
    ) -> Result<Metadata> {
        let path: PathBuf = self.display(key);
        self.check_size(key, entry).await?;
        // The header: its length, then its JSON, against the manifest.
        let get = |r: std::ops::Range<u64>| async move { self.store.get_range(key, r).await };
        let n8 = get(0..8).await.map_err(|e| self.err("get", &e))?;
        let n8: [u8; 8] = n8[..]
            .try_into()
            .map_err(|_| Error::corrupt(&path, None, "short read of the header length"))?;
        let n = header_len(n8, &path, entry)?;
        let hdr = get(8..entry.data_start)
            .await
            .map_err(|e| self.err("get", &e))?;
        if hdr.len() as u64 != n {
            return Err(Error::corrupt(&path, None, "short read of the header"));
        }
        let header = check_header_json(&hdr, &path, entry)?;
        let file_meta: Metadata = header
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        Ok(file_meta)
    }

    /// `rank`'s file entry in `m`, the manifest of committed step `step`; a manifest
    /// without one is corrupt.
    fn entry_of_rank<'m>(&self, m: &'m Manifest, step: u64, rank: u32) -> Result<&'m FileEntry> {
        m.file_of_rank(rank).ok_or_else(|| {
            Error::corrupt(
                self.display(&self.key(step, crate::manifest::MANIFEST)),
                None,
                format!("no file for rank {rank}"),
            )
        })
    }

    /// The `__metadata__` of `rank`'s object of committed step `step`, from its header
    /// (the object's size and header checked against the manifest).
    pub fn file_metadata(&self, step: u64, rank: u32) -> Result<Metadata> {
        let m = self.manifest(step)?;
        let entry = self.entry_of_rank(&m, step, rank)?;
        self.block(self.read_header(&self.key(step, entry.object_name()), entry))
    }

    /// Read one rank's object; returns its bytes and its header's `__metadata__`.
    fn read_entry(
        &self,
        step: u64,
        entry: &FileEntry,
        sink: &mut dyn ReadSink,
    ) -> Result<(u64, Metadata)> {
        self.read_entry_wanted(step, entry, None, sink)
    }

    /// The `__metadata__` of `entry`'s object of committed step `step` (its size and
    /// header checked against `entry`).
    pub(crate) fn entry_metadata(&self, step: u64, entry: &FileEntry) -> Result<Metadata> {
        self.block(self.read_header(&self.key(step, entry.object_name()), entry))
    }

    /// Read the tensors of `entry`'s object (committed step `step`) flagged in `wanted`
    /// (all when `None`): the object's size and header checked, then only those tensors'
    /// byte ranges fetched (runs of wanted tensors coalesced, cut into `part_size` ranged
    /// GETs, `concurrency` in flight), each wanted tensor's CRC-32C checked. `sink` gets
    /// the wanted tensors' pieces only, in file order. Returns the bytes fetched (header
    /// and data) and the header's `__metadata__`.
    pub(crate) fn read_entry_wanted(
        &self,
        step: u64,
        entry: &FileEntry,
        wanted: Option<&[bool]>,
        sink: &mut dyn ReadSink,
    ) -> Result<(u64, Metadata)> {
        if wanted.is_some_and(|w| w.len() != entry.tensors.len()) {
            return Err(Error::Internal(format!(
                "wanted flags for {} tensors, not {}",
                wanted.map_or(0, <[bool]>::len),
                entry.tensors.len()
            )));
        }
        let want = |i: usize| wanted.is_none_or(|w| w[i]);
        let key = self.key(step, entry.object_name());
        let path: PathBuf = self.display(&key);
        let part = self.opts.part_size as u64;
        self.block(async {
            let file_meta = self.read_header(&key, entry).await?;
            // The data section (or the wanted tensors' runs of it), in order, `concurrency`
            // ranges in flight.
            let data_len = entry.bytes - entry.data_start;
            let runs: Vec<(u64, u64)> = match wanted {
                None => vec![(0, data_len)],
                Some(_) => {
                    // Neighbouring wanted tensors (with the padding between them) are one
                    // run; an unwanted tensor's bytes are never fetched.
                    let mut runs: Vec<(u64, u64)> = Vec::new();
                    let mut joins = false;
                    for (i, t) in entry.tensors.iter().enumerate() {
                        let [b, e] = t.data_offsets;
                        if b == e {
                            continue;
                        }
                        if !want(i) {
                            joins = false;
                            continue;
                        }
                        match runs.last_mut() {
                            Some(r) if joins && b >= r.1 => r.1 = e,
                            _ => runs.push((b, e)),
                        }
                        joins = true;
                    }
                    runs
                }
            };
            let ranges: Vec<_> = runs
                .iter()
                .flat_map(|&(rb, re)| {
                    (0..(re - rb).div_ceil(part)).map(move |k| {
                        let b = rb + k * part;
                        let e = (b + part).min(re);
                        entry.data_start + b..entry.data_start + e
                    })
                })
                .collect();
            let fetched: u64 = entry.data_start + runs.iter().map(|r| r.1 - r.0).sum::<u64>();
            let mut crcs: Vec<Option<u32>> = vec![None; entry.tensors.len()];
            let tensors = std::sync::Arc::new(entry.tensors.clone());
            let mut s =
                std::pin::pin!(self.ranges_checked(&key, ranges, tensors, entry.data_start));
            while let Some((r, got)) = s.next().await {
                let got = got.map_err(|e| self.err("get", &e))?;
                if got.bytes.len() as u64 != r.end - r.start {
                    return Err(Error::corrupt(
                        &path,
                        None,
                        format!(
                            "ranged read of {}..{} returned {} bytes",
                            r.start,
                            r.end,
                            got.bytes.len()
                        ),
                    ));
                }
                // The pieces' CRCs were computed by the GET's task; combined here in order.
                for &(i, crc, len) in &got.crcs {
                    let c = &mut crcs[i];
                    *c = Some(match *c {
                        None => crc,
                        Some(prev) => crc32c::crc32c_combine(prev, crc, len),
                    });
                }
                for_pieces(
                    &entry.tensors,
                    r.start - entry.data_start,
                    &got.bytes,
                    |i, at, p| {
                        if want(i) {
                            sink.piece(i, at, p)
                        } else {
                            Ok(())
                        }
                    },
                )?;
                sink.chunk_end()?;
            }
            let crcs: Vec<u32> = crcs.into_iter().map(|c| c.unwrap_or(0)).collect();
            for (i, (t, &crc)) in entry.tensors.iter().zip(&crcs).enumerate() {
                if want(i) && crc != t.crc32c {
                    return Err(Error::Checksum {
                        path: path.clone(),
                        tensor: t.name.clone(),
                        expected: t.crc32c,
                        actual: crc,
                    });
                }
            }
            Ok((fetched, file_meta))
        })
    }

    /// Load `rank`'s tensors of committed step `step` into owned buffers, every checksum
    /// verified. The checkpoint's metadata is the rank file's (its safetensors header's
    /// `__metadata__`).
    pub fn load(&self, step: u64, rank: u32) -> Result<(Checkpoint, RemoteLoad)> {
        let m = self.manifest(step)?;
        let entry = self.entry_of_rank(&m, step, rank)?;
        // Sizes come from a parsed manifest (offsets contiguous, each equal to its dtype and
        // shape's size, summing to the file size): the object must have that size before
        // anything is allocated on the manifest's word.
        self.block(self.check_size(&self.key(step, entry.object_name()), entry))?;
        let mut sink = Owned {
            bufs: entry
                .tensors
                .iter()
                .map(|t| {
                    usize::try_from(t.len())
                        .map(AlignedBytes::zeroed)
                        .map_err(|_| {
                            Error::corrupt(
                                self.display(&self.key(step, entry.object_name())),
                                Some(&t.name),
                                "larger than the address space",
                            )
                        })
                })
                .collect::<Result<_>>()?,
        };
        let t = Instant::now();
        let (bytes, file_meta) = self.read_entry(step, entry, &mut sink)?;
        let tensors = entry
            .tensors
            .iter()
            .zip(sink.bufs)
            .map(|(t, data)| LoadedTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data,
            })
            .collect();
        let ck = Checkpoint {
            step,
            dir: PathBuf::from(format!(
                "{}/{}",
                self.url.trim_end_matches('/'),
                crate::manifest::step_dir_name(step)
            )),
            // This rank's file's metadata (its header's): with several ranks, the manifest
            // holds the committing rank's.
            metadata: file_meta,
            tensors,
        };
        Ok((
            ck,
            RemoteLoad {
                step,
                bytes,
                elapsed: t.elapsed(),
                staged: 0,
                staging: 0,
            },
        ))
    }

    /// Load `rank`'s tensors of `step` into caller buffers by name (each exactly its
    /// tensor's size), every checksum verified.
    pub fn load_into(
        &self,
        step: u64,
        rank: u32,
        dest: &mut [(&str, &mut [u8])],
    ) -> Result<RemoteLoad> {
        let t = Instant::now();
        let m = self.manifest(step)?;
        let entry = self.entry_of_rank(&m, step, rank)?;
        let named: Vec<(&str, u64)> = dest.iter().map(|(n, b)| (*n, b.len() as u64)).collect();
        let order = crate::restore::match_destinations(entry, &named)?;
        let mut slots: Vec<Option<&mut [u8]>> =
            dest.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
        let ordered = order
            .iter()
            .map(|&i| slots[i].take().expect("each destination used once"))
            .collect();
        let mut sink = crate::restore::sink::HostSink { dest: ordered };
        let (bytes, _) = self.read_entry(step, entry, &mut sink)?;
        Ok(RemoteLoad {
            step,
            bytes,
            elapsed: t.elapsed(),
            staged: 0,
            staging: 0,
        })
    }

    /// Load `rank`'s tensors of committed step `step` into device memory by name (each
    /// range exactly its tensor's size): the ranged GETs' bodies are copied into two of
    /// `ring`'s CUDA-registered buffers and sent to the device from there
    /// ([`DeviceRing::staged_sink`]), so no host copy of the whole object is made; every
    /// CRC-32C is verified (a load that fails with [`Error::Checksum`] may have written
    /// some bytes to the destinations).
    ///
    /// # Safety
    /// Every range must be device memory of its device, valid for writes of its length and
    /// not accessed by anyone else until this call returns.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn load_into_device(
        &self,
        step: u64,
        rank: u32,
        ring: &DeviceRing,
        dest: &[(&str, DeviceSlice<'_>)],
    ) -> Result<RemoteLoad> {
        let t = Instant::now();
        let m = self.manifest(step)?;
        let entry = self.entry_of_rank(&m, step, rank)?;
        let named: Vec<(&str, u64)> = dest.iter().map(|(n, d)| (*n, d.len() as u64)).collect();
        let order = crate::restore::match_destinations(entry, &named)?;
        let ordered: Vec<Option<DeviceSlice<'_>>> =
            order.iter().map(|&i| Some(dest[i].1)).collect();
        // SAFETY: forwarded from this function's contract; the sink is dropped (its copies
        // waited for) before this function returns.
        let mut ring_sink = unsafe { ring.staged_sink(entry, ordered)? };
        let (bytes, _) = self.read_entry(step, entry, &mut ring_sink.sink)?;
        ring_sink.sink.finish()?;
        Ok(RemoteLoad {
            step,
            bytes,
            elapsed: t.elapsed(),
            staged: ring_sink.sink.forwarded(),
            staging: ring_sink.sink.staging_bytes(),
        })
    }

    /// Verify every rank's object of committed step `step` (sizes, headers, checksums).
    /// Returns the bytes read.
    pub fn verify(&self, step: u64) -> Result<u64> {
        let m = self.manifest(step)?;
        let mut total = 0u64;
        for f in &m.files {
            total = total.saturating_add(self.read_entry(step, f, &mut Discard)?.0);
        }
        Ok(total)
    }
}
