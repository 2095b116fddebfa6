//! `SaveHandle`: a save in flight, waited for in short slices with the GIL released and
//! signals checked between them; its report as a Python dict.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use shmckpt::SaveHandle;

use crate::{SLICE, core, lock, to_py};

/// A save in flight.
#[pyclass(module = "shmckpt._shmckpt", name = "SaveHandle", frozen)]
pub(crate) struct PySaveHandle {
    pub(crate) step: u64,
    /// The Rust handle, until `wait` has taken its result.
    pub(crate) inner: Mutex<Option<SaveHandle>>,
    /// The final result once known: a report dict or the error.
    pub(crate) result: Mutex<Option<Result<Py<PyDict>, PyErr>>>,
    /// The save's remote copy (remote tier on).
    pub(crate) remote: Option<shmckpt::remote::RemoteProgress>,
    /// Its result once known.
    pub(crate) remote_result: Mutex<Option<Result<Py<PyDict>, PyErr>>>,
    /// Where its committed image is put when held for replication (`replica_hold`).
    pub(crate) held: std::sync::Arc<shmckpt::replica::HeldCell>,
    /// The tensors of a save started with `blocking=False` (they own the memory the engine
    /// reads, DLPack tensors) and its torch streams and events, kept until it is staged ([`Self::release`];
    /// a handle dropped before leaves them to a thread that waits for it, see `Drop`).
    pub(crate) keep: Mutex<Option<Kept>>,
}

/// What a save started with `blocking=False` reads until it is staged: the tensors that
/// own the memory it copies, and the `torch.cuda.Stream`s and `Event`s its copies are
/// ordered after (torch keeps their handles valid while the objects live).
#[allow(dead_code, reason = "held only to be dropped once the save is staged")]
pub(crate) struct Kept {
    pub(crate) tensors: Vec<core::RawTensor>,
    pub(crate) order: Vec<Py<PyAny>>,
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
    d.set_item("snapshot_bytes", s.snapshot_bytes)?;
    d.set_item("snapshot_batched", s.snapshot_batched)?;
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
    d.set_item("committed", r.timings.committed.map(secs))?;
    d.set_item("backend", r.backend.to_string())?;
    d.set_item("direct_io", r.direct_io)?;
    // A memory-only save (`disk_every`): staged in shared memory, not durable.
    d.set_item("memory_only", r.memory_only)?;
    let tiers: &[&str] = if r.memory_only {
        &["memory"]
    } else {
        &["disk"]
    };
    d.set_item("tiers", PyList::new(py, tiers)?)?;
    d.set_item("retired", PyList::new(py, &r.retired)?)?;
    Ok(d)
}

impl PySaveHandle {
    /// `test` of the Rust handle, looked at under the lock for just that; `true` once
    /// `wait` has taken the handle (the save is over).
    fn looks(&self, test: fn(&SaveHandle) -> bool) -> bool {
        match &*lock(&self.inner) {
            Some(h) => test(h),
            None => true,
        }
    }

    /// Give the tensors' memory back to its producers once the save is staged (the engine
    /// no longer reads it). Called with the GIL held (a producer's deleter may take it).
    fn release(&self) {
        if self.looks(core::is_staged) {
            let kept = lock(&self.keep).take();
            drop(kept);
        }
    }
}

impl Drop for PySaveHandle {
    /// A save dropped before it is staged still reads its tensors: their memory is given
    /// back by a thread that waits until it is staged (or, if no thread can be started,
    /// never: leaked rather than freed under the engine's copies).
    fn drop(&mut self) {
        let kept = self
            .keep
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some(kept) = kept else { return };
        let watch = match self.inner.get_mut().unwrap_or_else(|p| p.into_inner()) {
            Some(h) if !h.is_staged() => h.watch(),
            _ => return drop(kept),
        };
        // Shared with the thread, so that a thread that cannot be started (its closure
        // then dropped) does not free them: they are leaked instead.
        let slot = std::sync::Arc::new(Mutex::new(Some(kept)));
        let theirs = std::sync::Arc::clone(&slot);
        let spawned = std::thread::Builder::new()
            .name("shmckpt-release".into())
            .spawn(move || {
                while !watch.is_staged() {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let kept = lock(&theirs).take();
                drop(kept);
            });
        if spawned.is_err()
            && let Some(kept) = lock(&slot).take()
        {
            std::mem::forget(kept);
        }
    }
}

/// Poll `ready` for at most one [`SLICE`], napping 20 µs at first, then up to 500 µs,
/// between looks. Call it with the GIL released.
fn poll_slice(ready: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + SLICE;
    let mut nap = Duration::from_micros(20);
    loop {
        if ready() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_micros(500));
    }
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
        let staged = self.looks(core::is_staged);
        if staged {
            self.release();
        }
        staged
    }

    /// True once the save is committed or failed.
    fn is_done(&self) -> bool {
        self.looks(core::is_done)
    }

    /// Block (GIL released, interruptible) until every byte is staged. Returns the staging
    /// report; raises if staging failed.
    fn wait_staged<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        while !py.detach(|| poll_slice(|| self.looks(core::is_staged))) {
            py.check_signals()?;
        }
        self.release();
        // Staged: `wait_staged` returns at once. No Python code runs under the lock (it
        // could switch threads to one that waits for the lock with the GIL held).
        let staged = lock(&self.inner).as_ref().map(core::wait_staged);
        match staged {
            Some(Ok(s)) => Ok(Some(staged_dict(py, &s)?)),
            Some(Err(e)) => Err(to_py(py, e)),
            // Already waited to completion: staging succeeded if the save did.
            None => match &*lock(&self.result) {
                Some(Err(e)) => Err(e.clone_ref(py)),
                _ => Ok(None),
            },
        }
    }

    /// Make each `(device, stream)` wait, on the device, for this save's copies on that
    /// device, blocking (GIL released) only until every copy is queued: work queued on those
    /// streams afterwards may change the tensors. Raises the save's error if staging failed.
    /// Each stream exactly a `torch.cuda.Stream` of its device (never an integer handle).
    fn hold_streams(&self, py: Python<'_>, streams: Vec<(i32, Bound<'_, PyAny>)>) -> PyResult<()> {
        let streams = streams
            .iter()
            .map(|(d, s)| Ok((*d, crate::order::torch_cuda_handle(s, "stream", *d)?)))
            .collect::<PyResult<Vec<(i32, u64)>>>()?;
        // The handle's lock only to look: the wait runs on a watch of the save, so a thread
        // asking `is_staged` with the GIL held never waits for this one (which can block
        // for as long as the save waits for staging chunks).
        let watch = lock(&self.inner).as_ref().map(SaveHandle::watch);
        let r = py.detach(|| match &watch {
            // SAFETY: each handle is the `CUstream` of a `torch.cuda.Stream` of its device
            // (`torch_cuda_handle`), which `streams` keeps alive for the call.
            Some(w) => unsafe { core::hold_streams(w, &streams) },
            None => Ok(()),
        });
        r.map_err(|e| to_py(py, e))
    }

    /// Ask a save started with `snapshot=True` for its device snapshot (returns at once;
    /// `hold_streams` then orders the streams after the snapshot's copies only).
    fn request_snapshot(&self) {
        if let Some(h) = &*lock(&self.inner) {
            h.request_snapshot();
        }
    }

    /// Device bytes of the save's snapshot (0 when none was taken, or once `wait` took
    /// the handle).
    fn snapshot_bytes(&self) -> u64 {
        lock(&self.inner)
            .as_ref()
            .map_or(0, SaveHandle::snapshot_bytes)
    }

    /// Block (GIL released, interruptible) until the checkpoint is durable and committed.
    /// Returns the save report (a dict); raises the save's error. May be called again.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        loop {
            self.release();
            if let Some(r) = &*lock(&self.result) {
                return match r {
                    Ok(d) => Ok(d.clone_ref(py)),
                    Err(e) => Err(e.clone_ref(py)),
                };
            }
            // Wait in slices, GIL released, taking the handle's lock only to look: a
            // thread asking `is_staged` or `is_done` (with the GIL) never waits for it.
            if !py.detach(|| poll_slice(|| self.looks(core::is_done))) {
                py.check_signals()?;
                continue;
            }
            // Done (or taken by another waiter): take the result without blocking, under
            // the lock only for that (no Python code runs under it).
            let taken = {
                let mut g = lock(&self.inner);
                match g.take().map(|h| core::wait_timeout(h, Duration::ZERO)) {
                    Some(Ok(res)) => Some(res),
                    Some(Err(h)) => {
                        *g = Some(h);
                        None
                    }
                    None => None,
                }
            };
            match taken {
                Some(res) => {
                    let stored = match res {
                        Ok(rep) => Ok(report_dict(py, &rep)?.unbind()),
                        Err(e) => Err(to_py(py, e)),
                    };
                    *lock(&self.result) = Some(stored);
                }
                // Another waiter took it and is storing the result: let it finish.
                None => py.detach(|| std::thread::sleep(Duration::from_micros(100))),
            }
        }
    }

    /// A save started with `confirm=True`: its tensors `(name, dtype, shape, crc32c)` once
    /// its file is durable (the commit then waits for `confirm_commit`); `None` while not
    /// known yet. Raises the save's error when it failed first (`ConfigError` for a save
    /// started without `confirm`, or once `wait` took the handle).
    #[allow(clippy::type_complexity)]
    fn checksums(
        &self,
        py: Python<'_>,
    ) -> PyResult<Option<Vec<(String, String, Vec<usize>, u32)>>> {
        let r = match &*lock(&self.inner) {
            Some(h) => h.checksums(),
            None => Some(Err(shmckpt::Error::Config(
                "the save's handle was already waited for".into(),
            ))),
        };
        match r {
            None => Ok(None),
            Some(Ok(v)) => Ok(Some(
                v.into_iter()
                    .map(|t| {
                        (
                            t.name,
                            core::dtype_name(t.dtype).to_owned(),
                            t.shape,
                            t.crc32c,
                        )
                    })
                    .collect(),
            )),
            Some(Err(e)) => Err(to_py(py, e)),
        }
    }

    /// Decide the commit of a save started with `confirm=True` or `provisional=True`:
    /// `reason=None` commits it, a string refuses it (the save then fails with
    /// `CommitRefused` carrying it, its file removed). The first decision counts.
    ///
    /// Runs without the interpreter's lock: confirming a memory-only save whose staging
    /// ended installs it into the memory tier, which can wait for a load copying from
    /// that tier. The handle's lock is taken and released inside (no thread waits for it
    /// while holding the interpreter's lock and being waited for).
    #[pyo3(signature = (reason=None))]
    fn confirm_commit(&self, py: Python<'_>, reason: Option<String>) {
        py.detach(|| {
            if let Some(h) = &*lock(&self.inner) {
                h.confirm_commit(reason.map_or(Ok(()), Err));
            }
        });
    }

    /// Block (GIL released, interruptible) until the step is committed in the bucket.
    /// Returns the remote report (`bytes`, `upload` and `remote_durable` seconds, ...);
    /// raises `RemoteFailed`/`RemoteSkipped`. May be called again.
    fn wait_remote(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        wait_remote(self, py)
    }

    /// The save's committed image held in its staging chunks for replication (engine
    /// opened with `replica_hold=True`), once committed, when it was whole in the arena;
    /// `None` otherwise or once taken. Close it when done (its chunks return then).
    fn take_held_image(&self) -> Option<crate::held::PyHeldImage> {
        self.held.take().map(crate::held::PyHeldImage::new)
    }

    /// True once this rank's remote copy is over (or there is no remote tier).
    fn is_remote_done(&self) -> bool {
        is_remote_done(self)
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

/// The remote tier's report of a save as a dict.
fn remote_report_dict<'py>(
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
    d.set_item("read_from_file", r.read_from_file)?;
    // An earlier failed step this save uploaded again: (step, None) when it is in the
    // bucket now, (step, why) when it was not uploaded again or failed again.
    let retried = match &r.retried {
        Some((s, Ok(()))) => Some((*s, None)),
        Some((s, Err(why))) => Some((*s, Some(why.clone()))),
        None => None,
    };
    d.set_item("retried", retried)?;
    Ok(d)
}

pub(crate) fn wait_remote(h: &PySaveHandle, py: Python<'_>) -> PyResult<Py<PyDict>> {
    let Some(p) = &h.remote else {
        return Err(to_py(
            py,
            shmckpt::Error::Config(
                "this save has no remote copy: the checkpointer has no remote tier (remote=...), \
                 or its cadence kept the save off the bucket (disk_every, remote_every)"
                    .into(),
            ),
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
                    Ok(rep) => Ok(remote_report_dict(py, &rep)?.unbind()),
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
