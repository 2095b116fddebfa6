//! Helpers every module of the extension uses (`lib.rs` re-exports them to the crate):
//! in a file of their own so that the modules `lib.rs` imports do not import `lib.rs`.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::core;

/// How long one slice of a wait lasts before signals are checked.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The `shmckpt.errors` exception for a Rust error, with the Rust message.
pub(crate) fn to_py(py: Python<'_>, e: shmckpt::Error) -> PyErr {
    let class = core::error_class(&e);
    let msg = e.to_string();
    let errno = e.raw_os_error();
    let build = || -> PyResult<PyErr> {
        let module = py.import("shmckpt.errors")?;
        let cls = module.getattr(class)?;
        let obj = cls.call1((msg.clone(),))?;
        obj.setattr("kind", class)?;
        obj.setattr("errno_code", errno)?;
        obj.setattr("path", e.path().map(|p| p.as_os_str()))?;
        obj.setattr("tensor", e.tensor())?;
        obj.setattr("step", e.step())?;
        obj.setattr("offset", e.offset())?;
        Ok(PyErr::from_value(obj))
    };
    build().unwrap_or_else(|_| PyRuntimeError::new_err(msg))
}
