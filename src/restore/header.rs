//! The checks every read starts with: the file is a regular file of exactly the size the
//! manifest says, and its safetensors header describes exactly the manifest's tensors.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::io::file::FileTarget;
use crate::manifest::FileEntry;
use crate::plan::MAX_HEADER_LEN;

/// Open `path` for reading (O_DIRECT when `direct` and allowed) after checking it against
/// `entry`: a regular file (no link followed, never blocking on a FIFO), of exactly
/// `entry.bytes`, with a header that matches.
pub(crate) fn open_checked(
    path: &Path,
    entry: &FileEntry,
    direct: bool,
) -> Result<Arc<FileTarget>> {
    // Opened first without following a link and without blocking, and refused unless it is
    // a regular file: a FIFO or device in place of a rank file must not hang or be read.
    let checked = crate::fsx::open_path(path, false)?;
    let target = Arc::new(FileTarget::open_read(path, direct)?);
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
    Ok(target)
}

/// Read and check the safetensors header of `path` against `entry`.
pub fn check_header(file: &std::fs::File, path: &Path, entry: &FileEntry) -> Result<()> {
    read_checked_header(file, path, entry).map(|_| ())
}

/// The `__metadata__` of this rank file's header, after every check of [`check_header`]
/// (its CRC-32C against the manifest's included): what the Python package reads its state
/// skeleton from. The file is opened without following a link.
pub fn read_file_metadata(path: &Path, entry: &FileEntry) -> Result<crate::manifest::Metadata> {
    let file = crate::fsx::open_path(path, false)?;
    let meta = read_checked_header(&file, path, entry)?;
    Ok(meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect())
}

fn read_checked_header(
    file: &std::fs::File,
    path: &Path,
    entry: &FileEntry,
) -> Result<safetensors::tensor::Metadata> {
    let mut n8 = [0u8; 8];
    read_exact(file, &mut n8, 0, path, entry)?;
    let n = header_len(n8, path, entry)?;
    let mut hdr = vec![0u8; n as usize];
    read_exact(file, &mut hdr, 8, path, entry)?;
    check_header_json(&hdr, path, entry)
}

/// `read_exact_at`, with a file that ends early reported as [`Error::Truncated`] (against
/// the manifest's size), not as an I/O error.
fn read_exact(
    file: &std::fs::File,
    buf: &mut [u8],
    at: u64,
    path: &Path,
    entry: &FileEntry,
) -> Result<()> {
    file.read_exact_at(buf, at).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::Truncated {
                path: path.to_owned(),
                expected: entry.bytes,
                actual: file.metadata().map(|m| m.len()).unwrap_or(0),
            }
        } else {
            Error::io_at("read", path, at, e)
        }
    })
}

/// The header length that the file's first 8 bytes give, checked against the format's
/// limit and `entry`'s data start.
pub(crate) fn header_len(n8: [u8; 8], path: &Path, entry: &FileEntry) -> Result<u64> {
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
    Ok(n)
}

/// Check a safetensors header's JSON (the bytes after the length) against `entry`;
/// returns the parsed header.
pub(crate) fn check_header_json(
    hdr: &[u8],
    path: &Path,
    entry: &FileEntry,
) -> Result<safetensors::tensor::Metadata> {
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(hdr)
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
    // Last, so that a header that disagrees with the manifest's tensors is reported as
    // such (naming the tensor); what is left for the CRC is the rest: `__metadata__`, the
    // JSON's spelling, the padding.
    if let Some(want) = entry.header_crc32c {
        let have = crc32c::crc32c_append(crc32c::crc32c(&(hdr.len() as u64).to_le_bytes()), hdr);
        if have != want {
            return Err(Error::corrupt(
                path,
                None,
                format!("header CRC-32C {have:08x}, the manifest says {want:08x} (damaged header)"),
            ));
        }
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank file cut short inside its header is `Truncated` with both sizes, not an
    /// `Io` error without an errno (what reading the state skeleton reported).
    #[test]
    fn a_file_cut_inside_its_header_is_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rank-00000-of-00001.safetensors");
        let mut bytes = 4088u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[b' '; 92]);
        std::fs::write(&path, &bytes).unwrap();
        let entry = FileEntry {
            rank: 0,
            file: "rank-00000-of-00001.safetensors".into(),
            bytes: 4096 + 64,
            data_start: 4096,
            header_crc32c: None,
            object: None,
            session: None,
            tensors: Vec::new(),
        };
        match read_file_metadata(&path, &entry) {
            Err(Error::Truncated {
                path: p,
                expected,
                actual,
            }) => {
                assert_eq!((p, expected, actual), (path.clone(), 4160, 100));
            }
            other => panic!("expected Truncated, got {other:?}"),
        }
    }
}
