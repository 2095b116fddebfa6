//! How a save's device copies are ordered after the trainer's work, as Python hands it
//! over: torch's own stream and event objects, never integer handles.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::core::After;

/// The driver handle of `obj`, which must be exactly a `torch.cuda.Stream` (`kind`
/// "stream", of device `device`) or a recorded `torch.cuda.Event` ("event"): objects whose
/// handle torch made and keeps valid while they live (the caller keeps them alive for as
/// long as the save uses the handle). Never an integer nor a subclass: a handle made up
/// in Python would reach the driver.
pub(crate) fn torch_cuda_handle(obj: &Bound<'_, PyAny>, kind: &str, device: i32) -> PyResult<u64> {
    let (class, attr) = match kind {
        "stream" => ("Stream", "cuda_stream"),
        "event" => ("Event", "cuda_event"),
        k => {
            return Err(PyValueError::new_err(format!(
                "ordering kind must be 'stream' or 'event', not {k:?}"
            )));
        }
    };
    let want = obj.py().import("torch.cuda")?.getattr(class)?;
    let ty = obj.get_type();
    if !ty.is(&want) {
        return Err(PyTypeError::new_err(format!(
            "a save's {kind} must be a torch.cuda.{class} (not a subclass), not {}",
            ty.name()?
        )));
    }
    if kind == "stream" {
        let d: i64 = obj.getattr("device_index")?.extract()?;
        if d != i64::from(device) {
            return Err(PyValueError::new_err(format!(
                "a save's stream for device {device} is of device {d}"
            )));
        }
    }
    let h: u64 = obj.getattr(attr)?.extract()?;
    if kind == "event" && h == 0 {
        return Err(PyValueError::new_err(
            "a save's event must be recorded (torch creates its CUevent at the first record)",
        ));
    }
    Ok(h)
}

/// `(device, "stream" | "event", torch.cuda.Stream | torch.cuda.Event)` to the orderings,
/// with the objects to keep alive while the save uses their handles.
pub(crate) fn afters(
    list: Vec<(i32, String, Bound<'_, PyAny>)>,
) -> PyResult<(Vec<After>, Vec<Py<PyAny>>)> {
    let mut after = Vec::with_capacity(list.len());
    let mut objs = Vec::with_capacity(list.len());
    for (device, kind, obj) in list {
        let h = torch_cuda_handle(&obj, &kind, device)?;
        after.push(if kind == "stream" {
            After::Stream { device, stream: h }
        } else {
            After::Event { device, event: h }
        });
        objs.push(obj.unbind());
    }
    Ok((after, objs))
}
