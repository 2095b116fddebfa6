//! The IPC baseline's error: one of the library's, or a failure of the writer process.

use std::io;
use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the IPC baseline.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of the library: the trainer's or the writer's engine, the CUDA driver, a
    /// file (a writer's error crosses the socket as the same variant where it is one of
    /// `Cuda`, `Config`, `StepExists` and `TooLarge`).
    #[error(transparent)]
    Shmckpt(#[from] shmckpt::Error),
    /// The IPC writer process could not be started, broke the protocol, exited, or
    /// reported an error (its message, with the writer's pid).
    #[error("IPC writer: {0}")]
    Ipc(String),
}

impl Error {
    /// A CUDA error that is not a failed driver call.
    pub(crate) fn cuda(call: impl Into<String>, detail: impl Into<String>) -> Self {
        shmckpt::Error::Cuda {
            call: call.into(),
            code: None,
            detail: detail.into(),
        }
        .into()
    }

    /// An invalid request.
    pub(crate) fn config(message: String) -> Self {
        shmckpt::Error::Config(message).into()
    }

    /// An OS error from a call on `path`.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        shmckpt::Error::Io {
            op,
            path: path.into(),
            offset: None,
            source,
        }
        .into()
    }

    /// Add context to a CUDA error's detail (other errors are returned unchanged).
    pub(crate) fn with_cuda_context(self, context: &str) -> Self {
        match self {
            Error::Shmckpt(shmckpt::Error::Cuda { call, code, detail }) => shmckpt::Error::Cuda {
                call,
                code,
                detail: format!("{detail} ({context})"),
            }
            .into(),
            e => e,
        }
    }

    /// The library's error, if this is one.
    pub fn as_shmckpt(&self) -> Option<&shmckpt::Error> {
        match self {
            Error::Shmckpt(e) => Some(e),
            Error::Ipc(_) => None,
        }
    }
}
