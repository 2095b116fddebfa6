//! `replica_divergence`: which replicated tensors differ between data-parallel ranks
//! (`shmckpt::divergence::compare`), for `Checkpointer(check_replicas=...)`; `crc32c_at`,
//! the CRC-32C of host memory, for the DCP writer's copies of replicated items that
//! another rank writes.
#![allow(unsafe_code)]

use pyo3::exceptions::PyValueError;
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

/// CRC-32C (Castagnoli) of the `nbytes` bytes of host memory at `address`, continuing
/// from `crc` (0 for a new one). The caller keeps that memory alive and unchanged for the
/// call (a contiguous CPU tensor's `data_ptr()` and byte length); the GIL is released.
#[pyfunction]
#[pyo3(signature = (address, nbytes, crc=0))]
fn crc32c_at(py: Python<'_>, address: usize, nbytes: usize, crc: u32) -> PyResult<u32> {
    if nbytes == 0 {
        return Ok(crc);
    }
    if address == 0 || address.checked_add(nbytes).is_none() {
        return Err(PyValueError::new_err(format!(
            "crc32c_at: no memory at address {address:#x} for {nbytes} bytes"
        )));
    }
    Ok(py.detach(move || {
        // SAFETY: the caller passes the address and length of host memory it keeps alive
        // and unchanged during this call (the documented contract); it is only read, and
        // the range does not wrap (checked above).
        let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, nbytes) };
        crc32c::crc32c_append(crc, bytes)
    }))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(replica_divergence, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c_at, m)?)
}
