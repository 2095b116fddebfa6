//! The integration tests, in one binary (one build, and one set of shared helpers that
//! all get used). GPU tests are the separate `gpu` and `gpu_ipc` binaries.

mod common;

mod cadence;
mod cli;
mod confirm;
mod corruption;
mod flash;
mod flash_disk;
mod fulldisk;
mod held;
mod hostile;
mod ipc;
mod live_arena;
mod no_gpu;
mod odd_names;
mod parts;
mod recovery;
mod recovery_arenas;
mod remote;
mod remote_crash;
mod roundtrip;
mod small_shm;

#[cfg(feature = "crash-record")]
mod crash;
#[cfg(feature = "fault-injection")]
mod faults;
#[cfg(feature = "fault-injection")]
mod kill;
#[cfg(feature = "fault-injection")]
mod prefault;
#[cfg(all(feature = "fault-injection", feature = "crash-record"))]
mod soak;
#[cfg(feature = "fault-injection")]
mod stress;

/// Reported (as ignored) when the fault-injection tests are compiled out, so a run without
/// the feature says what it did not test.
#[cfg(not(feature = "fault-injection"))]
#[test]
#[ignore = "the faults, kill, prefault and stress tests need --features fault-injection"]
fn fault_injection_tests_need_the_feature() {}
