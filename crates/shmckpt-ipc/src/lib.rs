//! The CUDA IPC baseline (`--mode ipc`): the design NVIDIA NVRx and Megatron use for
//! asynchronous checkpoints, implemented faithfully so its costs can be measured against
//! shmckpt's own path on the same GPU.
//!
//! The trainer ([`IpcWriterClient`]) spawns one persistent writer process
//! (`shmckpt ipc-writer`, hidden subcommand) and talks to it over a Unix socket. For each
//! save the trainer synchronizes its devices, exports a CUDA IPC handle for every device
//! allocation holding a tensor (`cuMemGetAddressRange` + `cuIpcGetMemHandle`) and sends the
//! handles with each tensor's offset inside its allocation. The writer maps the handles
//! (`cuIpcOpenMemHandle`, the "rebuild"), copies device to host into its own pinned staging
//! arena with its own [`Engine`](shmckpt::Engine), and writes and commits the checkpoint exactly like
//! shmckpt (same writer pool, file format and commit). The trainer's `save` returns when
//! the writer reports its device-to-host copies done; [`IpcSaveHandle::wait`] returns when
//! the writer reports the checkpoint committed.
//!
//! Like NVRx with a constant state structure, the writer keeps the mapped handles open
//! across saves while the trainer's allocations are unchanged ([`IpcConfig::with_cache`]).
//! That is what makes IPC saves cheap after the first, and it is also its main cost: an open
//! mapping keeps the trainer's allocation alive even after the trainer frees it, until the
//! writer closes it ([`IpcWriterClient::release`]).
//!
//! # Ordering
//! The writer copies on its own stream in its own context, which cannot wait on the
//! trainer's streams. The trainer therefore synchronizes every device it saves from
//! (`cuCtxSynchronize` of the primary context, as [`Engine::save`](shmckpt::Engine::save) does) before it exports
//! the handles: every write queued before `save` has completed when the writer's copies
//! start. The trainer must not write the tensors until `save` returns (the writer's copies
//! have completed by then). Work queued in a context other than the device's primary
//! context is not covered.
//!
//! # Process lifetime
//! The writer is spawned from a dedicated thread of the client that lives until the writer
//! has been reaped, and the writer sets `PR_SET_PDEATHSIG(SIGKILL)` first thing (then checks
//! that its parent is still the trainer), so a trainer that dies for any reason takes the
//! writer with it; the kernel then closes its IPC mappings. The writer also exits when the
//! socket closes. Dropping the client asks the writer to finish its saves and exit, waits
//! (see [`IpcConfig::with_shutdown_timeout`]), then kills it, and always reaps it.
//!
//! # Protocol
//! Each message is a little-endian `u32` length followed by that many bytes of JSON (an
//! object tagged by `"op"`). The writer speaks first (`ready`, or `failed` with id 0 when
//! it cannot start). Requests carry an `id`; the writer answers each in order, and sends
//! `durable` / `durable_failed` for a save's id later, when its commit finished.
//!
//! # Layout
//! This crate is a tool beside the library, not part of it: it uses only `shmckpt`'s
//! public API. Its errors are [`Error`] (the library's, or [`Error::Ipc`]); the few CUDA
//! IPC driver calls are in [`cuda`], the one module with `unsafe` code.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod client;
mod config;
mod conn;
pub mod cuda;
mod error;
mod handle;
mod spawn;
mod wire;
mod writer;

pub use client::IpcWriterClient;
pub use config::IpcConfig;
pub use error::{Error, Result};
pub use handle::{
    IpcAllocation, IpcPrepared, IpcReleased, IpcSaveHandle, IpcSaveReport, IpcStaged, IpcTensor,
};
pub use wire::{WriterStats, process_memory};
pub use writer::{WriterOptions, run_writer};

/// Version of the socket protocol; the writer refuses to talk to another version.
pub const PROTOCOL_VERSION: u32 = 1;
/// Name of the hidden subcommand that runs the writer.
pub const WRITER_SUBCOMMAND: &str = "ipc-writer";
/// Largest message accepted on the socket.
pub(crate) const MAX_FRAME: u32 = 256 << 20;
/// Environment variable naming the `shmckpt` executable to spawn as the writer.
pub const EXE_ENV: &str = "SHMCKPT_EXE";
