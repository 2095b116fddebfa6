//! The remote tier's side of the extension: the bodies of `Engine.list_remote`,
//! `Engine.load_remote`, `Engine.remote_manifest` and `SaveHandle.wait_remote`.

use std::collections::BTreeMap;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::{PyBuffer, PyEngine, PySaveHandle, SLICE, core, lock, secs, to_py};

/// A loaded checkpoint as `Engine.load` returns it.
pub(crate) type Loaded = (
    u64,
    String,
    BTreeMap<String, String>,
    Vec<(String, String, Vec<usize>, PyBuffer)>,
);

fn report_dict<'py>(
    py: Python<'py>,
    r: &shmckpt::remote::RemoteReport,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("upload", secs(r.upload))?;
    d.set_item("remote_durable", secs(r.remote_durable))?;
    d.set_item("committed_here", r.committed_here)?;
    d.set_item("retired", PyList::new(py, &r.retired)?)?;
    Ok(d)
}

pub(crate) fn list_remote(e: &PyEngine, py: Python<'_>) -> PyResult<Vec<u64>> {
    let engine = e.get()?;
    py.detach(|| core::list_remote(&engine))
        .map_err(|err| to_py(py, err))
}

pub(crate) fn load_remote(e: &PyEngine, py: Python<'_>, step: Option<u64>) -> PyResult<Loaded> {
    let engine = e.get()?;
    let ck = py
        .detach(|| core::load_remote(&engine, step))
        .map_err(|err| to_py(py, err))?;
    *lock(&e.last_load) = Some(("remote", None));
    Ok(crate::loaded(ck))
}

pub(crate) fn remote_manifest(e: &PyEngine, py: Python<'_>, step: u64) -> PyResult<String> {
    let engine = e.get()?;
    py.detach(|| core::remote_manifest_json(&engine, step))
        .map_err(|err| to_py(py, err))
}

pub(crate) fn wait_remote(h: &PySaveHandle, py: Python<'_>) -> PyResult<Py<PyDict>> {
    let Some(p) = &h.remote else {
        return Err(to_py(
            py,
            shmckpt::Error::Config("this checkpointer has no remote tier (remote=...)".into()),
        ));
    };
    loop {
        if let Some(r) = &*lock(&h.remote_result) {
            return match r {
                Ok(d) => Ok(d.clone_ref(py)),
                Err(e) => Err(e.clone_ref(py)),
            };
        }
        match py.detach(|| core::wait_remote(p, SLICE)) {
            Some(res) => {
                let stored = match res {
                    Ok(rep) => Ok(report_dict(py, &rep)?.unbind()),
                    Err(e) => Err(to_py(py, e)),
                };
                *lock(&h.remote_result) = Some(stored);
            }
            None => py.check_signals()?,
        }
    }
}

pub(crate) fn is_remote_done(h: &PySaveHandle) -> bool {
    h.remote.as_ref().is_none_or(|p| p.is_done())
}
