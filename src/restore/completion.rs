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
