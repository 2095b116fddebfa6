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
