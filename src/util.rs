//! Small helpers shared by the library and the CLI.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Lock `m`, ignoring poisoning: every critical section in the crate leaves its data
/// consistent before anything that can panic, so a panicked holder is no reason to fail.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Threads for `jobs` independent jobs of copying or checksumming memory: the machine's
/// cores, at most 8, at most one per job, at least one.
pub(crate) fn threads_for(jobs: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(jobs.max(1))
}

/// `sync_file_range(file, begin, len, flags)`: start (`SYNC_FILE_RANGE_WRITE`) or wait for
/// (`SYNC_FILE_RANGE_WAIT_*`) the write-back of those bytes of `file`'s page cache. With
/// `WAIT_BEFORE | WRITE | WAIT_AFTER` the range's pages are on the device when it returns
/// `Ok` (not flushed from its cache: no `fdatasync`), and a write-back error is returned.
#[allow(unsafe_code)]
pub(crate) fn sync_file_range(
    file: &std::fs::File,
    begin: u64,
    len: u64,
    flags: libc::c_uint,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(len)) = (libc::off64_t::try_from(begin), libc::off64_t::try_from(len)) else {
        return Err(std::io::ErrorKind::InvalidInput.into());
    };
    // SAFETY: a system call on a file this function borrows (open for its whole duration);
    // it takes no pointer, and its only effect is on the file's page-cache write-back.
    match unsafe { libc::sync_file_range(file.as_raw_fd(), off, len, flags) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Decimal gigabytes per second for `bytes` moved in `d` (0 when `d` is zero).
pub fn gbps(bytes: u64, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate() {
        assert_eq!(gbps(2_000_000_000, Duration::from_secs(2)), 1.0);
        assert_eq!(gbps(5, Duration::ZERO), 0.0);
    }
}
