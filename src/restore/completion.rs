//! Completion handling shared by the chunked read loops ([`super::extents`]) and the slab
//! reads ([`super::reader`]): chunks being read, their completions, per-tensor CRC checks,
//! and cutting a buffer of data-section bytes into tensor pieces.

use std::path::Path;

use crate::error::{Error, Result};
use crate::manifest::FileEntry;

/// A chunk being read: its index (the order it is processed in), file offset, length, and
/// the bytes read so far.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pending {
    pub(super) chunk: u64,
    pub(super) offset: u64,
    pub(super) want: usize,
    pub(super) got: usize,
}

/// Account one read completion (`result`: bytes read or `-errno`) to chunk `p`: `Ok(true)`
/// once the chunk is complete, `Ok(false)` when the rest must be asked for again (a short
/// read, `EINTR`, `EAGAIN`), else an error naming the file and offset (end of file before
/// the chunk's end is `Truncated`).
pub(super) fn read_completed(
    p: &mut Pending,
    result: i32,
    path: &Path,
    entry: &FileEntry,
) -> Result<bool> {
    let offset = p.offset + p.got as u64;
    if result == -libc::EINTR || result == -libc::EAGAIN {
        return Ok(false);
    }
    if result < 0 {
        let e = std::io::Error::from_raw_os_error(-result);
        return Err(Error::io_at("read", path, offset, e));
    }
    if result == 0 {
        return Err(Error::Truncated {
            path: path.to_owned(),
            expected: entry.bytes,
            actual: offset,
        });
    }
    p.got += result as usize;
    Ok(p.got >= p.want)
}

/// Every tensor's CRC-32C computed from the bytes read (`crcs`, file order) must be the
/// manifest's; the error names the file and the first tensor that differs.
pub(super) fn check_crcs(path: &Path, entry: &FileEntry, crcs: &[u32]) -> Result<()> {
    for (t, &crc) in entry.tensors.iter().zip(crcs) {
        if crc != t.crc32c {
            return Err(Error::Checksum {
                path: path.to_owned(),
                tensor: t.name.clone(),
                expected: t.crc32c,
                actual: crc,
            });
        }
    }
    Ok(())
}

/// Handle read completions: a chunk read whole goes to `complete`; a short read (or
/// `EINTR`, `EAGAIN`) is asked for again with `reissue` (unless an error is recorded
/// already); an error is recorded in `error` (the first one wins) and its buffer dropped.
/// The tuple: the path and entry the reads belong to.
pub(super) fn completions<B>(
    done: Vec<crate::io::queue::Done<Pending, B>>,
    (path, entry): (&Path, &FileEntry),
    error: &mut Option<Error>,
    mut reissue: impl FnMut(B, Pending) -> Result<()>,
    mut complete: impl FnMut(B, Pending),
) {
    for d in done {
        let mut p = d.tag;
        match read_completed(&mut p, d.result, path, entry) {
            Ok(true) => complete(d.lease, p),
            Ok(false) => {
                if error.is_none()
                    && let Err(e) = reissue(d.lease, p)
                {
                    *error = Some(e);
                }
            }
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    }
}

/// A tensor's CRC-32C over one piece of its bytes: `(tensor, crc, bytes)`.
pub(crate) type CrcPiece = (usize, u32, u64);

/// The CRC-32C of each tensor's part in the file bytes `buf` found at file offset `off` of
/// a file whose data section starts at `data_start` (the header's bytes are no tensor's),
/// in tensor order.
pub(crate) fn file_crc_pieces(
    tensors: &[crate::manifest::TensorEntry],
    data_start: u64,
    off: u64,
    buf: &[u8],
) -> Vec<CrcPiece> {
    let end = off + buf.len() as u64;
    if end <= data_start {
        return Vec::new();
    }
    let skip = data_start.saturating_sub(off);
    let mut out = Vec::new();
    let _ = for_pieces::<()>(
        tensors,
        off + skip - data_start,
        &buf[skip as usize..],
        |i, _, piece| {
            out.push((i, crc32c::crc32c(piece), piece.len() as u64));
            Ok(())
        },
    );
    out
}

/// The CRC-32C of each of `n` tensors from its pieces in file order (0 for a tensor
/// without a piece: an empty one).
pub(crate) fn combine_crcs(n: usize, pieces: impl IntoIterator<Item = CrcPiece>) -> Vec<u32> {
    let mut acc: Vec<Option<u32>> = vec![None; n];
    for (t, crc, len) in pieces {
        acc[t] = Some(match acc[t] {
            None => crc,
            Some(prev) => crc32c::crc32c_combine(prev, crc, len as usize),
        });
    }
    acc.into_iter().map(|c| c.unwrap_or(0)).collect()
}

/// Call `f(tensor, offset in the tensor, piece)` for each non-empty tensor piece in `buf`,
/// which holds data-section bytes from `dst` (tensors sorted by offset, as in a manifest).
pub(crate) fn for_pieces<E>(
    tensors: &[crate::manifest::TensorEntry],
    dst: u64,
    buf: &[u8],
    mut f: impl FnMut(usize, u64, &[u8]) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let end = dst + buf.len() as u64;
    let first = tensors.partition_point(|t| t.data_offsets[1] <= dst);
    for (i, t) in tensors.iter().enumerate().skip(first) {
        let [b, e] = t.data_offsets;
        if b >= end {
            break;
        }
        if e == b {
            continue;
        }
        let s = b.max(dst);
        let fin = e.min(end);
        f(i, s - b, &buf[(s - dst) as usize..(fin - dst) as usize])?;
    }
    Ok(())
}
