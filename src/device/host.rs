//! Host sources: `memcpy` from the caller's slices into staging chunks, by several threads
//! for large saves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::StageJob;
use crate::error::{Error, Result};
use crate::plan::PieceSource;
use crate::staging::{Arena, ChunkLease};
use crate::util::lock;

/// Saves smaller than this are copied by one thread.
pub const PARALLEL_COPY_MIN: u64 = 64 << 20;

/// Copy a save whose sources are all in host memory into staging, handing each chunk to
/// `job.dispatch`. Large saves use up to `copy_threads` threads, each taking every
/// `threads`-th chunk; the threads take their chunks from the pool in file order (the
/// copies still run in parallel), so an arena that hands out consecutive chunks holds the
/// file in consecutive chunks (a held image's pieces are then zero-copy views). Returns the
/// time staging was blocked waiting for free chunks: wall time during which at least one
/// thread waited, so it never exceeds the time spent here.
pub(crate) fn stage_host(
    arena: &Arc<Arena>,
    job: &StageJob<'_>,
    copy_threads: usize,
) -> Result<Duration> {
    let cs = arena.chunk_size();
    let n = job.plan.chunk_count(cs);
    let threads = if job.plan.file_len() < PARALLEL_COPY_MIN {
        1
    } else {
        (copy_threads as u64).clamp(1, n.max(1))
    };
    let clock = WaitClock::default();
    let turn = Turn::default();
    let run = |first: u64| -> Result<()> {
        // Every early way out of this thread (an error, a panic) lets the others stop
        // waiting for the turns of its chunks.
        let leave = Leave {
            turn: &turn,
            early: true,
        };
        let mut c = first;
        while c < n {
            if (job.failed)() {
                return Err(Error::Cancelled("the save failed while staging".into()));
            }
            let mut lease = turn
                .in_order(c, || match arena.try_acquire() {
                    Some(l) => l,
                    None => clock.time(|| arena.acquire().0),
                })
                .ok_or_else(|| Error::Cancelled("the save failed while staging".into()))?;
            let (len, write_len) = fill(job, &mut lease, c, cs);
            (job.dispatch)(lease, c, len, write_len)?;
            c += threads;
        }
        leave.finished();
        Ok(())
    };
    if threads == 1 {
        run(0)?;
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = (1..threads).map(|t| s.spawn(move || run(t))).collect();
            let mut res = run(0);
            for h in handles {
                let r = h
                    .join()
                    .unwrap_or_else(|_| Err(Error::Internal("a staging thread panicked".into())));
                if res.is_ok() {
                    res = r;
                }
            }
            res
        })?;
    }
    Ok(clock.total())
}

/// File chunks take their staging chunks in file order ([`Turn::in_order`]).
#[derive(Debug, Default)]
struct Turn {
    /// (the next file chunk to take its staging chunk, a thread left early).
    state: Mutex<(u64, bool)>,
    changed: std::sync::Condvar,
}

impl Turn {
    /// Run `take` for file chunk `c` once every chunk before it took its own; `None`
    /// (nothing run) when a thread left early (its chunks will never take theirs).
    fn in_order<T>(&self, c: u64, take: impl FnOnce() -> T) -> Option<T> {
        let mut s = lock(&self.state);
        while s.0 != c && !s.1 {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        if s.1 {
            return None;
        }
        drop(s);
        let out = take();
        lock(&self.state).0 += 1;
        self.changed.notify_all();
        Some(out)
    }
}

/// Held by a staging thread: dropped before [`Leave::finished`] (the thread ends early, an
/// error or a panic), it marks the turn left, so that threads waiting for chunks after its
/// next one stop waiting.
struct Leave<'a> {
    turn: &'a Turn,
    early: bool,
}

impl Leave<'_> {
    /// Every chunk of the thread took its staging chunk: nothing waits on it.
    fn finished(mut self) {
        self.early = false;
    }
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if self.early {
            lock(&self.turn.state).1 = true;
            self.turn.changed.notify_all();
        }
    }
}

/// Fill `lease` with file chunk `c` from host sources. Returns (bytes of the file in the
/// chunk, bytes to write).
fn fill(job: &StageJob<'_>, lease: &mut ChunkLease, c: u64, cs: u64) -> (usize, usize) {
    let range = job.plan.chunk_range(c, cs);
    let len = (range.end - range.start) as usize;
    let buf = lease.as_mut_slice();
    for p in job.plan.pieces(range) {
        let dst = &mut buf[p.dst..p.dst + p.len];
        match p.source {
            PieceSource::Header { at } => {
                dst.copy_from_slice(&job.plan.header()[at as usize..at as usize + p.len])
            }
            PieceSource::Tensor { entry, at } => {
                let input = job.plan.entries()[entry].input;
                let b = job
                    .sources
                    .host(input)
                    .expect("host-only saves take this path");
                dst.copy_from_slice(&b[at as usize..at as usize + p.len]);
            }
        }
    }
    let write_len = (job.write_len)(len);
    buf[len..write_len].fill(0);
    (len, write_len)
}

/// Wall time during which at least one of several threads was waiting (the union of their
/// waits, not the sum: overlapping waits of parallel copy threads count once).
#[derive(Debug, Default)]
pub(crate) struct WaitClock {
    state: Mutex<(usize, Option<Instant>)>,
    total_ns: AtomicU64,
}

impl WaitClock {
    /// Run `f` (a blocking wait) and account for it.
    pub(crate) fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        {
            let mut s = lock(&self.state);
            if s.0 == 0 {
                s.1 = Some(Instant::now());
            }
            s.0 += 1;
        }
        let out = f();
        let mut s = lock(&self.state);
        s.0 -= 1;
        if s.0 == 0
            && let Some(t) = s.1.take()
        {
            self.total_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        out
    }

    /// Total so far (waits still in progress are not counted).
    pub(crate) fn total(&self) -> Duration {
        Duration::from_nanos(self.total_ns.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_waits_count_once() {
        let clock = WaitClock::default();
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| clock.time(|| std::thread::sleep(Duration::from_millis(100))));
            }
        });
        let wall = t.elapsed();
        let total = clock.total();
        // Four overlapping 100 ms waits: about 100 ms of blocked wall time, never 400 ms.
        assert!(total >= Duration::from_millis(100), "{total:?}");
        assert!(total <= wall, "{total:?} > wall {wall:?}");
    }

    #[test]
    fn chunks_take_their_turns_in_file_order() {
        // Three threads each taking every third chunk, the first slowed: the takes still
        // come in file order.
        let turn = Turn::default();
        let order = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for t in 0..3u64 {
                let (turn, order) = (&turn, &order);
                s.spawn(move || {
                    let leave = Leave { turn, early: true };
                    for c in (t..12).step_by(3) {
                        if t == 0 {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        turn.in_order(c, || lock(order).push(c)).unwrap();
                    }
                    leave.finished();
                });
            }
        });
        assert_eq!(*lock(&order), (0..12).collect::<Vec<u64>>());
    }

    #[test]
    fn a_thread_that_leaves_early_stops_the_others_waiting() {
        let turn = Turn::default();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| turn.in_order(1, || ()));
            std::thread::sleep(Duration::from_millis(20));
            // The thread of chunk 0 fails before its turn.
            drop(Leave {
                turn: &turn,
                early: true,
            });
            assert_eq!(waiter.join().unwrap(), None);
        });
    }

    #[test]
    fn disjoint_waits_add_up() {
        let clock = WaitClock::default();
        clock.time(|| std::thread::sleep(Duration::from_millis(20)));
        clock.time(|| std::thread::sleep(Duration::from_millis(30)));
        assert!(
            clock.total() >= Duration::from_millis(50),
            "{:?}",
            clock.total()
        );
    }
}
