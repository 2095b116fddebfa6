//! `replica_divergence`: which replicated tensors differ between data-parallel ranks
//! (`shmckpt::divergence::compare`), for `Checkpointer(check_replicas=...)`.

use pyo3::prelude::*;
use shmckpt::divergence::{TensorDigest, compare};

/// One rank's digests: `(name, dtype, shape, crc32c)` per tensor.
type Digests = Vec<(String, String, Vec<u64>, u32)>;

/// The replicated tensors whose copies differ among `ranks` (each rank's digests of one
/// save, in group order): `(tensor, odd ranks, each rank's crc32c, majority crc32c or
/// None)`, sorted by name; see `shmckpt::divergence::compare`.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn replica_divergence(ranks: Vec<Digests>) -> Vec<(String, Vec<usize>, Vec<u32>, Option<u32>)> {
    let ranks: Vec<Vec<TensorDigest>> = ranks
        .into_iter()
        .map(|r| {
            r.into_iter()
                .map(|(name, dtype, shape, crc32c)| TensorDigest {
                    name,
                    dtype,
                    shape,
                    crc32c,
                })
                .collect()
        })
        .collect();
    compare(&ranks)
        .into_iter()
        .map(|d| (d.tensor, d.odd, d.crcs, d.majority))
        .collect()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(replica_divergence, m)?)
}
