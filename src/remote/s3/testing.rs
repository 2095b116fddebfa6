//! The remote tier over object_store's in-memory store (features `s3` and `testing`,
//! for tests: `shmckpt::remote::testing`).

use super::RemoteOptions;

/// `cfg` with a remote tier on a fresh in-memory bucket under `prefix` (parts of
/// `part_size` bytes, 4 in flight).
pub fn with_memory_bucket(
    cfg: crate::EngineConfig,
    prefix: &str,
    part_size: usize,
) -> crate::EngineConfig {
    cfg.with_remote_store(
        std::sync::Arc::new(object_store::memory::InMemory::new()),
        prefix,
    )
    .with_remote_options(RemoteOptions {
        part_size,
        concurrency: 4,
        ..RemoteOptions::default()
    })
}
