//! Load destinations taken from DLPack capsules, never from integers (`dlpack.rs`).
//!
//! Host destinations are capsules of CPU memory (`torch.utils.dlpack.to_dlpack` of a CPU
//! tensor, a numpy array's `__dlpack__()`), device destinations capsules of CUDA memory of
//! the device named with them. Each is checked (`Memory::take`: C-contiguous, a known
//! size, a non-null address; here: the right place, not marked read-only, none overlapping
//! another) before any byte is written; a bad one is a `ValueError`, anything but a
//! capsule a `TypeError`. The [`Memory`] values own the capsules' tensors: their memory
//! stays allocated until they are dropped, after the load.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::dlpack::{Memory, writable_device, writable_host};

/// Host destinations `(name, capsule)`: each one's memory, checked host, writable,
/// C-contiguous, not null, and not overlapping another.
pub(crate) fn host_dest(dest: &[(String, Bound<'_, PyAny>)]) -> PyResult<Vec<(String, Memory)>> {
    let out = dest
        .iter()
        .map(|(n, obj)| {
            let m = Memory::take(obj, || format!("destination {n:?}"))?;
            writable_host(n, &m)?;
            Ok((n.clone(), m))
        })
        .collect::<PyResult<Vec<_>>>()?;
    crate::convert::check_disjoint(out.iter().map(|(n, m)| (n.as_str(), m)))?;
    Ok(out)
}

/// Device destinations `(name, capsule, device ordinal)`: each one's memory, checked memory
/// of that CUDA device and otherwise as [`host_dest`] checks host memory.
pub(crate) fn device_dest(
    dest: &[(String, Bound<'_, PyAny>, i32)],
) -> PyResult<Vec<(String, Memory)>> {
    let out = dest
        .iter()
        .map(|(n, obj, d)| {
            if *d < 0 {
                return Err(PyValueError::new_err(format!(
                    "destination {n:?}: device ordinal {d} is not a CUDA device"
                )));
            }
            let m = Memory::take(obj, || format!("destination {n:?}"))?;
            writable_device(n, &m, *d)?;
            Ok((n.clone(), m))
        })
        .collect::<PyResult<Vec<_>>>()?;
    crate::convert::check_disjoint(out.iter().map(|(n, m)| (n.as_str(), m)))?;
    Ok(out)
}
