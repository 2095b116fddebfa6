//! `HeldImage` / `HeldPiece`: a committed save's image held in its staging chunks for the
//! replication of its step (`shmckpt::replica::HeldImage`, `docs/replicas.md`), taken by
//! the replica sender piece by piece.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use shmckpt::replica::{HeldImage, HeldPiece, HeldView};

use crate::buffer::array_interface;
use crate::{PyBuffer, lock, to_py};

/// A committed image held in the staging arena (`SaveHandle.take_held_image()`): its
/// chunks stay out of the arena's free pool until taken (`piece`), given back under
/// staging pressure, or `close()`d.
#[pyclass(module = "shmckpt._shmckpt", name = "HeldImage", frozen)]
pub(crate) struct PyHeldImage {
    inner: Mutex<Option<HeldImage>>,
    len: u64,
    chunk_size: u64,
}

impl PyHeldImage {
    pub(crate) fn new(image: HeldImage) -> Self {
        PyHeldImage {
            len: image.len(),
            chunk_size: image.chunk_size(),
            inner: Mutex::new(Some(image)),
        }
    }
}

/// Consecutive staging chunks of a held image, read-only, without a copy: numpy views them
/// through `__array_interface__` (keeping this object alive as the array's base); the
/// chunks return to the arena only when this object is dropped.
#[pyclass(module = "shmckpt._shmckpt", name = "HeldPiece", frozen)]
pub(crate) struct PyHeldPiece {
    /// Owns the chunks' leases; never read by Rust after construction (only dropped).
    _view: Mutex<HeldView>,
    ptr: usize,
    len: usize,
}

#[pymethods]
impl PyHeldPiece {
    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// The numpy array interface: a read-only 1-D uint8 view of the chunks' bytes.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        array_interface(py, self.ptr, self.len, true)
    }

    fn __len__(&self) -> usize {
        self.len
    }
}

#[pymethods]
impl PyHeldImage {
    /// The image's length in bytes (the committed file's).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.len
    }

    /// Bytes per staging chunk: a piece starts at a multiple of it.
    #[getter]
    fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Chunks still held (not taken, not given back; 0 once closed).
    #[getter]
    fn held_chunks(&self) -> usize {
        lock(&self.inner).as_ref().map_or(0, HeldImage::held_chunks)
    }

    /// Chunks given back under staging pressure (their pieces are read from the file).
    #[getter]
    fn spilled_chunks(&self) -> u64 {
        lock(&self.inner)
            .as_ref()
            .map_or(0, HeldImage::spilled_chunks)
    }

    /// Take the piece `[start, end)` (`start` a multiple of `chunk_size`, `end` one too or
    /// the image's length; each piece once): `("staging", HeldPiece)` (zero-copy: its
    /// chunks are consecutive in the arena), `("copied", Buffer)` (its chunks were held but
    /// not consecutive: copied out with the GIL released, the chunks given back at once), or
    /// `("file", None)` (given back under pressure, or closed: read it from the file).
    fn piece(&self, py: Python<'_>, start: u64, end: u64) -> PyResult<(String, Option<Py<PyAny>>)> {
        let taken = py.detach(|| match &*lock(&self.inner) {
            Some(image) => image.take(start, end),
            None => Ok(HeldPiece::File),
        });
        match taken.map_err(|e| to_py(py, e))? {
            HeldPiece::Staged(view) => {
                let (ptr, len) = (view.as_ptr() as usize, view.len());
                let p = PyHeldPiece {
                    _view: Mutex::new(view),
                    ptr,
                    len,
                };
                Ok(("staging".into(), Some(Py::new(py, p)?.into_any())))
            }
            HeldPiece::Copied(bytes) => Ok((
                "copied".into(),
                Some(Py::new(py, PyBuffer::new(bytes))?.into_any()),
            )),
            HeldPiece::File => Ok(("file".into(), None)),
        }
    }

    /// Give back every chunk not taken (pieces taken keep theirs until dropped).
    fn close(&self, py: Python<'_>) {
        let image = lock(&self.inner).take();
        py.detach(|| drop(image));
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyHeldImage>()?;
    m.add_class::<PyHeldPiece>()
}
