//! The command line's integration tests, in one binary: the tests that run the `shmckpt`
//! binary (`CARGO_BIN_EXE_shmckpt`: the CLI's commands, recovery through the CLI, hostile
//! and odd names, the IPC baseline's writer process) and the modules whose helpers they
//! share. The library's own integration tests are the root package's
//! (`tests/integration/`); `cargo test --all-features --test integration FILTER` at the
//! repository root runs both binaries. GPU tests are the separate `gpu` and `gpu_ipc`
//! binaries.

/// The library's test helpers (`tests/integration/common.rs`), shared with its binary:
/// this one uses part of them (the library's binary checks that each gets used).
#[allow(dead_code)]
#[path = "../../../tests/integration/common.rs"]
mod common;

mod cli;
mod corruption;
mod flash;
mod flash_disk;
mod hostile;
mod ipc;
mod live_arena;
mod odd_names;
mod recovery;
mod recovery_arenas;
mod remote;
