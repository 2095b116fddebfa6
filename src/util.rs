//! Small helpers shared by the library and the CLI.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Lock `m`, ignoring poisoning: every critical section in the crate leaves its data
/// consistent before anything that can panic, so a panicked holder is no reason to fail.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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

#[cfg(feature = "testing")]
/// Median of a non-empty slice (mean of the middle two for even lengths).
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use super::*;

    #[test]
    fn median_and_rate() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        assert_eq!(gbps(2_000_000_000, Duration::from_secs(2)), 1.0);
        assert_eq!(gbps(5, Duration::ZERO), 0.0);
    }
}
