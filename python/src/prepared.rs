//! `Engine.prepare`: a save's tensors checked and taken from their DLPack capsules ahead of
//! the save, so that the save's call only starts it (`Engine.save(step, prepared, ...)`).

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::core::RawTensor;
use crate::util::lock;

/// A save's tensors, checked as `Engine.save` checks them and their memory taken from their
/// capsules (`Engine.prepare`), for one later `Engine.save`, which takes them whether it
/// starts or fails. Until then (or `release()`, or the object's end) their memory stays
/// referenced: the tensors' storages stay allocated.
#[pyclass(name = "PreparedTensors", module = "shmckpt._shmckpt", frozen)]
pub(crate) struct PyPrepared {
    raw: Mutex<Option<Vec<RawTensor>>>,
    len: usize,
}

impl PyPrepared {
    pub(crate) fn new(raw: Vec<RawTensor>) -> PyPrepared {
        PyPrepared {
            len: raw.len(),
            raw: Mutex::new(Some(raw)),
        }
    }

    /// The tensors, for the save that takes them; `ValueError` once taken or released.
    pub(crate) fn take(&self) -> PyResult<Vec<RawTensor>> {
        lock(&self.raw).take().ok_or_else(|| {
            PyValueError::new_err("these prepared tensors were taken by a save or released")
        })
    }
}

#[pymethods]
impl PyPrepared {
    /// How many tensors.
    fn __len__(&self) -> usize {
        self.len
    }

    /// Whether a save took them or they were released.
    #[getter]
    fn taken(&self) -> bool {
        lock(&self.raw).is_none()
    }

    /// Give their memory back now (the capsules' tensors), not at the object's end; a save
    /// given them afterwards raises `ValueError`.
    fn release(&self) {
        let raw = lock(&self.raw).take();
        drop(raw);
    }
}
