//! The check of an image against its manifest entry, all at once ([`check_bytes`]) or
//! piece by piece as its bytes arrive ([`ImageCheck`]): the same checks either way.

use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};
use crate::manifest::FileEntry;

/// The bytes of `len` as a `usize`, or why not.
pub(super) fn mem_len(len: u64, what: &Path) -> Result<usize> {
    usize::try_from(len).map_err(|_| Error::corrupt(what, None, "larger than memory"))
}

/// Check `bytes`, labelled `what` in errors, against `entry`: exactly `entry.bytes` long,
/// a safetensors header describing exactly the manifest's tensors (the check every read
/// from disk makes, [`crate::restore::check_header`]), every tensor's CRC-32C equal to
/// the manifest's.
pub(super) fn check_bytes(bytes: &[u8], entry: &FileEntry, what: &Path) -> Result<()> {
    let mut check = ImageCheck::new(entry);
    check.finish(bytes, entry, what)
}

/// An image's check made as its bytes arrive: [`ImageCheck::advance`] checks what a
/// received prefix of the image completes (the header once it is all there, then each
/// tensor whose bytes are all there, its CRC-32C), [`ImageCheck::finish`] the rest and the
/// length. The caller guarantees that a prefix, once given, never changes (it is
/// read-only memory from then on): what was checked stays checked.
#[derive(Debug)]
pub(super) struct ImageCheck {
    /// The header was checked (the data section starts at `data_start`).
    header: bool,
    /// Tensors checked, by their index in the entry.
    done: Vec<bool>,
    /// Tensors still to check.
    left: usize,
}

impl ImageCheck {
    pub(super) fn new(entry: &FileEntry) -> ImageCheck {
        ImageCheck {
            header: false,
            done: vec![false; entry.tensors.len()],
            left: entry.tensors.len(),
        }
    }

    /// Check what the image's first `prefix.len()` bytes complete that was not checked
    /// yet. An error means the image does not match (it is never to be published).
    pub(super) fn advance(&mut self, prefix: &[u8], entry: &FileEntry, what: &Path) -> Result<()> {
        if prefix.len() as u64 > entry.bytes {
            return Err(Error::corrupt(
                what,
                None,
                format!("more than the {} bytes the manifest says", entry.bytes),
            ));
        }
        let hdr_len = mem_len(entry.data_start.min(entry.bytes), what)?;
        if !self.header {
            if prefix.len() < hdr_len {
                return Ok(());
            }
            // The header check reads a file: give it the header bytes in an anonymous one.
            let fd =
                rustix::fs::memfd_create("shmckpt-replica-header", rustix::fs::MemfdFlags::CLOEXEC)
                    .map_err(|e| Error::io("memfd_create", what, e.into()))?;
            let mut file = std::fs::File::from(fd);
            file.write_all(&prefix[..hdr_len])
                .map_err(|e| Error::io("write", what, e))?;
            crate::restore::check_header(&file, what, entry)?;
            self.header = true;
        }
        // `check_header` proved 8 + header length == data_start and the data section's
        // length equals the header's; the offsets are still taken with checks.
        let data_len = mem_len(entry.bytes, what)? - hdr_len;
        // (A shorter prefix than an earlier one, never given, has nothing new.)
        let have = prefix.get(hdr_len..).unwrap_or_default();
        let mut ready = Vec::new();
        let mut pieces = Vec::new();
        for (i, t) in entry.tensors.iter().enumerate() {
            if self.done[i] {
                continue;
            }
            let [b, e] = t.data_offsets;
            let (b, e) = (mem_len(b, what)?, mem_len(e, what)?);
            if b > e || e > data_len {
                return Err(Error::corrupt(
                    what,
                    Some(&t.name),
                    "lies outside the data section",
                ));
            }
            if e <= have.len() {
                ready.push(i);
                pieces.push(&have[b..e]);
            }
        }
        for (&i, actual) in ready.iter().zip(crcs(&pieces)) {
            let t = &entry.tensors[i];
            if actual != t.crc32c {
                return Err(Error::Checksum {
                    path: what.to_owned(),
                    tensor: t.name.clone(),
                    expected: t.crc32c,
                    actual,
                });
            }
            self.done[i] = true;
            self.left -= 1;
        }
        Ok(())
    }

    /// Check the whole image `bytes` (a prefix given before must be its start, unchanged):
    /// exactly `entry.bytes` long, and everything [`ImageCheck::advance`] did not check yet.
    pub(super) fn finish(&mut self, bytes: &[u8], entry: &FileEntry, what: &Path) -> Result<()> {
        let len = bytes.len() as u64;
        if len < entry.bytes {
            return Err(Error::Truncated {
                path: what.to_owned(),
                expected: entry.bytes,
                actual: len,
            });
        }
        self.advance(bytes, entry, what)?;
        if !self.header || self.left != 0 {
            // Never: the whole image holds the header and every tensor (checked above).
            return Err(Error::Internal(format!(
                "{}: the image's check did not cover every tensor",
                what.display()
            )));
        }
        Ok(())
    }

    /// Tensors checked so far.
    pub(super) fn checked(&self) -> usize {
        self.done.len() - self.left
    }
}

/// The CRC-32C of each of `pieces`, computed on up to 8 threads (each piece cut in parts of
/// at most 64 MiB, the parts' CRCs combined).
pub(super) fn crcs(pieces: &[&[u8]]) -> Vec<u32> {
    const PART: usize = 64 << 20;
    let parts: Vec<(usize, &[u8])> = pieces
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            let n = p.len().div_ceil(PART).max(1);
            (0..n).map(move |k| (i, &p[k * PART..((k + 1) * PART).min(p.len())]))
        })
        .collect();
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let threads = crate::util::threads_for(total.div_ceil(PART));
    let mut part_crcs = vec![0u32; parts.len()];
    if threads <= 1 {
        for (c, (_, p)) in part_crcs.iter_mut().zip(&parts) {
            *c = crc32c::crc32c(p);
        }
    } else {
        let per = parts.len().div_ceil(threads);
        std::thread::scope(|scope| {
            for (out, work) in part_crcs.chunks_mut(per).zip(parts.chunks(per)) {
                scope.spawn(move || {
                    for (c, (_, p)) in out.iter_mut().zip(work) {
                        *c = crc32c::crc32c(p);
                    }
                });
            }
        });
    }
    let mut out: Vec<Option<u32>> = vec![None; pieces.len()];
    for ((i, p), c) in parts.iter().zip(part_crcs) {
        out[*i] = Some(match out[*i] {
            None => c,
            Some(prev) => crc32c::crc32c_combine(prev, c, p.len()),
        });
    }
    out.into_iter().map(|c| c.unwrap_or(0)).collect()
}
