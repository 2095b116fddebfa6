//! Load destinations taken from Python objects, never from integers.
//!
//! Host memory comes as objects exposing numpy's `__array_interface__` (a numpy array, or
//! a CPU tensor's `.numpy()` view), device memory as objects exposing
//! `__cuda_array_interface__` (a CUDA tensor, a CuPy array). The buffer protocol
//! (`PyBuffer`) is not available: the extension builds against the stable ABI of Python
//! 3.9 (`abi3-py39`), which gained the buffer protocol only in 3.11. Either interface is
//! read from the object itself and checked here: a writable address, a known
//! item size, a C-contiguous layout (`strides` absent or exactly the packed ones), no mask,
//! the byte length computed with checked arithmetic. A bad destination is a `ValueError`,
//! before any byte is written. The caller keeps the objects (and so their memory) alive for
//! the whole load: they are borrowed from the argument list.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// One destination's memory as its interface describes it: `(address, byte length)`.
type Range = (u64, usize);

/// The memory of a writable, C-contiguous array exposing `attr` (`__array_interface__` or
/// `__cuda_array_interface__`).
fn range_of(name: &str, obj: &Bound<'_, PyAny>, attr: &str) -> PyResult<Range> {
    let bad = |why: String| PyValueError::new_err(format!("destination {name:?}: {why}"));
    let iface = obj
        .getattr(attr)
        .map_err(|_| bad(format!("the object does not expose {attr}")))?;
    let iface = iface
        .cast::<PyDict>()
        .map_err(|_| bad(format!("{attr} is not a dict")))?;
    let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        iface
            .get_item(key)?
            .ok_or_else(|| bad(format!("{attr} has no {key:?}")))
    };
    let data = get("data")?;
    let data = data
        .cast::<PyTuple>()
        .map_err(|_| bad(format!("{attr}[\"data\"] is not a tuple")))?;
    if data.len() != 2 {
        return Err(bad(format!("{attr}[\"data\"] is not (address, read-only)")));
    }
    let ptr: u64 = data
        .get_item(0)?
        .extract()
        .map_err(|_| bad("bad address".into()))?;
    let readonly: bool = data.get_item(1)?.extract()?;
    if readonly {
        return Err(bad("the memory is read-only".into()));
    }
    let typestr: String = get("typestr")?.extract()?;
    let item: usize = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .filter(|&n: &usize| n > 0)
        .ok_or_else(|| bad(format!("unknown typestr {typestr:?}")))?;
    let shape: Vec<usize> = get("shape")?
        .extract()
        .map_err(|_| bad("the shape is not a tuple of sizes".into()))?;
    let len = shape
        .iter()
        .try_fold(item, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("the size of shape {shape:?} overflows")))?;
    if let Some(m) = iface.get_item("mask")?
        && !m.is_none()
    {
        return Err(bad("a masked array".into()));
    }
    if let Some(st) = iface.get_item("strides")?
        && !st.is_none()
        && len > 0
    {
        let strides: Vec<isize> = st
            .extract()
            .map_err(|_| bad("the strides are not a tuple of integers".into()))?;
        if strides.len() != shape.len() || !packed(&shape, &strides, item) {
            return Err(bad(format!(
                "not C-contiguous (shape {shape:?}, strides {strides:?}): pass a contiguous array"
            )));
        }
    }
    if ptr == 0 && len > 0 {
        return Err(bad("a null address".into()));
    }
    Ok((ptr, len))
}

/// Whether `strides` are the packed row-major strides of `shape` (dimensions of size 1
/// may have any stride).
fn packed(shape: &[usize], strides: &[isize], item: usize) -> bool {
    let mut want = item;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && usize::try_from(s).ok() != Some(want) {
            return false;
        }
        want = want.saturating_mul(d);
    }
    true
}

/// Host destinations `(name, array)`: `(name, address, nbytes)` of each array's memory,
/// checked writable, C-contiguous, not null, and not overlapping another.
pub(crate) fn host_ranges(
    dest: &[(String, Bound<'_, PyAny>)],
) -> PyResult<Vec<(String, u64, usize)>> {
    let out = dest
        .iter()
        .map(|(n, obj)| {
            let (p, l) = range_of(n, obj, "__array_interface__")?;
            Ok((n.clone(), p, l))
        })
        .collect::<PyResult<Vec<_>>>()?;
    crate::convert::check_host_ranges(&out)?;
    Ok(out)
}

/// Device destinations `(name, array, device ordinal)`: `(name, device pointer, nbytes,
/// device)` of each array's memory, checked as [`host_ranges`] checks host arrays.
pub(crate) fn device_ranges(
    dest: &[(String, Bound<'_, PyAny>, i32)],
) -> PyResult<Vec<(String, u64, usize, i32)>> {
    let out = dest
        .iter()
        .map(|(n, obj, d)| {
            if *d < 0 {
                return Err(PyValueError::new_err(format!(
                    "destination {n:?}: device ordinal {d} is not a CUDA device"
                )));
            }
            let (p, l) = range_of(n, obj, "__cuda_array_interface__")?;
            Ok((n.clone(), p, l, *d))
        })
        .collect::<PyResult<Vec<_>>>()?;
    crate::convert::check_disjoint(out.iter().map(|(n, p, l, _)| (n.as_str(), *p, *l)))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::packed;

    #[test]
    fn packed_strides_are_row_major() {
        assert!(packed(&[2, 3], &[12, 4], 4));
        assert!(!packed(&[2, 3], &[4, 8], 4)); // column-major
        assert!(!packed(&[2, 3], &[24, 8], 4)); // every other element
        assert!(packed(&[1, 3], &[999, 4], 4)); // size-1 dimension: any stride
        assert!(!packed(&[3], &[-4], 4)); // reversed
    }
}
