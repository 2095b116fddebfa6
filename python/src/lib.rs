//! `shmckpt._shmckpt`: the bytes-level Python extension over the Rust engine.
//!
//! Tensors arrive as `(name, dtype, shape, address, nbytes, device)` tuples; the Python
//! package (`shmckpt/*.py`) owns the torch objects and keeps them alive and unmodified for
//! as long as this module says. Every blocking call releases the GIL; waits run in short
//! slices with `check_signals` between them, so Ctrl-C raises `KeyboardInterrupt` while
//! the engine carries on (a save in flight still finishes or fails cleanly).
//!
//! All calls into the `shmckpt` crate are in `core.rs`.

mod core;
mod dcp;
mod replica;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use shmckpt::{Engine, SaveHandle};

use crate::core::{After, EngineOpts, Place, RawTensor};

/// How long one slice of a wait lasts before signals are checked.
const SLICE: Duration = Duration::from_millis(50);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The `shmckpt.errors` exception for a Rust error, with the Rust message.
fn to_py(py: Python<'_>, e: shmckpt::Error) -> PyErr {
    let class = core::error_class(&e);
    let msg = e.to_string();
    let errno = e.raw_os_error();
    let build = || -> PyResult<PyErr> {
        let module = py.import("shmckpt.errors")?;
        let cls = module.getattr(class)?;
        let obj = cls.call1((msg.clone(),))?;
        obj.setattr("kind", class)?;
        obj.setattr("errno_code", errno)?;
        Ok(PyErr::from_value(obj))
    };
    build().unwrap_or_else(|_| PyRuntimeError::new_err(msg))
}

fn err(e: shmckpt::Error) -> PyErr {
    Python::attach(|py| to_py(py, e))
}

/// The engine of one rank: owns the staging arena, the writers and the commit thread.
#[pyclass(module = "shmckpt._shmckpt", name = "Engine", frozen)]
struct PyEngine {
    inner: Mutex<Option<Arc<Engine>>>,
    /// Which path served the last load (`"disk"` or `"memory"`) and why memory could not.
    last_load: Mutex<Option<core::Served>>,
}

impl PyEngine {
    fn get(&self) -> PyResult<Arc<Engine>> {
        lock(&self.inner).clone().ok_or_else(|| {
            err(shmckpt::Error::Shutdown(
                "the engine was closed (Checkpointer.close)".into(),
            ))
        })
    }
}

type TensorTuple = (String, String, Vec<usize>, u64, usize, i32);

/// The tensors of a save. A null address with bytes is refused (`core::tensors` makes
/// slices of host ranges, and a null one would be undefined behaviour): the Python package
/// never passes one (it refuses tensors with no data in memory), this is the last check.
fn raw_tensors(list: Vec<TensorTuple>) -> PyResult<Vec<RawTensor>> {
    list.into_iter()
        .map(|(name, dtype, shape, ptr, len, device)| {
            let dt = core::dtype(&dtype).ok_or_else(|| {
                PyValueError::new_err(format!("tensor {name:?}: unknown dtype {dtype:?}"))
            })?;
            if ptr == 0 && len > 0 {
                return Err(PyValueError::new_err(format!(
                    "tensor {name:?} has a null address"
                )));
            }
            let place = if device < 0 {
                Place::Host
            } else {
                Place::Cuda(device)
            };
            Ok(RawTensor {
                name,
                dtype: dt,
                shape,
                ptr,
                len,
                place,
            })
        })
        .collect()
}

fn afters(list: Vec<(i32, String, u64)>) -> PyResult<Vec<After>> {
    list.into_iter()
        .map(|(device, kind, h)| match kind.as_str() {
            "stream" => Ok(After::Stream { device, stream: h }),
            "event" => Ok(After::Event { device, event: h }),
            k => Err(PyValueError::new_err(format!(
                "ordering kind must be 'stream' or 'event', not {k:?}"
            ))),
        })
        .collect()
}

#[pymethods]
impl PyEngine {
    /// Open an engine for checkpoints under `root` (an existing, writable directory).
    /// `None` settings take the Rust defaults.
    #[new]
    #[pyo3(signature = (root, *, rank=0, world_size=1, staging_capacity=None, chunk_size=None,
        writer_threads=None, queue_depth=None, copy_threads=None, direct_io=None,
        keep_last=None, shm_name=None, max_inflight_saves=None, recover_on_open=None,
        keep_in_memory=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        root: std::path::PathBuf,
        rank: u32,
        world_size: u32,
        staging_capacity: Option<u64>,
        chunk_size: Option<u64>,
        writer_threads: Option<usize>,
        queue_depth: Option<u32>,
        copy_threads: Option<usize>,
        direct_io: Option<bool>,
        keep_last: Option<usize>,
        shm_name: Option<String>,
        max_inflight_saves: Option<u32>,
        recover_on_open: Option<bool>,
        keep_in_memory: Option<bool>,
    ) -> PyResult<Self> {
        let opts = EngineOpts {
            root,
            staging_capacity,
            chunk_size,
            writer_threads,
            queue_depth,
            copy_threads,
            direct_io,
            keep_last,
            rank,
            world_size,
            shm_name,
            max_inflight_saves,
            recover_on_open,
            keep_in_memory,
        };
        let engine = py.detach(|| core::open(opts)).map_err(|e| to_py(py, e))?;
        Ok(PyEngine {
            inner: Mutex::new(Some(Arc::new(engine))),
            last_load: Mutex::new(None),
        })
    }

    /// Save `tensors` (tuples `(name, dtype, shape, address, nbytes, device)`, device -1
    /// for host memory) as `step`, with string `metadata`. `after` lists
    /// `(device, "stream" | "event", handle)`: each device's copies start after that
    /// stream's queued work or that event.
    ///
    /// `blocking=True` returns once every byte is staged. `blocking=False` returns at
    /// once: the caller must keep every tensor alive and unmodified, and every stream or
    /// event alive, until the handle reports the save staged.
    #[pyo3(signature = (step, tensors, metadata, after, blocking))]
    fn save(
        &self,
        py: Python<'_>,
        step: u64,
        tensors: Vec<TensorTuple>,
        metadata: BTreeMap<String, String>,
        after: Vec<(i32, String, u64)>,
        blocking: bool,
    ) -> PyResult<PySaveHandle> {
        let engine = self.get()?;
        let raw = raw_tensors(tensors)?;
        let after = afters(after)?;
        let res = py.detach(|| {
            if blocking {
                // SAFETY: the Python caller (shmckpt.checkpointer) holds a reference to
                // every tensor and stream for the whole call, so each address range stays
                // allocated; it passes only contiguous ranges of the tensors' storage.
                unsafe { core::save(&engine, step, &raw, &metadata, &after) }
            } else {
                // SAFETY: the Python caller keeps the tensors (and streams/events) in the
                // returned handle until it reports staged, and orders every writer of
                // them after staging (guard) or gives copies it owns.
                unsafe { core::save_async(&engine, step, &raw, &metadata, &after) }
            }
        });
        let h = res.map_err(|e| to_py(py, e))?;
        Ok(PySaveHandle {
            step,
            inner: Mutex::new(Some(h)),
            result: Mutex::new(None),
        })
    }

    /// Load this rank's tensors of `step` (`None`: the latest) into owned buffers,
    /// verifying every checksum. Returns `(step, dir, metadata, [(name, dtype, shape,
    /// Buffer)])`.
    #[pyo3(signature = (step=None))]
    #[allow(clippy::type_complexity)]
    fn load(
        &self,
        py: Python<'_>,
        step: Option<u64>,
    ) -> PyResult<(
        u64,
        String,
        BTreeMap<String, String>,
        Vec<(String, String, Vec<usize>, PyBuffer)>,
    )> {
        let engine = self.get()?;
        let (ck, served) = py
            .detach(|| core::load(&engine, step))
            .map_err(|e| to_py(py, e))?;
        *lock(&self.last_load) = Some(served);
        let tensors = ck
            .tensors
            .into_iter()
            .map(|t| {
                let dtype = core::dtype_name(t.dtype).to_owned();
                (t.name, dtype, t.shape, PyBuffer::new(t.data))
            })
            .collect();
        Ok((
            ck.step,
            ck.dir.to_string_lossy().into_owned(),
            ck.metadata,
            tensors,
        ))
    }

    /// Load into host memory: `dest` lists `(name, address, nbytes)`, one per tensor of
    /// the checkpoint, non-overlapping, exactly the tensor's size. Returns the step.
    #[pyo3(signature = (step, dest))]
    fn load_into(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        dest: Vec<(String, u64, usize)>,
    ) -> PyResult<u64> {
        let engine = self.get()?;
        check_host_ranges(&dest)?;
        py.detach(|| {
            // SAFETY: the Python caller holds the destination tensors for the whole call and
            // does not use them meanwhile; the ranges were checked above not to overlap and
            // to have non-null addresses.
            unsafe { core::load_into_host(&engine, step, &dest) }
        })
        .map_err(|e| to_py(py, e))
    }

    /// Load into device memory: `dest` lists `(name, device pointer, nbytes, device)`.
    /// The caller makes sure no queued device work uses the memory. Returns the step.
    #[pyo3(signature = (step, dest))]
    fn load_into_device(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        dest: Vec<(String, u64, usize, i32)>,
    ) -> PyResult<u64> {
        let engine = self.get()?;
        let (step, served) = py
            .detach(|| {
                // SAFETY: the Python caller holds the destination tensors for the whole
                // call, synchronized their streams before the call and does not use them
                // meanwhile.
                unsafe { core::load_into_device(&engine, step, &dest) }
            })
            .map_err(|e| to_py(py, e))?;
        *lock(&self.last_load) = Some(served);
        Ok(step)
    }

    /// Which path served the last `load` or `load_into_device` of this engine:
    /// `("disk", reason)`, the reason saying why shared memory could not serve it when
    /// flash restore (`keep_in_memory`) is on, or `("memory", problem)`, the problem being
    /// what the check of the disk copy's size and header found wrong (`None`: nothing).
    /// `None` before the first load.
    fn last_load_source(&self) -> Option<(String, Option<String>)> {
        lock(&self.last_load)
            .as_ref()
            .map(|(s, r)| ((*s).to_owned(), r.clone()))
    }

    /// Committed checkpoints, oldest first: `[(step, dir)]`.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<(u64, String)>> {
        let engine = self.get()?;
        let l = py
            .detach(|| core::list(&engine))
            .map_err(|e| to_py(py, e))?;
        Ok(l.into_iter()
            .map(|(s, d)| (s, d.to_string_lossy().into_owned()))
            .collect())
    }

    /// The newest committed step, or `None`.
    fn latest(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let engine = self.get()?;
        py.detach(|| core::latest(&engine))
            .map_err(|e| to_py(py, e))
    }

    /// The manifest of `step` (`None`: the latest) as a JSON string.
    #[pyo3(signature = (step=None))]
    fn manifest(&self, py: Python<'_>, step: Option<u64>) -> PyResult<String> {
        let engine = self.get()?;
        py.detach(|| core::manifest_json(&engine, step))
            .map_err(|e| to_py(py, e))
    }

    /// Set up CUDA for `devices` now (registration of the staging arena). Returns the
    /// registration time in seconds if this call registered.
    fn prepare_cuda(&self, py: Python<'_>, devices: Vec<i32>) -> PyResult<Option<f64>> {
        let engine = self.get()?;
        py.detach(|| core::prepare_cuda(&engine, &devices))
            .map(|d| d.map(|d| d.as_secs_f64()))
            .map_err(|e| to_py(py, e))
    }

    /// Wait for every save in flight to be committed or to fail.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.get()?;
        py.detach(|| core::flush(&engine)).map_err(|e| to_py(py, e))
    }

    /// Finish the saves in flight, stop the threads and remove the staging segment.
    /// Idempotent.
    fn close(&self, py: Python<'_>) {
        let taken = lock(&self.inner).take();
        if let Some(engine) = taken {
            py.detach(move || match Arc::try_unwrap(engine) {
                Ok(e) => core::close(e),
                // Another thread is inside a call: the last reference closes it on drop.
                Err(shared) => drop(shared),
            });
        }
    }

    /// True once `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// `(shm_name, staging_capacity, backend, root)`.
    fn describe(&self) -> PyResult<(String, u64, String, String)> {
        let engine = self.get()?;
        let (n, c, b, r) = core::describe(&engine);
        Ok((n, c, b, r.to_string_lossy().into_owned()))
    }
}

/// Host destinations `(name, address, nbytes)`: none may overlap another
/// ([`check_disjoint`]) or have a null address and bytes (`core::host_slices` makes slices
/// of them).
pub(crate) fn check_host_ranges(dest: &[(String, u64, usize)]) -> PyResult<()> {
    check_disjoint(dest.iter().map(|(n, p, l)| (n.as_str(), *p, *l)))?;
    if let Some((n, _, _)) = dest.iter().find(|(_, p, l)| *p == 0 && *l > 0) {
        return Err(PyValueError::new_err(format!(
            "destination {n:?} has a null address"
        )));
    }
    Ok(())
}

/// Overlapping destinations would alias mutable memory: refuse them.
pub(crate) fn check_disjoint<'a>(
    ranges: impl Iterator<Item = (&'a str, u64, usize)>,
) -> PyResult<()> {
    let mut v: Vec<(u64, u64, &str)> = ranges
        .filter(|(_, _, l)| *l > 0)
        .map(|(n, p, l)| (p, p.saturating_add(l as u64), n))
        .collect();
    v.sort_unstable();
    for w in v.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(PyValueError::new_err(format!(
                "destinations {:?} and {:?} overlap in memory",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}

/// A save in flight.
#[pyclass(module = "shmckpt._shmckpt", name = "SaveHandle", frozen)]
struct PySaveHandle {
    step: u64,
    /// The Rust handle, until `wait` has taken its result.
    inner: Mutex<Option<SaveHandle>>,
    /// The final result once known: a report dict or the error.
    result: Mutex<Option<Result<Py<PyDict>, PyErr>>>,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn staged_dict<'py>(py: Python<'py>, s: &shmckpt::StagedReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", s.step)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("staging", secs(s.staging))?;
    d.set_item("backpressure", secs(s.backpressure))?;
    d.set_item("registration", secs(s.registration))?;
    Ok(d)
}

fn report_dict<'py>(py: Python<'py>, r: &shmckpt::SaveReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    d.set_item(
        "dir",
        r.dir.as_ref().map(|p| p.to_string_lossy().into_owned()),
    )?;
    d.set_item("file", r.file.to_string_lossy().into_owned())?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("tensors", r.tensors)?;
    d.set_item("staging", secs(r.timings.staging))?;
    d.set_item("backpressure", secs(r.timings.backpressure))?;
    d.set_item("durable", secs(r.timings.durable))?;
    d.set_item("committed", secs(r.timings.committed))?;
    d.set_item("backend", r.backend.to_string())?;
    d.set_item("direct_io", r.direct_io)?;
    d.set_item("retired", PyList::new(py, &r.retired)?)?;
    Ok(d)
}

#[pymethods]
impl PySaveHandle {
    /// The step.
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }

    /// True once every byte is staged (or staging failed): the tensors are no longer read.
    fn is_staged(&self) -> bool {
        match &*lock(&self.inner) {
            Some(h) => core::is_staged(h),
            None => true,
        }
    }

    /// True once the save is committed or failed.
    fn is_done(&self) -> bool {
        match &*lock(&self.inner) {
            Some(h) => core::is_done(h),
            None => true,
        }
    }

    /// Block (GIL released, interruptible) until every byte is staged. Returns the staging
    /// report; raises if staging failed.
    fn wait_staged<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        loop {
            let staged = py.detach(|| {
                let deadline = Instant::now() + SLICE;
                let mut nap = Duration::from_micros(20);
                loop {
                    let s = match &*lock(&self.inner) {
                        Some(h) => core::is_staged(h),
                        None => true,
                    };
                    if s || Instant::now() >= deadline {
                        return s;
                    }
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(Duration::from_micros(500));
                }
            });
            if staged {
                break;
            }
            py.check_signals()?;
        }
        let g = lock(&self.inner);
        match &*g {
            Some(h) => match core::wait_staged(h) {
                Ok(s) => Ok(Some(staged_dict(py, &s)?)),
                Err(e) => Err(to_py(py, e)),
            },
            None => {
                drop(g);
                // Already waited to completion: staging succeeded if the save did.
                match &*lock(&self.result) {
                    Some(Err(e)) => Err(e.clone_ref(py)),
                    _ => Ok(None),
                }
            }
        }
    }

    /// Block (GIL released, interruptible) until the checkpoint is durable and committed.
    /// Returns the save report (a dict); raises the save's error. May be called again.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        loop {
            if let Some(r) = &*lock(&self.result) {
                return match r {
                    Ok(d) => Ok(d.clone_ref(py)),
                    Err(e) => Err(e.clone_ref(py)),
                };
            }
            let out = py.detach(|| {
                let mut g = lock(&self.inner);
                let h = g.take()?;
                match core::wait_timeout(h, SLICE) {
                    Ok(res) => Some(res),
                    Err(h) => {
                        *g = Some(h);
                        None
                    }
                }
            });
            match out {
                Some(res) => {
                    let stored = match res {
                        Ok(rep) => Ok(report_dict(py, &rep)?.unbind()),
                        Err(e) => Err(to_py(py, e)),
                    };
                    *lock(&self.result) = Some(stored);
                }
                None => py.check_signals()?,
            }
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "SaveHandle(step={}, staged={}, done={})",
            self.step,
            self.is_staged(),
            self.is_done()
        )
    }
}

/// Bytes of one loaded tensor, owned by Rust, exposed without a copy through
/// `__array_interface__` (numpy keeps this object alive as the array's base).
#[pyclass(module = "shmckpt._shmckpt", name = "Buffer", frozen)]
struct PyBuffer {
    /// Owns the memory; never read or written by Rust after construction (only dropped).
    _data: shmckpt::AlignedBytes,
    /// Address of the first byte, taken from a mutable borrow at construction.
    ptr: usize,
    len: usize,
}

impl PyBuffer {
    fn new(mut data: shmckpt::AlignedBytes) -> Self {
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
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.len,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr, false))?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.len
    }
}

/// The dtype names (safetensors spelling) the engine knows.
#[pyfunction]
fn dtypes() -> Vec<&'static str> {
    core::all_dtype_names()
}

#[pymodule]
fn _shmckpt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<PySaveHandle>()?;
    m.add_class::<PyBuffer>()?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    dcp::register(m)?;
    replica::register(m)?;
    Ok(())
}
