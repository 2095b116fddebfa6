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
    /// CRC-32C of the file's header bytes (`[0, data_start)`: the length, the JSON with its
    /// `__metadata__`, the padding). Checked by every read, so a header whose metadata was
    /// damaged (the Python package's state skeleton lives there) is refused, not trusted.
    /// Absent in manifests written before it existed (nothing is checked then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_crc32c: Option<u32>,
    /// In a bucket's manifest: the name of the rank's object under `step-N/` when it is
    /// not `file`. Each upload names its object apart
    /// (`rank-R-of-W.<upload id>.safetensors`), so completing one never replaces an object
    /// another writer's manifest names. Absent on disk and in buckets written before it
    /// existed (the object is then `file`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
    /// The session of the run that wrote the file: an id every rank of one run shares
    /// ([`crate::EngineConfig::with_session`]), also in the file's header
    /// (metadata key `shmckpt.session`). A rank's part counts toward a commit only when its
    /// session is the committing writer's (`crate::commit::store::commit_parts`), so a
    /// dead run's part never commits beside a new run's save of the same step number.
    /// Absent when the writer had none (and in entries written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Tensors in file order.
    pub tensors: Vec<TensorEntry>,
}

/// The longest session id ([`FileEntry::session`]).
pub const MAX_SESSION_LEN: usize = 128;

/// Whether `s` can be a session id: 1 to [`MAX_SESSION_LEN`] bytes of ASCII letters,
/// digits, `-`, `_` and `.` (it names objects in a bucket's upload journal).
pub fn is_session_id(s: &str) -> bool {
    (1..=MAX_SESSION_LEN).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
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

impl FileEntry {
    /// The checks every manifest read makes of one rank's entry: plain file and object
    /// names, tensors back to back from the data section's start, each tensor's bytes
    /// matching its dtype and shape, and `data_start` + data == `bytes` (checked
    /// arithmetic). `path` names the manifest in errors ([`Error::Corrupt`]).
    pub fn validate(&self, path: &Path) -> Result<()> {
        let f = self;
        let plain = |n: &str| !(n.contains('/') || n.is_empty() || n == "." || n == "..");
        if let Some(o) = f.object.as_deref().filter(|o| !plain(o)) {
            return Err(Error::corrupt(
                path,
                None,
                format!("object name {o:?} is not a plain name"),
            ));
        }
        if let Some(id) = f.session.as_deref().filter(|id| !is_session_id(id)) {
            return Err(Error::corrupt(
                path,
                None,
                format!("session {id:?} is not a session id"),
            ));
        }
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
        Ok(())
    }

    /// The rank's object under `step-N/` in a bucket: [`FileEntry::object`], else `file`.
    pub fn object_name(&self) -> &str {
        self.object.as_deref().unwrap_or(&self.file)
    }
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
    /// The one manifest builder: the manifest of `step` committing `files`, every rank's
    /// entry (its manifest part), with the user's `metadata`, stamped now. Every commit
    /// (a shared root's, a node-local group's, assembled part-only saves', a bucket's)
    /// builds its manifest here, from parts it did not write itself: they are checked
    /// first. Every rank of `world_size` (at least 1) exactly once, in rank order; no two
    /// ranks naming the same file or object; each entry passing [`FileEntry::validate`];
    /// the total size computed with checked arithmetic. Anything else is
    /// [`Error::Corrupt`] naming `path` (where the manifest is to be written) and nothing
    /// is built, so a manifest built here always passes [`Manifest::parse`].
    pub fn from_parts(
        step: u64,
        world_size: u32,
        files: Vec<FileEntry>,
        metadata: &Metadata,
        path: &Path,
    ) -> Result<Manifest> {
        let ranks: Vec<u32> = files.iter().map(|f| f.rank).collect();
        if world_size == 0 || !ranks.iter().copied().eq(0..world_size) {
            return Err(Error::corrupt(
                path,
                None,
                format!(
                    "step {step}: parts of ranks {ranks:?} do not cover world size {world_size} once each, in order"
                ),
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        let mut objects = std::collections::BTreeSet::new();
        let mut total_bytes = 0u64;
        for f in &files {
            f.validate(path)?;
            if !names.insert(f.file.as_str()) || !objects.insert(f.object_name()) {
                return Err(Error::corrupt(
                    path,
                    None,
                    format!(
                        "step {step}: rank {} names file {:?} (object {:?}) another rank names",
                        f.rank,
                        f.file,
                        f.object_name()
                    ),
                ));
            }
            total_bytes = total_bytes.checked_add(f.bytes).ok_or_else(|| {
                Error::corrupt(
                    path,
                    None,
                    format!("step {step}: the parts' sizes overflow"),
                )
            })?;
        }
        Ok(Manifest {
            format_version: FORMAT_VERSION,
            step,
            world_size,
            created_unix_ms: crate::util::unix_ms(),
            total_bytes,
            metadata: metadata.clone(),
            files,
        })
    }

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
            f.validate(path)?;
        }
        Ok(m)
    }

    /// Read and parse `dir/manifest.json`.
    ///
    /// The manifest is opened without following a link or blocking, and must be a regular
    /// file. When `dir` is named like a step directory (`step-N`), the manifest must be of
    /// step N.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let m = Manifest::read_any_name(dir)?;
        if let Some(name) = dir.file_name().and_then(|n| n.to_str())
            && let Some(step) = parse_step_dir(name)
        {
            m.expect_step(step, dir, "its directory")?;
        }
        Ok(m)
    }

    /// [`Error::Corrupt`] (naming both steps) unless this manifest, read from `dir`, is of
    /// `step`, the step `whose` (the directory's name, a link, the caller) says `dir` holds:
    /// a step directory replaced by a copy of another step is never loaded as the step asked
    /// for.
    pub fn expect_step(&self, step: u64, dir: &Path, whose: &str) -> Result<()> {
        if self.step == step {
            return Ok(());
        }
        Err(Error::corrupt(
            dir.join(MANIFEST),
            None,
            format!("manifest is of step {}, {whose} of step {step}", self.step),
        ))
    }

    /// Read and parse `dir/manifest.json` like [`Manifest::read`], without binding the
    /// name of `dir` to the manifest's step: for a checkpoint directory its user named
    /// (a DCP checkpoint: `step-100`, `checkpoint-500`, `epoch=3-step=900`), whose
    /// manifest's step is not the name's.
    pub fn read_any_name(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let bytes = read_manifest_bytes(&path)?;
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

/// The bytes of the manifest file `path`: a regular file (no link, FIFO or device) of at
/// most [`MAX_MANIFEST_LEN`] bytes.
pub(crate) fn read_manifest_bytes(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = crate::fsx::open_path(path, false)?;
    let len = f.metadata().map_err(|e| Error::io("stat", path, e))?.len();
    if len > MAX_MANIFEST_LEN {
        return Err(Error::corrupt(path, None, "manifest is implausibly large"));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    f.take(MAX_MANIFEST_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io("read", path, e))?;
    if bytes.len() as u64 > MAX_MANIFEST_LEN {
        return Err(Error::corrupt(path, None, "manifest is implausibly large"));
    }
    Ok(bytes)
}

/// The step after `latest` (1 when there is none), or [`Error::StepOverflow`] when
/// `latest` is `u64::MAX`: step numbers never wrap.
pub fn next_step(root: &Path, latest: Option<u64>) -> Result<u64> {
    match latest {
        None => Ok(1),
        Some(s) => s.checked_add(1).ok_or_else(|| Error::StepOverflow {
            step: s,
            root: root.to_owned(),
        }),
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

/// Name a committed step directory is set aside under (`crate::commit::set_aside`):
/// `step-<N>.aside-<unix ms>`, never listed, loaded or cleaned.
pub fn aside_dir_name(step: u64, unix_ms: u128) -> String {
    format!("step-{step}.aside-{unix_ms}")
}

/// Prefix of the hidden names stale directories are moved to before they are removed
/// behind an engine's open (`crate::commit::clean_stale`): outside the step namespace.
const REMOVING_PREFIX: &str = ".shmckpt-removing.";

/// The hidden name the stale directory `name` (`step-<N>.partial`, `step-<N>.trash`) is
/// moved to before its removal: `.shmckpt-removing.<name>.<pid>.<unix ns>`. Never listed,
/// loaded or committed (no `step-` prefix); removed by the next sweep if a crash
/// interrupts its removal.
pub fn removing_dir_name(name: &str) -> String {
    let ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{REMOVING_PREFIX}{name}.{}.{ns}", std::process::id())
}

/// Whether `name` is one of [`removing_dir_name`]'s.
pub fn is_removing_dir_name(name: &str) -> bool {
    name.starts_with(REMOVING_PREFIX)
}

/// File name of `rank`'s safetensors file.
pub fn rank_file_name(rank: u32, world_size: u32) -> String {
    format!("rank-{rank:05}-of-{world_size:05}.safetensors")
}

/// Name of one rank's manifest part (multi-rank commits only).
pub fn rank_manifest_name(rank: u32) -> String {
    format!("rank-{rank:05}.manifest.json")
}

/// Parse a canonical `step-<N>`: decimal digits without leading zeros (`step-0` is the
/// only name starting with `0`), within `u64`, no suffix, no sign. Exactly the names
/// [`step_dir_name`] makes: `parse_step_dir(name) == Some(n)` implies
/// `step_dir_name(n) == name`.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty()
        || !digits.bytes().all(|b| b.is_ascii_digit())
        || (digits.len() > 1 && digits.starts_with('0'))
    {
        return None;
    }
    digits.parse().ok()
}

/// Parse a canonical `step-<N><suffix>` (e.g. `.partial`, `.trash`).
pub fn parse_step_with_suffix(name: &str, suffix: &str) -> Option<u64> {
    parse_step_dir(name.strip_suffix(suffix)?)
}

/// The step whose commit `path` is, relative to a checkpoint root (a directory or a
/// bucket prefix): exactly `step-<N>/manifest.json` with a canonical step name. The one
/// rule of which names can commit a step, on disk and in a bucket ([`list_committed`],
/// the remote tier's listing); nothing deeper or otherwise named (`step-9/x/manifest.json`,
/// `step-09/manifest.json`) ever can.
pub fn step_of_manifest_path<'a>(path: impl IntoIterator<Item = &'a str>) -> Option<u64> {
    let mut it = path.into_iter();
    let step = parse_step_dir(it.next()?)?;
    (it.next()? == MANIFEST && it.next().is_none()).then_some(step)
}

/// Whether the bytes of a step's `manifest.json`, found at `step-<step>/manifest.json`,
/// commit that step: they parse as a manifest naming `step`. `Err` says why not (the
/// step directory is then ignored, never listed, loaded or deleted). The listing's check,
/// on disk and in a bucket.
pub fn check_listed_manifest(bytes: &[u8], step: u64) -> std::result::Result<(), String> {
    #[derive(Deserialize)]
    struct StepOnly {
        step: u64,
    }
    match serde_json::from_slice::<StepOnly>(bytes) {
        Ok(m) if m.step == step => Ok(()),
        Ok(m) => Err(format!("its manifest is of step {}", m.step)),
        Err(e) => Err(format!("its manifest is not valid: {e}")),
    }
}

/// What the one listing rule ([`list_steps`]) reads of a checkpoint root: a local
/// directory ([`LocalDir`]) or a bucket prefix (`crate::remote::Remote`). The commit
/// protocol's store (`crate::commit::store::CommitStore`) builds on it.
pub trait StepListing {
    /// The root, for messages.
    fn describe(&self) -> String;
    /// The path (segments relative to the root) of every file or object under a
    /// `step-*` name that may be a step's manifest. The rule ([`step_of_manifest_path`])
    /// decides which are: those of any other shape are ignored with a warning.
    fn manifest_paths(&self) -> Result<Vec<Vec<String>>>;
    /// What `step-<step>/manifest.json` holds; `Err` when the root cannot be read at all.
    fn manifest_bytes(&self, step: u64) -> Result<ManifestBytes>;
}

/// What a store holds at `step-N/manifest.json` ([`StepListing::manifest_bytes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestBytes {
    /// Nothing: the step is not committed (or went meanwhile).
    Absent,
    /// The manifest's bytes, read as a manifest may be (no link followed, size-capped).
    Bytes(Vec<u8>),
    /// Something that cannot be read as a manifest may be (a link, a file too large), and
    /// why: the step is ignored.
    Unreadable(String),
}

/// What [`list_steps`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// Committed steps, oldest first.
    pub committed: Vec<u64>,
    /// Steps whose `step-N/manifest.json` is present but does not commit them, with why:
    /// never listed, loaded or deleted.
    pub ignored: BTreeMap<u64, String>,
}

/// The one rule of which steps a root has committed, on disk and in a bucket: a step N is
/// committed when exactly `step-<N>/manifest.json` ([`step_of_manifest_path`], canonical
/// names only) is there, readable as a manifest may be, and its bytes name step N
/// ([`check_listed_manifest`]). Anything else named like a step's manifest
/// (`step-9/x/manifest.json`, `step-05/manifest.json`, a manifest of another step, an
/// unreadable one) is ignored with a warning.
pub fn list_steps<S: StepListing + ?Sized>(store: &S) -> Result<Listing> {
    let mut steps = std::collections::BTreeSet::new();
    for path in store.manifest_paths()? {
        match step_of_manifest_path(path.iter().map(String::as_str)) {
            Some(step) => {
                steps.insert(step);
            }
            None => tracing::warn!(
                root = %store.describe(),
                path = %path.join("/"),
                "ignoring a name that is not a canonical step-N/manifest.json"
            ),
        }
    }
    let mut out = Listing::default();
    for step in steps {
        let why = match store.manifest_bytes(step)? {
            ManifestBytes::Absent => continue, // not committed
            ManifestBytes::Bytes(bytes) => match check_listed_manifest(&bytes, step) {
                Ok(()) => {
                    out.committed.push(step);
                    continue;
                }
                Err(why) => why,
            },
            ManifestBytes::Unreadable(why) => why,
        };
        tracing::warn!(root = %store.describe(), step, "ignoring a step: {why}");
        out.ignored.insert(step, why);
    }
    Ok(out)
}

/// A checkpoint root on a local filesystem: `root/step-N/` directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalDir {
    root: PathBuf,
}

impl LocalDir {
    /// The root directory `root` (followed as given, as the root is everywhere).
    pub fn new(root: impl Into<PathBuf>) -> LocalDir {
        LocalDir { root: root.into() }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl StepListing for LocalDir {
    fn describe(&self) -> String {
        self.root.display().to_string()
    }

    /// `step-*/manifest.json` of each entry named `step-*` but for partial and trash
    /// directories (never committed steps).
    fn manifest_paths(&self) -> Result<Vec<Vec<String>>> {
        let root = &self.root;
        let rd = std::fs::read_dir(root).map_err(|e| Error::io("read_dir", root, e))?;
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| Error::io("read_dir", root, e))?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if name.starts_with("step-") && !name.ends_with(".partial") && !name.ends_with(".trash")
            {
                out.push(vec![name, MANIFEST.to_owned()]);
            }
        }
        Ok(out)
    }

    /// Only a real (not linked) directory's regular `manifest.json`, opened without
    /// following a link, size-capped.
    fn manifest_bytes(&self, step: u64) -> Result<ManifestBytes> {
        let dir = self.root.join(step_dir_name(step));
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.file_type().is_dir() => {}
            Ok(_) => {
                return Ok(ManifestBytes::Unreadable(
                    "its name is not a real directory (a link or a file)".into(),
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ManifestBytes::Absent),
            Err(e) => return Ok(ManifestBytes::Unreadable(format!("it cannot be read: {e}"))),
        }
        match read_manifest_bytes(&dir.join(MANIFEST)) {
            Ok(b) => Ok(ManifestBytes::Bytes(b)),
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Ok(ManifestBytes::Absent)
            }
            Err(e) => Ok(ManifestBytes::Unreadable(format!(
                "its manifest cannot be read: {e}"
            ))),
        }
    }
}

/// A committed checkpoint found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Step.
    pub step: u64,
    /// Its directory.
    pub dir: PathBuf,
}

/// Committed checkpoints under `root`, oldest first, by the one listing rule
/// ([`list_steps`] over [`LocalDir`]). Only real (not linked) directories with a
/// canonical `step-<N>` name that hold a regular `manifest.json` of step N count;
/// partial and trash directories never do. Anything else named like a step (`step-05`, a
/// link `step-9 -> step-4`, a manifest of another step, an unreadable manifest) is
/// ignored with a warning: never listed, loaded or deleted.
pub fn list_committed(root: &Path) -> Result<Vec<CheckpointInfo>> {
    Ok(list_steps(&LocalDir::new(root))?
        .committed
        .into_iter()
        .map(|step| CheckpointInfo {
            step,
            dir: root.join(step_dir_name(step)),
        })
        .collect())
}

/// The leftovers of saves not committed under `root`: the steps of its `step-<N>.partial`
/// directories, ascending. Only real directories with a canonical name count (`file_type`
/// does not follow links): a link or a file under such a name is never listed, so nothing
/// reads, completes or removes anything through it. The one lister of partial directories
/// (the open's sweep, a resume's withdrawal, the completion of a memory-only step).
pub fn list_partial(root: &Path) -> Result<Vec<u64>> {
    list_suffixed(root, ".partial")
}

/// [`list_partial`] for the leftovers of an interrupted retention (`step-<N>.trash`).
pub fn list_trash(root: &Path) -> Result<Vec<u64>> {
    list_suffixed(root, ".trash")
}

fn list_suffixed(root: &Path, suffix: &str) -> Result<Vec<u64>> {
    let rd = std::fs::read_dir(root).map_err(|e| Error::io("read_dir", root, e))?;
    let mut steps: Vec<u64> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| parse_step_with_suffix(n, suffix))
        })
        .collect();
    steps.sort_unstable();
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_step_n_manifest_json_commits_a_step() {
        let f = |p: &str| step_of_manifest_path(p.split('/'));
        assert_eq!(f("step-7/manifest.json"), Some(7));
        for bad in [
            "step-7/notes/manifest.json",
            "step-07/manifest.json",
            "step-7.partial/manifest.json",
            "step-7/rank-00000.manifest.json",
            "step-7",
            "x/step-7/manifest.json",
        ] {
            assert_eq!(f(bad), None, "{bad}");
        }
        assert_eq!(check_listed_manifest(br#"{"step": 7}"#, 7), Ok(()));
        assert_eq!(
            check_listed_manifest(br#"{"step": 8}"#, 7),
            Err("its manifest is of step 8".into())
        );
        assert!(check_listed_manifest(b"[]", 7).is_err());
    }

    #[test]
    fn step_dir_names_parse_strictly() {
        assert_eq!(parse_step_dir("step-12"), Some(12));
        assert_eq!(parse_step_dir(&step_dir_name(7)), Some(7));
        assert_eq!(parse_step_dir("step-0"), Some(0));
        assert_eq!(parse_step_dir("step-18446744073709551615"), Some(u64::MAX));
        assert_eq!(
            parse_step_with_suffix("step-3.partial", ".partial"),
            Some(3)
        );
        assert_eq!(parse_step_with_suffix("step-03.partial", ".partial"), None);
        let r = Path::new("/r");
        assert_eq!(next_step(r, None).unwrap(), 1);
        assert_eq!(next_step(r, Some(41)).unwrap(), 42);
        assert!(matches!(
            next_step(r, Some(u64::MAX)),
            Err(Error::StepOverflow { step: u64::MAX, .. })
        ));
        for bad in [
            "step-",
            "step-1.partial",
            "step-+1",
            "step--1",
            "step-1a",
            "xstep-1",
            "step-99999999999999999999999",
            "step-18446744073709551616",
            "step-05",
            "step-00",
            "step- 5",
            "step-5 ",
        ] {
            assert_eq!(parse_step_dir(bad), None, "{bad}");
        }
    }

    /// A directory named `step-N` must hold a manifest of step N for `read`, whatever
    /// step for `read_any_name` (a DCP checkpoint directory its trainer named).
    #[test]
    fn only_read_binds_the_directory_name_to_the_step() {
        let root = tempfile::tempdir().unwrap();
        let m = Manifest {
            format_version: 1,
            step: 15_258_825_091_006_987,
            world_size: 1,
            created_unix_ms: 0,
            total_bytes: 0,
            metadata: Metadata::new(),
            files: vec![FileEntry {
                rank: 0,
                file: "f.safetensors".into(),
                bytes: 0,
                data_start: 0,
                header_crc32c: None,
                object: None,
                session: None,
                tensors: Vec::new(),
            }],
        };
        for name in [
            "step-100",
            "checkpoint-500",
            "global_step1000",
            "epoch=3-step=900",
            "plain",
        ] {
            let dir = root.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
            assert_eq!(Manifest::read_any_name(&dir).unwrap(), m, "{name}");
            let strict = Manifest::read(&dir);
            if name == "step-100" {
                let e = strict.unwrap_err().to_string();
                assert!(e.contains("its directory of step 100"), "{e}");
            } else {
                assert_eq!(strict.unwrap(), m, "{name}");
            }
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
                header_crc32c: None,
                object: None,
                session: None,
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

    /// The one builder refuses parts that are not every rank's once, in order, each with
    /// its own file, valid, and of a total that fits; what it builds parses.
    #[test]
    fn from_parts_checks_every_part() {
        let part = |rank: u32, bytes: u64| FileEntry {
            rank,
            file: rank_file_name(rank, 2),
            bytes,
            data_start: bytes,
            header_crc32c: None,
            object: None,
            session: None,
            tensors: Vec::new(),
        };
        let p = Path::new("step-3/manifest.json");
        let meta: Metadata = [("k".to_owned(), "v".to_owned())].into();
        let m = Manifest::from_parts(3, 2, vec![part(0, 8), part(1, 16)], &meta, p).unwrap();
        assert_eq!((m.step, m.world_size, m.total_bytes), (3, 2, 24));
        assert_eq!((m.format_version, &m.metadata), (FORMAT_VERSION, &meta));
        let bytes = serde_json::to_vec(&m).unwrap();
        assert_eq!(Manifest::parse(&bytes, p).unwrap(), m);

        let mut same_file = part(1, 16);
        same_file.file = rank_file_name(0, 2);
        let mut bad_entry = part(1, 16);
        bad_entry.data_start = 4;
        let cases: [(u32, Vec<FileEntry>, &str); 6] = [
            (2, vec![part(1, 8), part(0, 8)], "parts of ranks [1, 0]"),
            (2, vec![part(0, 8)], "parts of ranks [0]"),
            (
                2,
                vec![part(0, 8), part(1, 8), part(1, 8)],
                "parts of ranks [0, 1, 1]",
            ),
            (0, vec![], "world size 0"),
            (2, vec![part(0, 8), same_file], "another rank names"),
            (
                2,
                vec![part(0, 8), bad_entry],
                "data start 4 + data 0 != file size 16",
            ),
        ];
        for (world, parts, want) in cases {
            let e = Manifest::from_parts(3, world, parts, &meta, p).unwrap_err();
            assert!(matches!(e, Error::Corrupt { .. }), "{want}: {e}");
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
        let e =
            Manifest::from_parts(3, 2, vec![part(0, u64::MAX), part(1, 1)], &meta, p).unwrap_err();
        assert!(e.to_string().contains("sizes overflow"), "{e}");
    }
}
