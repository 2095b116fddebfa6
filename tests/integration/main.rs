//! The library's integration tests, in one binary (one build, and one set of shared
//! helpers that all get used). They drive the library only; the tests that also run the
//! `shmckpt` binary (CLI, recovery through the CLI, the IPC baseline, ...) are the command
//! line's, in `cli/tests/integration/`, which shares `common.rs` with this binary. GPU
//! tests are the separate `gpu` and `gpu_ipc` binaries of `cli/tests/`.
//!
//! The tests inspect the library's internals: they need the `testing` and `s3` features
//! (`cargo test --all-features --test integration`, as scripts/test.sh runs them).

mod common;

mod cadence;
mod confirm;
mod fulldisk;
mod held;
mod no_gpu;
mod parts;
mod provisional;
mod remote_crash;
mod roundtrip;
mod small_shm;

#[cfg(feature = "fs-observer")]
mod crash;
#[cfg(feature = "fault-injection")]
mod faults;
#[cfg(feature = "fault-injection")]
mod kill;
#[cfg(feature = "fault-injection")]
mod prefault;
#[cfg(all(feature = "fault-injection", feature = "fs-observer"))]
mod soak;
#[cfg(feature = "fault-injection")]
mod stress;

/// Reported (as ignored) when the fault-injection tests are compiled out, so a run without
/// the feature says what it did not test.
#[cfg(not(feature = "fault-injection"))]
#[test]
#[ignore = "the faults, kill, prefault and stress tests need --features fault-injection"]
fn fault_injection_tests_need_the_feature() {}
