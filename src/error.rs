//! The one error type of shmckpt.
//!
//! Every variant carries the context a user needs to act on it: the tensor name, the file
//! path, the byte offset, the errno. Input errors are detected before anything is staged or
//! written, so an `Err` from validation means nothing changed on disk or in staging.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in shmckpt.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor has an empty name.
    #[error("tensor #{index} has an empty name")]
    EmptyName {
        /// Position of the tensor in the list given to `save`.
        index: usize,
    },
    /// Two tensors share a name.
    #[error("duplicate tensor name {name:?}")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// A tensor name is longer than the format allows, or is reserved.
    #[error("invalid tensor name {name:?}: {reason}")]
    InvalidName {
        /// The name (truncated to 80 characters when very long).
        name: String,
        /// Why it is refused.
        reason: String,
    },
    /// A tensor's byte length does not equal dtype size × number of elements.
    #[error("tensor {name:?}: {dtype} with shape {shape:?} needs {} bytes, got {actual}", .expected.map(|e| e.to_string()).unwrap_or_else(|| "a fractional or overflowing number of".into()))]
    SizeMismatch {
        /// Tensor name.
        name: String,
        /// Its dtype, as the safetensors string.
        dtype: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// Bytes the dtype and shape require (`None` if the product overflows).
        expected: Option<u64>,
        /// Bytes the caller provided.
        actual: u64,
    },
    /// The shape's element count does not fit in 64 bits.
    #[error("tensor {name:?}: shape {shape:?} overflows the element count")]
    ShapeOverflow {
        /// Tensor name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A metadata key is reserved or invalid.
    #[error("invalid metadata key {key:?}: {reason}")]
    InvalidMetadata {
        /// The key.
        key: String,
        /// Why it is refused.
        reason: String,
    },
    /// The safetensors header would exceed the format's limit.
    #[error("safetensors header of {len} bytes exceeds the format limit of {max} bytes")]
    HeaderTooLarge {
        /// Header length that would be written.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The checkpoint file image is larger than the staging arena.
    #[error(
        "checkpoint needs {needed} bytes of staging but the arena holds {capacity} bytes; raise staging_capacity"
    )]
    TooLarge {
        /// Staging bytes the checkpoint needs (file size rounded up to whole chunks).
        needed: u64,
        /// Staging capacity of the engine.
        capacity: u64,
    },
    /// A size computed from the caller's tensors does not fit in 64 bits.
    #[error("{what} overflows 64 bits")]
    SizeOverflow {
        /// What was being computed.
        what: &'static str,
    },
    /// A checkpoint for this step already exists (committed or in flight).
    #[error("step {step} already exists in {root}")]
    StepExists {
        /// The step.
        step: u64,
        /// Checkpoint root.
        root: PathBuf,
    },
    /// No committed checkpoint matches the request.
    #[error("no committed checkpoint {what} in {root}")]
    NotFound {
        /// What was asked for ("latest", "step 7").
        what: String,
        /// The step asked for, when one was (`None` for "latest").
        step: Option<u64>,
        /// Checkpoint root.
        root: PathBuf,
    },
    /// The checkpoint root does not exist or is not a directory.
    #[error("checkpoint root {path} does not exist or is not a directory")]
    RootMissing {
        /// The root.
        path: PathBuf,
    },
    /// The checkpoint root is missing and could not be created
    /// ([`crate::EngineConfig::with_create_root`]).
    #[error("cannot create checkpoint root {path}: {source}")]
    RootCreateFailed {
        /// The root.
        path: PathBuf,
        /// What `mkdir` returned (for the root or one of its parents).
        source: io::Error,
    },
    /// The checkpoint root cannot be written.
    #[error("checkpoint root {path} is not writable: {source}")]
    RootNotWritable {
        /// The root.
        path: PathBuf,
        /// What the probe write returned.
        source: io::Error,
    },
    /// Another engine of the same rank holds this root.
    #[error("checkpoint root {path} is already used by another engine of rank {rank} (lock held)")]
    RootLocked {
        /// The root.
        path: PathBuf,
        /// Rank.
        rank: u32,
    },
    /// An arena was not removed because its owner may be running: a kept arena whose
    /// engine (the engine of its root and rank) runs or may run (`remove_kept_forced`,
    /// `shmckpt shm rm --force`, removes it anyway), a staging arena whose owner process
    /// runs (`recover::remove_dead_arena`), a replica's temporary file whose writer runs.
    #[error("arena {name} not removed: {reason}")]
    ArenaInUse {
        /// The arena's name in `/dev/shm`.
        name: String,
        /// Why its owner counts as alive.
        reason: String,
    },
    /// A path under the checkpoint root or in `/dev/shm` is not what shmckpt creates: a
    /// symbolic link, a FIFO, a device, a directory where a file belongs, or a file of
    /// another user. It was not opened, written or removed.
    #[error("refusing {path}: {reason}")]
    UnsafePath {
        /// The path.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The next step number after `step` does not exist (`step` is `u64::MAX`).
    #[error("checkpoint root {root} holds step {step}; there is no next step number")]
    StepOverflow {
        /// The latest step.
        step: u64,
        /// Checkpoint root.
        root: PathBuf,
    },
    /// The checkpoint root's path is longer than the arena descriptor can record.
    #[error(
        "checkpoint root {path} is {len} bytes long; the staging descriptor records at most {max}"
    )]
    RootTooLong {
        /// The root.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An invalid engine setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// `/dev/shm` cannot hold the staging arena.
    #[error(
        "shared memory {name} cannot hold {requested} bytes (free in {mount}: {available} bytes); \
         staging_capacity (the largest checkpoint file of a rank) must fit in /dev/shm: \
         enlarge /dev/shm (e.g. `docker run --shm-size`), or lower staging_capacity if it is \
         larger than the state"
    )]
    ShmTooSmall {
        /// Segment name.
        name: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes free on the shm mount when it failed (0 when unknown).
        available: u64,
        /// The mount that was asked.
        mount: String,
    },
    /// Creating, sizing or mapping the shared-memory arena failed.
    #[error("shared memory {name}: {op} failed: {source}")]
    Shm {
        /// Segment name.
        name: String,
        /// The call that failed.
        op: &'static str,
        /// The errno.
        source: io::Error,
    },
    /// An I/O call failed on a file. `offset` is set for reads and writes.
    #[error("{op} {path}{}: {source} (errno {})", fmt_offset(*.offset), .source.raw_os_error().unwrap_or(0))]
    Io {
        /// The call (`open`, `write`, `fdatasync`, `rename`, ...).
        op: &'static str,
        /// File or directory.
        path: PathBuf,
        /// Byte offset in the file, for reads and writes.
        offset: Option<u64>,
        /// The OS error.
        source: io::Error,
    },
    /// A file ended before the bytes the header or manifest promise.
    #[error("{path}: file is truncated: expected at least {expected} bytes, found {actual}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes expected.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// A checkpoint file or manifest is malformed.
    #[error("{path}: corrupt checkpoint{}: {reason}", .tensor.as_ref().map(|t| format!(" (tensor {t:?})")).unwrap_or_default())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The tensor concerned, when one is.
        tensor: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// A tensor's bytes do not match the checksum in the manifest.
    #[error(
        "{path}: tensor {tensor:?} fails its checksum: crc32c {actual:#010x}, manifest says {expected:#010x}"
    )]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// crc32c in the manifest.
        expected: u32,
        /// crc32c of the bytes read.
        actual: u32,
    },
    /// A destination buffer given to `load_into` does not fit the tensor.
    #[error("tensor {name:?}: {reason}")]
    Destination {
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The CUDA driver reported an error (`code` is its `CUresult`), is unavailable, or a
    /// CUDA request was invalid (`code` is `None`).
    #[error("CUDA: {call}{}: {detail}", .code.map(|c| format!(" (CUresult {c})")).unwrap_or_default())]
    Cuda {
        /// The driver call, or what was being done.
        call: String,
        /// The `CUresult` the driver returned, if a call failed.
        code: Option<i32>,
        /// The error's name and context.
        detail: String,
    },
    /// The engine was shut down (closed, or its writer threads are gone).
    #[error("engine is shut down: {0}")]
    Shutdown(String),
    /// A save failed; `source` is the first error it hit (shared, because the save's
    /// handle, `flush` and staging may all report it).
    #[error("save of step {step} failed: {source}")]
    SaveFailed {
        /// The step.
        step: u64,
        /// What went wrong first.
        source: Arc<Error>,
    },
    /// The caller refused to commit the step (a save started with
    /// `SaveOptions::confirm_commit`, e.g. because data-parallel replicas diverged):
    /// nothing of this rank's save is kept.
    #[error("commit of step {step} refused: {reason}")]
    CommitRefused {
        /// The step.
        step: u64,
        /// Why, as the caller gave it.
        reason: String,
    },
    /// Work was stopped because another part of the same save had already failed.
    #[error("stopped: {0}")]
    Cancelled(String),
    /// A broken internal invariant or a panicked thread (a bug in shmckpt: please report).
    #[error("internal error: {0}")]
    Internal(String),
    /// An object-store request failed (the remote tier, `s3://` roots): a missing bucket,
    /// refused credentials, an unreachable endpoint or a server error that outlasted the
    /// retries. `reason` is the server's answer with a hint.
    #[error("object store {url}: {op} failed: {reason}")]
    Remote {
        /// The bucket URL (`s3://bucket/prefix`).
        url: String,
        /// What was being done.
        op: &'static str,
        /// The error and its likely cause.
        reason: String,
    },
    /// A save's remote copy failed: nothing of this step is visible in the bucket (its
    /// multipart upload was aborted). The local checkpoint is unaffected.
    #[error("remote copy of step {step} failed: {source}")]
    RemoteFailed {
        /// The step.
        step: u64,
        /// What went wrong.
        source: Arc<Error>,
    },
    /// A save's remote copy was skipped because the uploader was behind (bounded queue:
    /// `remote_max_pending`); newer steps go to the bucket instead.
    #[error("remote copy of step {step} skipped: {reason}")]
    RemoteSkipped {
        /// The step.
        step: u64,
        /// Why.
        reason: String,
    },
    /// Another writer's upload of the same step to the same bucket prefix (a restarted
    /// job whose previous instance was still uploading) is the one committed there: the
    /// step's manifest in the bucket, or this rank's manifest part, names another object
    /// than this upload's. This upload's object is not part of the committed step (each
    /// upload names its object apart, so it never replaced the committed one).
    #[error("remote copy of step {step} to {url} lost to another writer: {reason}")]
    RemoteConflict {
        /// The step.
        step: u64,
        /// The bucket URL.
        url: String,
        /// What the bucket holds instead.
        reason: String,
    },
    /// A staging arena in `/dev/shm` cannot be recovered as a whole: it is not a shmckpt
    /// arena, its owner is still alive, it belongs to another user, or an engine holds its
    /// checkpoint root. Nothing was changed, and the arena was left in place.
    #[error("staging arena {arena}: {reason}")]
    Recovery {
        /// Segment name in `/dev/shm`.
        arena: String,
        /// Why it was refused.
        reason: String,
    },
}

fn fmt_offset(offset: Option<u64>) -> String {
    match offset {
        Some(o) => format!(" at offset {o}"),
        None => String::new(),
    }
}

impl Error {
    /// A CUDA error that is not a failed driver call.
    pub(crate) fn cuda(call: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::Cuda {
            call: call.into(),
            code: None,
            detail: detail.into(),
        }
    }

    /// Wrap an OS error from a call on `path`.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            offset: None,
            source,
        }
    }

    /// Wrap an OS error from a read or write at `offset` of `path`.
    pub(crate) fn io_at(
        op: &'static str,
        path: impl Into<PathBuf>,
        offset: u64,
        source: io::Error,
    ) -> Self {
        Error::Io {
            op,
            path: path.into(),
            offset: Some(offset),
            source,
        }
    }

    pub(crate) fn corrupt(
        path: impl Into<PathBuf>,
        tensor: Option<&str>,
        reason: impl Into<String>,
    ) -> Self {
        Error::Corrupt {
            path: path.into(),
            tensor: tensor.map(str::to_owned),
            reason: reason.into(),
        }
    }

    /// The file or directory this error is about, when it names one: the file of an I/O,
    /// corruption, truncation or checksum error, the refused path, the checkpoint root (a
    /// missing step, a root that cannot be used). A failed save's is its cause's.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Error::RootMissing { path }
            | Error::RootCreateFailed { path, .. }
            | Error::RootNotWritable { path, .. }
            | Error::RootLocked { path, .. }
            | Error::UnsafePath { path, .. }
            | Error::RootTooLong { path, .. }
            | Error::Io { path, .. }
            | Error::Truncated { path, .. }
            | Error::Corrupt { path, .. }
            | Error::Checksum { path, .. } => Some(path),
            Error::StepExists { root, .. }
            | Error::NotFound { root, .. }
            | Error::StepOverflow { root, .. } => Some(root),
            Error::SaveFailed { source, .. } | Error::RemoteFailed { source, .. } => source.path(),
            _ => None,
        }
    }

    /// The tensor this error is about, when it names one. A failed save's is its cause's.
    pub fn tensor(&self) -> Option<&str> {
        match self {
            Error::DuplicateName { name }
            | Error::InvalidName { name, .. }
            | Error::SizeMismatch { name, .. }
            | Error::ShapeOverflow { name, .. }
            | Error::Destination { name, .. }
            | Error::Checksum { tensor: name, .. } => Some(name),
            Error::Corrupt { tensor, .. } => tensor.as_deref(),
            Error::SaveFailed { source, .. } | Error::RemoteFailed { source, .. } => {
                source.tensor()
            }
            _ => None,
        }
    }

    /// The checkpoint step this error is about, when it names one (a step that exists
    /// already or is not committed, a failed or skipped save, the latest step of a root
    /// with no next step number).
    pub fn step(&self) -> Option<u64> {
        match self {
            Error::StepExists { step, .. }
            | Error::StepOverflow { step, .. }
            | Error::SaveFailed { step, .. }
            | Error::CommitRefused { step, .. }
            | Error::RemoteFailed { step, .. }
            | Error::RemoteSkipped { step, .. }
            | Error::RemoteConflict { step, .. } => Some(*step),
            Error::NotFound { step, .. } => *step,
            _ => None,
        }
    }

    /// The byte offset in [`Error::path`] of a failed read or write. A failed save's is
    /// its cause's.
    pub fn offset(&self) -> Option<u64> {
        match self {
            Error::Io { offset, .. } => *offset,
            Error::SaveFailed { source, .. } | Error::RemoteFailed { source, .. } => {
                source.offset()
            }
            _ => None,
        }
    }

    /// The errno behind this error, if it came from the OS.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. }
            | Error::Shm { source, .. }
            | Error::RootNotWritable { source, .. }
            | Error::RootCreateFailed { source, .. } => source.raw_os_error(),
            Error::SaveFailed { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accessors_give_the_fields_of_each_variant() {
        let io = Error::io_at("read", "/r/step-3/f", 4096, io::Error::from_raw_os_error(5));
        assert_eq!(io.path(), Some(Path::new("/r/step-3/f")));
        assert_eq!(
            (io.tensor(), io.step(), io.offset()),
            (None, None, Some(4096))
        );
        assert_eq!(io.raw_os_error(), Some(5));

        let sum = Error::Checksum {
            path: "/r/step-3/f".into(),
            tensor: "model.w".into(),
            expected: 1,
            actual: 2,
        };
        assert_eq!(sum.path(), Some(Path::new("/r/step-3/f")));
        assert_eq!(
            (sum.tensor(), sum.step(), sum.offset()),
            (Some("model.w"), None, None)
        );

        let nf = Error::NotFound {
            what: "step 7".into(),
            step: Some(7),
            root: "/r".into(),
        };
        assert_eq!(
            (nf.path(), nf.step(), nf.tensor()),
            (Some(Path::new("/r")), Some(7), None)
        );

        // A failed save: its own step, its cause's path, tensor and offset.
        let failed = Error::SaveFailed {
            step: 9,
            source: Arc::new(io),
        };
        assert_eq!(failed.path(), Some(Path::new("/r/step-3/f")));
        assert_eq!(
            (failed.step(), failed.offset(), failed.tensor()),
            (Some(9), Some(4096), None)
        );

        let cfg = Error::Config("x".into());
        assert_eq!(
            (cfg.path(), cfg.tensor(), cfg.step(), cfg.offset()),
            (None, None, None, None)
        );
    }
}
