//! Benchmark support for the `shmckpt` command line's `demo` and `bench`, the criterion
//! benches (`benches/`: `staging`, `writer`) and the tests: synthetic workloads and the raw
//! O_DIRECT reference a benchmark divides by.
//!
//! A tool beside the library, not part of it: it uses only `shmckpt`'s public API
//! ([`shmckpt::Dtype`], its `Error`), and the reference drives the disk without the
//! library's I/O code ([`reference`](mod@reference)).
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[allow(unsafe_code)]
pub mod reference;
pub mod synthetic;

/// Decimal gigabytes per second for `bytes` moved in `d` (0 when `d` is zero).
pub fn gbps(bytes: u64, d: std::time::Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }
}

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

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
