//! Benchmark support for the `shmckpt` command line's `demo` and `bench`, the crate's
//! benches and its tests (feature `bench`, hidden from the documentation): synthetic
//! workloads and the raw O_DIRECT reference a benchmark divides by. Not part of the stable
//! API. It exposes no internals: its functions take paths and sizes and return data and
//! timings.

pub mod reference;
pub mod synthetic;

pub use crate::util::gbps;

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
