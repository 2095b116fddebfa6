//! The engine tuning flags shared by `bench` and `ipc-writer` (flattened into both).

use shmckpt::{BackendKind, EngineConfig};

use super::parse_size;

/// Engine tuning flags; each left out keeps the engine's default.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Write backend: auto, io_uring, pwrite.
    #[arg(long, default_value = "auto")]
    pub backend: BackendKind,
    /// Chunk size (default 8MiB).
    #[arg(long, value_parser = parse_size)]
    pub chunk_size: Option<u64>,
    /// Writer threads (default 2).
    #[arg(long)]
    pub writer_threads: Option<usize>,
    /// Queue depth per writer (default 8).
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// Host staging copy threads (default: CPUs).
    #[arg(long)]
    pub copy_threads: Option<usize>,
    /// Size of each O_DIRECT read of a device load from disk (default 32MiB).
    #[arg(long, value_parser = parse_size)]
    pub device_read: Option<u64>,
    /// Reads in flight of a device load from disk (default 8).
    #[arg(long)]
    pub device_read_depth: Option<u32>,
}

impl EngineArgs {
    /// The chunk size the engine will use.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size.unwrap_or(shmckpt::DEFAULT_CHUNK_SIZE)
    }

    /// The device-load read size and depth the engine will use.
    pub fn device_read(&self) -> (u64, u32) {
        (
            self.device_read.unwrap_or(shmckpt::DEFAULT_DEVICE_READ),
            self.device_read_depth
                .unwrap_or(shmckpt::DEFAULT_DEVICE_READ_DEPTH),
        )
    }

    /// `cfg` with these flags applied.
    pub fn apply(&self, cfg: EngineConfig) -> EngineConfig {
        let mut cfg = cfg
            .with_backend(self.backend)
            .with_chunk_size(self.chunk_size());
        if let Some(n) = self.writer_threads {
            cfg = cfg.with_writer_threads(n);
        }
        if let Some(n) = self.queue_depth {
            cfg = cfg.with_queue_depth(n);
        }
        if let Some(n) = self.copy_threads {
            cfg = cfg.with_copy_threads(n);
        }
        if self.device_read.is_some() || self.device_read_depth.is_some() {
            let (bytes, depth) = self.device_read();
            cfg = cfg.with_device_read(bytes, depth);
        }
        cfg
    }
}
