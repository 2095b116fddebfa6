//! `Buffer`: the bytes of one loaded tensor, owned by Rust and handed to numpy without a
//! copy.

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Bytes of one loaded tensor, owned by Rust, exposed without a copy through
/// `__array_interface__` (numpy keeps this object alive as the array's base).
#[pyclass(module = "shmckpt._shmckpt", name = "Buffer", frozen)]
pub(crate) struct PyBuffer {
    /// Owns the memory; never read or written by Rust after construction (only dropped).
    _data: shmckpt::AlignedBytes,
    /// Address of the first byte, taken from a mutable borrow at construction.
    ptr: usize,
    len: usize,
}

impl PyBuffer {
    pub(crate) fn new(mut data: shmckpt::AlignedBytes) -> Self {
        let bytes = data.as_bytes_mut();
        let (ptr, len) = (bytes.as_mut_ptr() as usize, bytes.len());
        PyBuffer {
            _data: data,
            ptr,
            len,
        }
    }
}

#[pymethods]
impl PyBuffer {
    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// Address of the first byte (8-byte aligned).
    #[getter]
    fn address(&self) -> usize {
        self.ptr
    }

    /// The numpy array interface: a writable 1-D uint8 view of the bytes.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        array_interface(py, self.ptr, self.len, false)
    }

    fn __len__(&self) -> usize {
        self.len
    }
}

/// numpy's array interface (version 3) of `len` bytes at `ptr`: a 1-D uint8 view, read-only
/// when `readonly`. The object whose getter returns it must keep the memory alive (numpy
/// holds that object as the array's base).
pub(crate) fn array_interface(
    py: Python<'_>,
    ptr: usize,
    len: usize,
    readonly: bool,
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", 3)?;
    d.set_item("shape", (len,))?;
    d.set_item("typestr", "|u1")?;
    d.set_item("data", (ptr, readonly))?;
    Ok(d)
}
