//! The trainer's connection to the writer process: requests and their replies, and the
//! durable reports that arrive later (read by one reader thread).

use std::collections::{HashMap, HashSet};
use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};

use super::wire::{
    Reply, Request, WireError, WireReport, from_wire, lock, read_frame, write_frame,
};

#[derive(Default)]
pub(super) struct ClientState {
    pub(super) replies: HashMap<u64, Reply>,
    pub(super) durable: HashMap<u64, std::result::Result<WireReport, WireError>>,
    pub(super) abandoned: HashSet<u64>,
    pub(super) closed: Option<String>,
}

pub(super) struct Inner {
    pub(super) out: Mutex<UnixStream>,
    /// One request at a time (the writer answers in order).
    pub(super) request: Mutex<()>,
    pub(super) next_id: AtomicU64,
    pub(super) state: Mutex<ClientState>,
    pub(super) changed: Condvar,
    pub(super) pid: u32,
}

impl Inner {
    pub(super) fn gone(&self, why: &str) -> Error {
        Error::Ipc(format!("writer (pid {}) is gone: {why}", self.pid))
    }

    /// Send a request and wait for its reply (until `deadline`, if any). A `failed` reply
    /// becomes the error it carries.
    pub(super) fn call(
        &self,
        make: impl FnOnce(u64) -> Request,
        deadline: Option<Instant>,
    ) -> Result<Reply> {
        let _one = lock(&self.request);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Some(why) = &lock(&self.state).closed {
            return Err(self.gone(why));
        }
        let req = make(id);
        write_frame(&mut *lock(&self.out), &req)
            .map_err(|e| self.gone(&format!("cannot send a request: {e}")))?;
        let mut st = lock(&self.state);
        loop {
            if let Some(r) = st.replies.remove(&id) {
                return match r {
                    Reply::Failed { error, .. } => Err(from_wire(error, self.pid)),
                    other => Ok(other),
                };
            }
            if let Some(why) = &st.closed {
                return Err(self.gone(why));
            }
            st = match deadline {
                None => self.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::Ipc(format!(
                            "writer (pid {}) did not answer in time",
                            self.pid
                        )));
                    }
                    self.changed
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    pub(super) fn read_loop(self: Arc<Self>, stream: UnixStream) {
        let mut r = BufReader::new(stream);
        let why = loop {
            match read_frame::<Reply>(&mut r) {
                Ok(Some(reply)) => {
                    let mut st = lock(&self.state);
                    match reply {
                        Reply::Durable { id, report } => {
                            if !st.abandoned.remove(&id) {
                                st.durable.insert(id, Ok(report));
                            }
                        }
                        Reply::DurableFailed { id, error } => {
                            if !st.abandoned.remove(&id) {
                                st.durable.insert(id, Err(error));
                            }
                        }
                        other => {
                            st.replies.insert(other.id(), other);
                        }
                    }
                    drop(st);
                    self.changed.notify_all();
                }
                Ok(None) => break "the writer closed the connection".to_owned(),
                Err(e) => break format!("connection to the writer broken: {e}"),
            }
        };
        lock(&self.state).closed = Some(why);
        self.changed.notify_all();
    }
}
