//! `manifest.json`: what a committed checkpoint holds, and the names on disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// Version of the manifest format written by this crate.
pub const FORMAT_VERSION: u32 = 1;
/// Manifest file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Largest manifest accepted when reading (guards against hostile files).
pub const MAX_MANIFEST_LEN: u64 = 1 << 30;

/// User metadata: string keys and values, stored in the manifest and in each file's
/// safetensors `__metadata__`.
pub type Metadata = BTreeMap<String, String>;

/// A committed checkpoint's description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Training step.
    pub step: u64,
    /// Number of ranks (files).
    pub world_size: u32,
    /// Commit time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Sum of all file sizes.
    pub total_bytes: u64,
    /// User metadata given to `save`.
    pub metadata: Metadata,
    /// One entry per rank file, ordered by rank.
    pub files: Vec<FileEntry>,
}

/// One rank's safetensors file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Rank that wrote it.
    pub rank: u32,
    /// File name, relative to the checkpoint directory.
    pub file: String,
    /// File size.
    pub bytes: u64,
    /// Offset of the data section (8 + header length).
    pub data_start: u64,
    /// Tensors in file order.
    pub tensors: Vec<TensorEntry>,
}

/// One tensor of a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Begin and end offsets relative to the data section, as in the safetensors header.
    pub data_offsets: [u64; 2],
    /// CRC-32C (Castagnoli) of the tensor's bytes.
    pub crc32c: u32,
}

impl TensorEntry {
    /// Byte length.
    pub fn len(&self) -> u64 {
        self.data_offsets[1].saturating_sub(self.data_offsets[0])
    }

    /// True for zero-size tensors.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Manifest {
    /// Parse and sanity-check a manifest (offsets inside the file, sizes matching dtype and
    /// shape). `path` names the file in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Manifest> {
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| Error::corrupt(path, None, format!("manifest is not valid: {e}")))?;
        if m.format_version == 0 || m.format_version > FORMAT_VERSION {
            return Err(Error::corrupt(
                path,
                None,
                format!("unsupported manifest format version {}", m.format_version),
            ));
        }
        // One file per rank, in rank order: a manifest that leaves a rank out must not
        // verify as complete.
        let ranks: Vec<u32> = m.files.iter().map(|f| f.rank).collect();
        if m.world_size == 0 || !ranks.iter().copied().eq(0..m.world_size) {
            return Err(Error::corrupt(
                path,
                None,
                format!(
                    "files of ranks {ranks:?} do not cover world size {}",
                    m.world_size
                ),
            ));
        }
        for f in &m.files {
            if f.file.contains('/') || f.file.is_empty() || f.file == ".." {
                return Err(Error::corrupt(
                    path,
                    None,
                    format!("file name {:?} is not a plain name", f.file),
                ));
            }
            let mut at = 0u64;
            for t in &f.tensors {
                let [b, e] = t.data_offsets;
                if b != at || e < b {
                    return Err(Error::corrupt(
                        path,
                        Some(&t.name),
                        format!(
                            "data offsets [{b}, {e}] leave a hole or overlap (expected start {at})"
                        ),
                    ));
                }
                if t.dtype.byte_len(&t.shape) != Some(e - b) {
                    return Err(Error::corrupt(
                        path,
                        Some(&t.name),
                        format!(
                            "{} bytes do not match {} with shape {:?}",
                            e - b,
                            t.dtype,
                            t.shape
                        ),
                    ));
                }
                at = e;
            }
            if f.data_start.checked_add(at) != Some(f.bytes) {
                return Err(Error::corrupt(
                    path,
                    None,
                    format!(
                        "{}: data start {} + data {} != file size {}",
                        f.file, f.data_start, at, f.bytes
                    ),
                ));
            }
        }
        Ok(m)
    }

    /// Read and parse `dir/manifest.json`.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let meta = std::fs::metadata(&path).map_err(|e| Error::io("stat", &path, e))?;
        if meta.len() > MAX_MANIFEST_LEN {
            return Err(Error::corrupt(&path, None, "manifest is implausibly large"));
        }
        let bytes = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
        Manifest::parse(&bytes, &path)
    }

    /// The file entry of `rank`.
    pub fn file_of_rank(&self, rank: u32) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.rank == rank)
    }

    /// Number of tensors over all files.
    pub fn tensor_count(&self) -> usize {
        self.files.iter().map(|f| f.tensors.len()).sum()
    }
}

/// Name of a committed step directory.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

/// Name of an in-progress step directory.
pub fn partial_dir_name(step: u64) -> String {
    format!("step-{step}.partial")
}

/// Name of a step directory being deleted by retention.
pub fn trash_dir_name(step: u64) -> String {
    format!("step-{step}.trash")
}

/// File name of `rank`'s safetensors file.
pub fn rank_file_name(rank: u32, world_size: u32) -> String {
    format!("rank-{rank:05}-of-{world_size:05}.safetensors")
}

/// Name of one rank's manifest part (multi-rank commits only).
pub fn rank_manifest_name(rank: u32) -> String {
    format!("rank-{rank:05}.manifest.json")
}

/// Parse `step-<N>` (exactly: no suffix, no sign, no leading `+`).
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A committed checkpoint found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Step.
    pub step: u64,
    /// Its directory.
    pub dir: PathBuf,
}

/// Committed checkpoints under `root`, oldest first. Only `step-<N>` directories that hold
/// a `manifest.json` count; partial and trash directories never do.
pub fn list_committed(root: &Path) -> Result<Vec<CheckpointInfo>> {
    let rd = std::fs::read_dir(root).map_err(|e| Error::io("read_dir", root, e))?;
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::io("read_dir", root, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let Some(step) = parse_step_dir(&name) else {
            continue;
        };
        let dir = entry.path();
        if dir.is_dir() && dir.join(MANIFEST).is_file() {
            out.push(CheckpointInfo { step, dir });
        }
    }
    out.sort_by_key(|c| c.step);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_dir_names_parse_strictly() {
        assert_eq!(parse_step_dir("step-12"), Some(12));
        assert_eq!(parse_step_dir(&step_dir_name(7)), Some(7));
        for bad in [
            "step-",
            "step-1.partial",
            "step-+1",
            "step--1",
            "step-1a",
            "xstep-1",
            "step-99999999999999999999999",
        ] {
            assert_eq!(parse_step_dir(bad), None, "{bad}");
        }
    }

    #[test]
    fn parse_rejects_lies() {
        let good = Manifest {
            format_version: 1,
            step: 1,
            world_size: 1,
            created_unix_ms: 0,
            total_bytes: 4104,
            metadata: Metadata::new(),
            files: vec![FileEntry {
                rank: 0,
                file: "f.safetensors".into(),
                bytes: 4104,
                data_start: 4096,
                tensors: vec![TensorEntry {
                    name: "a".into(),
                    dtype: Dtype::F32,
                    shape: vec![2],
                    data_offsets: [0, 8],
                    crc32c: 0,
                }],
            }],
        };
        let p = Path::new("m.json");
        let ok = serde_json::to_vec(&good).unwrap();
        assert_eq!(Manifest::parse(&ok, p).unwrap(), good);
        let mut hole = good.clone();
        hole.files[0].tensors[0].data_offsets = [4, 12];
        let mut size = good.clone();
        size.files[0].tensors[0].shape = vec![3];
        let mut path = good.clone();
        path.files[0].file = "../etc/passwd".into();
        let mut total = good.clone();
        total.files[0].bytes = 1 << 40;
        for bad in [hole, size, path, total] {
            let b = serde_json::to_vec(&bad).unwrap();
            assert!(matches!(Manifest::parse(&b, p), Err(Error::Corrupt { .. })));
        }
        assert!(Manifest::parse(b"{not json", p).is_err());
        assert!(Manifest::parse(&[0xff, 0xfe], p).is_err());
    }
}
