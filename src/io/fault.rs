//! Fault injection for tests (feature `fault-injection`): wraps a backend and, for requests
//! that overlap chosen file offsets, returns an errno, shortens the request, or delays it.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::{Completion, IoBackend, IoOp, OpKind};
use crate::util::lock;

/// What happens to a matching request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Complete with `-errno` without touching the file (`libc::ENOSPC`, `libc::EIO`...).
    Errno(i32),
    /// Transfer at most this many bytes (rounded down to 4096 when larger, as a device
    /// would); the caller must resubmit the rest.
    Short(u32),
    /// Sleep before passing the request on (a slow disk).
    Delay(Duration),
}

/// One rule: requests of `kind` overlapping `offsets` get `fault`, `times` times (`None`:
/// always).
#[derive(Debug, Clone)]
pub struct Rule {
    /// Reads or writes.
    pub kind: OpKind,
    /// File offsets the request must overlap.
    pub offsets: Range<u64>,
    /// The fault.
    pub fault: Fault,
    /// How many more times it fires; `None` for always.
    pub times: Option<usize>,
}

/// A set of rules shared by every backend of an engine.
#[derive(Debug, Default)]
pub struct FaultPlan {
    rules: Mutex<Vec<Rule>>,
    fired: AtomicUsize,
}

impl FaultPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a rule.
    pub fn add(&self, rule: Rule) -> &Self {
        lock(&self.rules).push(rule);
        self
    }

    /// Writes overlapping `offset` fail once with `errno`.
    pub fn fail_write_at(&self, offset: u64, errno: i32) -> &Self {
        self.add(Rule {
            kind: OpKind::Write,
            offsets: offset..offset + 1,
            fault: Fault::Errno(errno),
            times: Some(1),
        })
    }

    /// Remove every rule.
    pub fn clear(&self) {
        lock(&self.rules).clear();
    }

    /// Number of faults injected so far.
    pub fn fired(&self) -> usize {
        self.fired.load(Ordering::Relaxed)
    }

    fn take(&self, op: &IoOp) -> Option<Fault> {
        let mut rules = lock(&self.rules);
        let end = op.offset + op.len as u64;
        let r = rules.iter_mut().find(|r| {
            r.kind == op.kind
                && r.offsets.start < end
                && op.offset < r.offsets.end
                && r.times != Some(0)
        })?;
        if let Some(t) = &mut r.times {
            *t -= 1;
        }
        self.fired.fetch_add(1, Ordering::Relaxed);
        Some(r.fault)
    }
}

/// A backend with faults.
pub struct FaultyBackend {
    inner: Box<dyn IoBackend>,
    plan: std::sync::Arc<FaultPlan>,
    synthetic: VecDeque<Completion>,
}

impl FaultyBackend {
    /// Wrap `inner`.
    pub(crate) fn new(inner: Box<dyn IoBackend>, plan: std::sync::Arc<FaultPlan>) -> Self {
        FaultyBackend {
            inner,
            plan,
            synthetic: VecDeque::new(),
        }
    }
}

impl IoBackend for FaultyBackend {
    fn backend(&self) -> super::Backend {
        self.inner.backend()
    }

    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    /// # Safety
    /// The contract of [`IoBackend::push`]: the buffer stays valid (and untouched by
    /// others) until this request's completion is returned by `wait`.
    unsafe fn push(&mut self, mut op: IoOp) -> io::Result<()> {
        match self.plan.take(&op) {
            Some(Fault::Errno(e)) => {
                self.synthetic.push_back(Completion {
                    user_data: op.user_data,
                    result: -e,
                });
                return Ok(());
            }
            Some(Fault::Short(n)) => {
                let n = if n >= 4096 { n / 4096 * 4096 } else { n.max(1) };
                op.len = op.len.min(n);
            }
            Some(Fault::Delay(d)) => std::thread::sleep(d),
            None => {}
        }
        // SAFETY: same request (possibly shorter) under the caller's contract.
        unsafe { self.inner.push(op) }
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        let have = self.synthetic.len();
        out.extend(self.synthetic.drain(..));
        let need = min.saturating_sub(have);
        if self.inner.in_flight() > 0 || need > 0 {
            self.inner.wait(need, out)?;
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.synthetic.len()
    }

    fn idle_setup(&mut self) -> bool {
        self.inner.idle_setup()
    }
}
