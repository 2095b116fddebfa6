//! The raw references on a real directory (target/tmp: not tmpfs, which refuses O_DIRECT).

use std::time::Duration;

use shmckpt_bench::reference::{raw_direct_reads, raw_direct_writes};

/// Both references write (an unaligned size, rounded up) and read real files, and leave no
/// scratch file behind.
#[test]
fn references_measure_a_write_and_a_read() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let w = raw_direct_writes(dir.path(), (3 << 20) + 5).unwrap();
    assert!(w.single > Duration::ZERO && w.best() <= w.single);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    let f = dir.path().join("data");
    let bytes: Vec<u8> = (0..(9u32 << 20) + 3).map(|i| i as u8).collect();
    std::fs::write(&f, &bytes).unwrap();
    let r = raw_direct_reads(&f).unwrap();
    assert!(r.single > Duration::ZERO && r.best() <= r.single);
    // Where io_uring works, both io_uring passes ran (and did not just report `None`).
    let uring = io_uring::IoUring::new(2)
        .and_then(|r| r.submit().map(|_| ()))
        .is_ok();
    assert_eq!((w.uring.is_some(), r.uring.is_some()), (uring, uring));
    if !uring {
        eprintln!("SKIPPED (partly): io_uring is unavailable here, only the single stream ran");
    }
    // The file is only read.
    assert_eq!(std::fs::read(&f).unwrap(), bytes);
}
