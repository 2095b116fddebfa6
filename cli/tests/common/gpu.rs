//! Helpers of the GPU test binaries (`gpu`, `gpu_ipc`), kept apart from the integration
//! tests' helpers so that each binary uses all of what it includes.

use std::path::PathBuf;

/// CUDA device 0 for GPU tests; `None` (after printing `SKIPPED`) when there is no driver
/// or GPU, unless `SHMCKPT_REQUIRE_GPU=1`, which makes that a failure.
pub fn gpu() -> Option<std::sync::Arc<shmckpt::cuda::Context>> {
    use shmckpt::cuda;
    let require = std::env::var("SHMCKPT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let found = cuda::driver_present() && cuda::device_count().map(|n| n > 0).unwrap_or(false);
    if !found {
        assert!(
            !require,
            "SHMCKPT_REQUIRE_GPU=1 but no CUDA driver/GPU was found"
        );
        eprintln!("SKIPPED: no CUDA driver or GPU");
        return None;
    }
    Some(cuda::Context::new(0).expect("device 0"))
}

/// Checkpoint directory of GPU tests: under `$SHMCKPT_TEST_DIR` when set (the GPU machine
/// runs prebuilt test binaries away from this checkout), else a directory under
/// `CARGO_TARGET_TMPDIR`.
pub fn gpu_test_dir(tag: &str) -> tempfile::TempDir {
    match std::env::var_os("SHMCKPT_TEST_DIR") {
        Some(d) => {
            let base = PathBuf::from(d);
            std::fs::create_dir_all(&base).unwrap();
            tempfile::Builder::new()
                .prefix(tag)
                .tempdir_in(base)
                .unwrap()
        }
        None => {
            let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
            std::fs::create_dir_all(base).unwrap();
            tempfile::Builder::new()
                .prefix(tag)
                .tempdir_in(base)
                .unwrap()
        }
    }
}
