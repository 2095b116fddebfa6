//! `Bucket`: one bucket prefix of the object-storage tier on its own
//! (`shmckpt::remote::Remote`), for `shmckpt.dcp`'s `s3://` checkpoints: listing,
//! manifests, checked loads of a rank's object, and extra objects beside a committed step
//! (DCP's `.metadata`). Every call releases the GIL.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use shmckpt::remote::{Remote, RemoteOptions};

use crate::convert::{Loaded, loaded};
use crate::to_py;

/// A bucket prefix (`s3://bucket/prefix`), credentials and endpoint from the AWS
/// environment variables. Opening it lists the bucket once (a missing bucket or refused
/// credentials raise `RemoteError` here).
#[pyclass(name = "Bucket", module = "shmckpt._shmckpt", frozen)]
pub struct PyBucket {
    remote: Remote,
}

#[pymethods]
impl PyBucket {
    #[new]
    #[pyo3(signature = (url, part_size=None, concurrency=None))]
    fn new(
        py: Python<'_>,
        url: String,
        part_size: Option<usize>,
        concurrency: Option<usize>,
    ) -> PyResult<Self> {
        let mut opts = RemoteOptions::default();
        if let Some(p) = part_size {
            opts.part_size = p;
        }
        if let Some(c) = concurrency {
            opts.concurrency = c;
        }
        let remote = py
            .detach(|| Remote::open(&url, opts))
            .map_err(|e| to_py(py, e))?;
        Ok(PyBucket { remote })
    }

    /// The URL.
    #[getter]
    fn url(&self) -> String {
        self.remote.url().to_owned()
    }

    /// Steps committed in the bucket, oldest first.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| self.remote.list()).map_err(|e| to_py(py, e))
    }

    /// The manifest of committed step `step`, as JSON (parsed and checked by Rust).
    fn manifest(&self, py: Python<'_>, step: u64) -> PyResult<String> {
        let m = py
            .detach(|| self.remote.manifest(step))
            .map_err(|e| to_py(py, e))?;
        Ok(serde_json::to_string(&m).expect("a manifest serializes"))
    }

    /// `rank`'s tensors of committed step `step` (ranged GETs in parallel), object size
    /// and header checked against the manifest and every CRC-32C verified:
    /// `(step, url, metadata, [(name, dtype, shape, Buffer)])`.
    fn load(&self, py: Python<'_>, step: u64, rank: u32) -> PyResult<Loaded> {
        let (ck, _) = py
            .detach(|| self.remote.load(step, rank))
            .map_err(|e| to_py(py, e))?;
        Ok(loaded(ck))
    }

    /// Create `step-N/<name>` (conditional create) beside committed step `step`; `False`
    /// when it already existed.
    fn put_extra(&self, py: Python<'_>, step: u64, name: &str, data: &[u8]) -> PyResult<bool> {
        let data = data.to_vec();
        py.detach(|| self.remote.put_step_extra(step, name, data))
            .map_err(|e| to_py(py, e))
    }

    /// The bytes of `step-N/<name>` (`None` when absent); larger than `cap`: an error.
    fn get_extra(
        &self,
        py: Python<'_>,
        step: u64,
        name: &str,
        cap: u64,
    ) -> PyResult<Option<Py<PyBytes>>> {
        let got = py
            .detach(|| self.remote.get_step_extra(step, name, cap))
            .map_err(|e| to_py(py, e))?;
        Ok(got.map(|v| PyBytes::new(py, &v).unbind()))
    }
}
