//! `shmckpt ipc-writer` (hidden): the writer process of the IPC baseline, spawned by
//! [`shmckpt_ipc::IpcWriterClient`]. Its arguments are exactly what
//! [`shmckpt_ipc::IpcConfig::writer_args`] produces.

use std::path::PathBuf;

use shmckpt::EngineConfig;
use shmckpt_ipc::{self as ipc, WriterOptions};

use super::{CliResult, parse_size};

/// Arguments of `ipc-writer`.
#[derive(Debug, clap::Args)]
pub struct IpcWriterArgs {
    /// The trainer's listening Unix socket.
    #[arg(long)]
    pub socket: PathBuf,
    /// Checkpoint root.
    #[arg(long)]
    pub dir: PathBuf,
    /// The trainer's pid (the writer dies with it).
    #[arg(long)]
    pub parent_pid: Option<u32>,
    /// Staging capacity.
    #[arg(long, value_parser = parse_size)]
    pub staging_capacity: Option<u64>,
    /// Engine tuning.
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
    /// Saves staged or draining at once.
    #[arg(long)]
    pub max_inflight_saves: Option<u32>,
    /// Keep only the newest N checkpoints.
    #[arg(long)]
    pub keep_last: Option<usize>,
    /// Rank.
    #[arg(long, default_value_t = 0)]
    pub rank: u32,
    /// World size.
    #[arg(long, default_value_t = 1)]
    pub world_size: u32,
    /// Buffered writes instead of O_DIRECT.
    #[arg(long)]
    pub no_direct_io: bool,
}

pub fn run(a: IpcWriterArgs) -> CliResult {
    let mut cfg = a
        .engine
        .apply(EngineConfig::new(&a.dir))
        .with_rank(a.rank, a.world_size)
        .with_keep_last(a.keep_last)
        .with_direct_io(!a.no_direct_io);
    if let Some(n) = a.staging_capacity {
        cfg = cfg.with_staging_capacity(n);
    }
    if let Some(n) = a.max_inflight_saves {
        cfg = cfg.with_max_inflight_saves(n);
    }
    ipc::run_writer(WriterOptions {
        socket: a.socket,
        parent_pid: a.parent_pid,
        engine: cfg,
    })?;
    Ok(())
}
