//! `replica_divergence`: which replicated tensors differ between data-parallel ranks
//! (`shmckpt::divergence::compare`), for `Checkpointer(check_replicas=...)`; `crc32c_of`,
//! the CRC-32C of host memory (a DLPack capsule), for the DCP writer's copies of replicated
//! items that another rank writes.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use shmckpt::divergence::{TensorDigest, compare};

use crate::dlpack::{Memory, Place};

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

/// CRC-32C (Castagnoli) of the bytes of host memory given as a DLPack capsule (a
/// contiguous CPU tensor's `torch.utils.dlpack.to_dlpack`, a numpy array's `__dlpack__()`;
/// `None`: no bytes), continuing from `crc` (0 for a new one). The GIL is released; the
/// caller does not change the memory during the call.
#[pyfunction]
#[pyo3(signature = (data, crc=0))]
fn crc32c_of(py: Python<'_>, data: Bound<'_, PyAny>, crc: u32) -> PyResult<u32> {
    if data.is_none() {
        return Ok(crc);
    }
    let m = Memory::take(&data, || "crc32c_of".to_owned())?;
    if m.place() != Place::Host {
        return Err(PyValueError::new_err(format!(
            "crc32c_of: not host memory ({:?}); pass a CPU tensor or array",
            m.place()
        )));
    }
    let crc = py.detach(|| {
        // SAFETY: host memory kept allocated by `m` for the call; no writer meanwhile is
        // the caller's contract (documented above). It is only read.
        let bytes = unsafe { m.host_bytes() };
        crc32c::crc32c_append(crc, bytes)
    });
    drop(m); // (GIL held: a producer's deleter may take it)
    Ok(crc)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(replica_divergence, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c_of, m)?)
}
