//! The Hugging Face export (`shmckpt::export`): what it selects, and the export itself.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use shmckpt::export::{self, ExportOptions};

use crate::{core, to_py};

/// The tensors `export` takes from `src` by default: `[(name, dtype, shape)]`, named after
/// the default selection (the `model.` prefix stripped when there is a `model` part),
/// before renaming.
#[pyfunction]
fn export_names(
    py: Python<'_>,
    src: PathBuf,
    include_optimizer: bool,
) -> PyResult<Vec<(String, String, Vec<u64>)>> {
    let v = py
        .detach(|| export::default_names(&src, include_optimizer))
        .map_err(|e| to_py(py, e))?;
    Ok(v.into_iter()
        .map(|t| (t.name, core::dtype_name(t.dtype).to_owned(), t.shape))
        .collect())
}

/// Export `src` to `out` (`shmckpt::export::export`): `names` is `None` (every tensor of
/// the default selection, under its name there) or `[(name, exported name)]`. Returns the
/// report as a dict.
#[pyfunction]
#[pyo3(signature = (src, out, max_shard_size, names, dtype, include_optimizer, overwrite))]
#[allow(clippy::too_many_arguments)]
fn export_hf(
    py: Python<'_>,
    src: PathBuf,
    out: PathBuf,
    max_shard_size: String,
    names: Option<Vec<(String, String)>>,
    dtype: Option<String>,
    include_optimizer: bool,
    overwrite: bool,
) -> PyResult<BTreeMap<String, Py<PyAny>>> {
    let run = || -> shmckpt::Result<export::ExportReport> {
        let opts = ExportOptions {
            max_shard_size: export::parse_size(&max_shard_size)?,
            names,
            dtype: dtype.as_deref().map(export::parse_dtype).transpose()?,
            include_optimizer,
            overwrite,
            ..ExportOptions::default()
        };
        export::export(&src, &out, &opts)
    };
    let r = py.detach(run).map_err(|e| to_py(py, e))?;
    let mut d = BTreeMap::new();
    d.insert(
        "source".into(),
        // A str, not a pathlib.Path: `s3://...` would lose a slash in one.
        r.source.as_os_str().into_pyobject(py)?.into_any().unbind(),
    );
    d.insert("step".into(), r.step.into_pyobject(py)?.into_any().unbind());
    d.insert(
        "files".into(),
        r.files.into_pyobject(py)?.into_any().unbind(),
    );
    d.insert(
        "tensors".into(),
        r.tensors.into_pyobject(py)?.into_any().unbind(),
    );
    d.insert(
        "bytes".into(),
        r.bytes.into_pyobject(py)?.into_any().unbind(),
    );
    d.insert(
        "bytes_read".into(),
        r.bytes_read.into_pyobject(py)?.into_any().unbind(),
    );
    d.insert(
        "seconds".into(),
        r.seconds.into_pyobject(py)?.into_any().unbind(),
    );
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(export_names, m)?)?;
    m.add_function(wrap_pyfunction!(export_hf, m)?)?;
    Ok(())
}
