//! The chaos soak (issue 38, item 4; docs/crash.md section 6): ~1,000 injected faults of
//! mixed classes against small deterministic states, 1 and 2 ranks, in about a minute.
//!
//! A trainer is a child process (this test binary re-executed, role `soak_trainer`): it
//! opens an [`Engine`] on its lane's root (recovery on open, the default), loads the latest
//! step and compares every byte with what that step's save held (the bytes are a pure
//! function of (step, rank, tensor): `crash::state`), then saves the following steps one
//! after another, printing a marker line at each stage (`SOAK OPENED`, `SOAK COMMITTED 7`...).
//! It dies by SIGKILL: from the parent at a random moment, or by itself at a named point
//! (during the open and its recovery, during the load, right after a save is staged, while
//! the writers drain it, once its commit has begun, right after it is reported committed).
//! Some incarnations also get write errors (EIO, ENOSPC) injected into random saves through
//! the fault plan: the save must fail with that errno and the step must not be listed. Two
//! ranks are two processes on one root, the job torn down together when one dies.
//!
//! Each kill lane is one machine: a mount namespace with a tmpfs of its own on `/dev/shm`,
//! kept alive by a holder process (`unshare --mount --propagation private`, as
//! `examples/replica_drill.py` makes them). The lane's trainers are started inside it, and
//! the parent's checks of their shared memory (the arenas a kill leaves, the tiered lane's
//! kept arena, the final opens that recover them, the end's leak check) enter it on a
//! thread of their own (`unshare(CLONE_FS)` + `setns`); every trainer is checked to run in
//! its lane's namespace right after its start. The disk (the lane's root), the bucket and
//! the replica lane's replicas are not on it: the replicas are on the partner's machine,
//! the parent's (the host's) namespace, which the replica lane's trainer enters for the
//! receiving side of a transfer and the serving side of a restore. Some kills lose the
//! machine: the trainers and the holder are killed, no task is left in the namespace
//! (checked), so its `/dev/shm` is gone whatever the names in it, and the next incarnation
//! runs on a fresh machine whose `/dev/shm` is empty (checked): recovery from the disk
//! alone. Where namespaces cannot be made (not root, no `unshare`), all lanes share the
//! host's `/dev/shm` and a machine loss removes the dead trainers' segments by name (the
//! summary says so; `SHMCKPT_REQUIRE_NS=1`, set by CI, makes it a failure).
//!
//! The ranks of one incarnation share a session
//! (`EngineConfig::with_session`), the next incarnation has another: a rank whose save
//! finds its step committed by the other rank with the durable part a dead incarnation of
//! this one left (which the partial-part rule keeps for a recovery) is a violation.
//!
//! Checked after every fault: each process died by SIGKILL (a child that finds a wrong
//! byte, an untyped failure or a listed failed step exits with a message instead); right
//! after the kill the newest committed directory holds exactly its step's bytes, and is at
//! least the newest step any trainer reported committed (0 committed steps lost); the next
//! trainer's `latest` is too, and its load equals the deterministic bytes exactly; no
//! step whose save failed is ever listed; every listed step (not only the newest) holds
//! exactly its bytes. At the end every rank's engine is opened once
//! more, every listed step is verified, no segment of ours is left in `/dev/shm` (the
//! host's), and every machine's `/dev/shm` is empty.
//!
//! A third lane is tiered: one rank with a disk cadence (every third save to disk, the
//! others memory-only) and flash restore in half of its incarnations. There a memory-only
//! step reported staged must survive any kill but a machine loss: the next incarnation's
//! `latest` is at least the newest step reported staged (recovery at open commits it, and
//! with flash restore serves it from the kept arena), and its bytes are exact.
//!
//! A fourth lane is the bucket lane: every committed save uploaded to a bucket in a local
//! directory (`object_store`'s `LocalFileSystem`, which outlives the killed trainers), some
//! kills aimed at an upload in flight. After every fault the bucket's newest committed step
//! is at least the newest one a trainer reported uploaded, and every listed step loads
//! through the remote tier with exactly its bytes.
//!
//! A fifth lane is the replica lane: every committed save replicated into a replica arena in
//! `/dev/shm` piece by piece (the crate's sender and receiver, the trainer as transport),
//! kills aimed at a piece of the transfer or either side of the seal; its machine losses
//! also take the rank's file of the newest replicated step (a node-local disk), which the
//! next incarnation restores from the replica at open (kills aimed at that restore too).
//! After every fault every replica of a listed step loads with exactly its file's bytes,
//! the newest is at least the newest step reported replicated, and no temporary file is
//! left beside a file in place; at the end no replica or temporary file is left.
//!
//! In the same run: power cuts (the crash states of `crash.rs`, drawn at random from a
//! recording of 1- and 2-rank saves), real power cuts through crashfs (a one-rank engine
//! in this process saving on a FUSE mount, on a machine of its own, the power cut at a
//! random mutating request; the durable state mounted again on a fresh machine and
//! checked, and the next incarnation goes on from it; skipped visibly without FUSE,
//! a failure under `SHMCKPT_REQUIRE_FUSE=1`) and bucket faults (`remote_crash.rs`'s
//! crashing in-memory store, at a random request).
//!
//! `SHMCKPT_SOAK_SEED` replays a seed (printed first; default: a new one per run; the
//! kills' timing is not replayable exactly, the choices are), `SHMCKPT_SOAK_FAULTS` sets
//! the number of faults (default 1,000), `SHMCKPT_SOAK_WORLDS` the kill lanes (default
//! `1,2,1t,1b,1r`: world sizes, `t` for the tiered lane, `b` for the bucket lane, `r` for
//! the replica lane). Run by its own stage of scripts/test.sh:
//! `cargo test --all-features --test integration soak -- --ignored --nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use shmckpt::manifest::{partial_dir_name, step_dir_name};
use shmckpt::testing::io::OpKind;
use shmckpt::testing::io::fault::{Fault, FaultPlan, Rule};
use shmckpt::testing::staging::NAME_PREFIX;
use shmckpt::{BackendKind, DiskCadence, Engine, EngineConfig, LoadSource, Metadata, StepSel};

use crate::common::{Role, child_command_of, current_test, real_dir, run_role, sigkill_self};
use crate::crash;

/// Faults per run unless `SHMCKPT_SOAK_FAULTS` says otherwise.
const DEFAULT_FAULTS: u64 = 1000;
/// Retention of every trainer: the kills also land in retention's renames and deletes.
const KEEP: usize = 3;
/// Chunk size: a rank file (~70 KiB) is two chunks.
const CHUNK: u64 = 64 << 10;
/// A trainer or job still alive this long after its start is hung: a violation.
const HANG: Duration = Duration::from_secs(30);

// ---- Machines: mount namespaces, each with a `/dev/shm` of its own ----

/// Move the calling thread into the mount namespace `ns` (an open `/proc/PID/ns/mnt`).
/// A thread shares its root and working directory with the process's other threads, and
/// `setns` refuses to move a thread whose are shared: the thread gets copies of its own
/// first (`unshare(CLONE_FS)`). Only for a thread made for it ([`in_ns`]).
fn enter_mnt_ns(ns: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `unshare(CLONE_FS)` and `setns(fd, CLONE_NEWNS)` take no pointers: the first
    // gives the calling thread its own copy of its root, working directory and umask, the
    // second moves it (and the threads it makes later) into the mount namespace of `ns`,
    // an open descriptor borrowed for the call. No other thread's state changes, and no
    // memory of this process is touched; the only caller is a thread made for it.
    #[allow(unsafe_code)]
    let r = unsafe {
        if libc::unshare(libc::CLONE_FS) != 0 {
            -1
        } else {
            libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS)
        }
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Run `f` inside the mount namespace `ns` (on a thread of its own that enters it; the
/// processes and threads `f` starts are in it too), or here when `ns` is `None`.
fn in_ns<R: Send>(ns: Option<&std::fs::File>, f: impl FnOnce() -> R + Send) -> Result<R, String> {
    let Some(ns) = ns else { return Ok(f()) };
    std::thread::scope(|s| {
        s.spawn(|| {
            enter_mnt_ns(ns).map_err(|e| format!("entering a mount namespace (setns): {e}"))?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// The names in `/dev/shm` of the calling thread's mount namespace.
fn shm_names() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A machine of a kill lane: a mount namespace with a tmpfs of its own on `/dev/shm`,
/// kept alive by a holder process (`unshare --mount --propagation private`, as
/// `examples/replica_drill.py`'s `Machine` makes them). The lane's trainers are started
/// inside it and the parent's checks of their shared memory enter it ([`in_ns`]). A
/// machine loss kills the holder: with the trainers dead, nothing holds the namespace any
/// more and its `/dev/shm` goes, whatever the names in it.
struct Machine {
    holder: Child,
    /// `/proc/<holder>/ns/mnt`, open.
    ns: Arc<std::fs::File>,
    /// The namespace as `readlink /proc/PID/ns/mnt` names it (`mnt:[4026532...]`).
    id: String,
}

impl Machine {
    /// Start a machine; an error when mount namespaces cannot be made here (not root, no
    /// `unshare`), or its `/dev/shm` is not a fresh, empty tmpfs of its own.
    fn start() -> Result<Machine, String> {
        // The holder waits on its stdin: it also ends when this process dies.
        let mut holder = std::process::Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                "mount -t tmpfs -o size=256m tmpfs /dev/shm && echo ready && read x",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("`unshare` cannot be run: {e}"))?;
        let mut line = String::new();
        let out = holder.stdout.take().expect("piped");
        let _ = std::io::BufReader::new(out).read_line(&mut line);
        if line.trim() != "ready" {
            let _ = holder.kill();
            let _ = holder.wait();
            let mut err = String::new();
            if let Some(mut e) = holder.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return Err(format!(
                "`unshare --mount` and a tmpfs on /dev/shm: {:?} {}",
                line.trim(),
                err.trim()
            ));
        }
        let pid = holder.id();
        let m = Machine {
            ns: Arc::new(
                std::fs::File::open(format!("/proc/{pid}/ns/mnt"))
                    .map_err(|e| format!("/proc/{pid}/ns/mnt: {e}"))?,
            ),
            id: ns_of(pid).map_err(|e| format!("/proc/{pid}/ns/mnt: {e}"))?,
            holder,
        };
        // Its own tmpfs (not the host's `/dev/shm`), empty, seen from inside.
        use std::os::unix::fs::MetadataExt;
        let host = std::fs::metadata("/dev/shm")
            .map_err(|e| e.to_string())?
            .dev();
        let (dev, names) = in_ns(Some(&m.ns), || {
            (std::fs::metadata("/dev/shm").map(|m| m.dev()), shm_names())
        })?;
        let dev = dev.map_err(|e| format!("the machine's /dev/shm: {e}"))?;
        if dev == host {
            return Err("the machine's /dev/shm is the host's".into());
        }
        if !names.is_empty() {
            return Err(format!("a new machine's /dev/shm is not empty: {names:?}"));
        }
        Ok(m)
    }

    /// The machine is lost: its holder killed (its trainers are dead already).
    fn lose(mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// The mount namespace of process `pid` (`mnt:[...]`).
fn ns_of(pid: u32) -> std::io::Result<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/mnt")).map(|p| p.to_string_lossy().into_owned())
}

/// The tasks (`pid/tid`) of this machine that are still in the mount namespace `id`.
fn tasks_in_ns(id: &str) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return found;
    };
    for p in procs.flatten() {
        let pid = p.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(tasks) = std::fs::read_dir(p.path().join("task")) else {
            continue;
        };
        for t in tasks.flatten() {
            if std::fs::read_link(t.path().join("ns/mnt")).is_ok_and(|l| l.to_string_lossy() == id)
            {
                let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
                let cmd = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                found.push(format!(
                    "{pid}/{} ({}: {})",
                    t.file_name().to_string_lossy(),
                    comm.trim(),
                    cmd.trim()
                ));
            }
        }
    }
    found
}

// ---- The child: a trainer ----

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"))
}

/// One marker line on stdout, in one write (a kill leaves whole lines or nothing).
fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(format!("\nSOAK {line}\n").as_bytes());
    let _ = out.flush();
}

/// A marker that ends the trainer: something it checked is wrong.
fn fail(line: &str) -> ! {
    emit(&format!("VIOLATION {line}"));
    std::process::exit(3);
}

fn read_line() -> String {
    let mut s = String::new();
    if std::io::stdin().read_line(&mut s).unwrap_or(0) == 0 {
        // The parent is gone: nothing to wait for.
        std::process::exit(5);
    }
    s.trim().to_owned()
}

/// SIGKILL this process after `us` microseconds, from a thread of its own.
/// The step of the newest `STAGED` slot of `root`'s kept arena of `rank`, when some of its
/// chunks are `WRITTEN` (read before the open, which may read them back into the arena).
fn newest_staged_partly_written(root: &Path, rank: u32) -> Option<u64> {
    use shmckpt::testing::staging::descriptor::{chunk_state, slot_state};
    let canon = std::fs::canonicalize(root).ok()?;
    let name = shmckpt::testing::staging::kept_name(&canon, rank);
    let att = shmckpt::testing::staging::AttachedArena::open(&name).ok()?;
    let newest = (0..att.slot_count())
        .map(|s| att.slot(s))
        .filter(|v| v.state == slot_state::STAGED)
        .max_by_key(|v| v.step)?;
    newest
        .chunks
        .iter()
        .any(|c| c.0 == chunk_state::WRITTEN)
        .then_some(newest.step)
}

fn kill_after(us: u64) {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_micros(us));
        sigkill_self();
    });
}

/// SIGKILL this process as soon as step `step`'s commit has begun: a manifest (a part or
/// the merged one, or its temporary) in its partial directory, or the directory renamed.
fn kill_at_commit(root: PathBuf, step: u64) {
    std::thread::spawn(move || {
        let partial = root.join(partial_dir_name(step));
        let done = root.join(step_dir_name(step));
        let t = Instant::now();
        loop {
            let manifest = std::fs::read_dir(&partial).is_ok_and(|rd| {
                rd.flatten()
                    .any(|e| e.file_name().to_string_lossy().contains("manifest.json"))
            });
            if manifest || done.exists() || t.elapsed() > Duration::from_secs(5) {
                sigkill_self();
            }
            std::thread::yield_now();
        }
    });
}

fn splitmix(rng: &mut u64) -> u64 {
    *rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
    shmckpt_bench::synthetic::splitmix64(*rng)
}

fn trainer_config(root: &Path, rank: u32, world: u32, backend: BackendKind) -> EngineConfig {
    EngineConfig::new(root)
        .with_backend(backend)
        .with_staging_capacity(8 * CHUNK)
        .with_chunk_size(CHUNK)
        .with_queue_depth(4)
        .with_writer_threads(1)
        .with_copy_threads(1)
        .with_max_inflight_saves(2)
        .with_rank(rank, world)
        .with_keep_last(Some(KEEP))
}

/// The bucket lane's bucket: `dir` through `object_store`'s local-directory store (every
/// trainer and the parent's checks see the same objects), keys under `soak/`, retention
/// [`KEEP`] steps there too.
fn with_bucket(config: EngineConfig, dir: &Path) -> EngineConfig {
    config
        .with_remote_store(bucket_store(dir), "soak")
        .with_remote_keep_last(Some(KEEP))
}

fn bucket_store(dir: &Path) -> Arc<dyn object_store::ObjectStore> {
    Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap())
}

/// The bucket lane, after the local commit of `step`: wait for its upload (`UPLOADING`
/// while it runs) and report it (`UPLOADED`); with `kill`, die `delay` us into the wait (an
/// upload over before the wait began, or before the kill, misses its point). A failed
/// upload is a violation: no fault is injected into the bucket.
fn wait_upload(p: &shmckpt::remote::RemoteProgress, step: u64, kill: bool, delay: u64) {
    if !p.is_done() {
        emit(&format!("UPLOADING {step}"));
        if kill {
            kill_after(delay);
        }
    }
    match p.wait() {
        Ok(_) => emit(&format!("UPLOADED {step}")),
        Err(e) => fail(&format!("step {step}: the upload failed: {e}")),
    }
}

/// Bytes per piece of a replica transfer: a rank file (~70 KiB) is about five pieces.
const PIECE: usize = 16 << 10;

/// Copy `out`'s bytes into `inc` piece by piece, as the transport does (each piece read,
/// copied, then reported received), and seal it; with `stop_at`, die after that many
/// pieces (`pieces`: right before the seal, `pieces + 1`: right after it).
fn transfer(
    mut read: impl FnMut(usize, usize) -> shmckpt::Result<()>,
    src: *const u8,
    inc: &mut shmckpt::replica::Incoming,
    stop_at: Option<usize>,
) -> shmckpt::Result<PathBuf> {
    let len = inc.len();
    let pieces = len.div_ceil(PIECE);
    for i in 0..pieces {
        if stop_at == Some(i) {
            sigkill_self();
        }
        let (a, b) = (i * PIECE, ((i + 1) * PIECE).min(len));
        read(a, b)?;
        // SAFETY: `src` holds `len` readable bytes, `[a, b)` read above; the image's memory
        // is `len` bytes, writable below what `received` froze (`a` and beyond).
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(a), inc.as_mut_ptr().add(a), b - a)
        };
        inc.received(b)?;
    }
    if stop_at == Some(pieces) {
        sigkill_self();
    }
    let sealed = inc.seal()?;
    if stop_at == Some(pieces + 1) {
        sigkill_self();
    }
    Ok(sealed)
}

/// The replica lane, after the commit of `step`: replicate the rank's file into a replica
/// arena in `/dev/shm` (the partner's, on another machine; here the same process is the
/// transport), `REPLICATING` while it runs, `REPLICATED` once sealed. With `stop`, die at
/// that piece (see [`transfer`]).
fn replicate(root: &Path, step: u64, stop: Option<usize>) {
    use shmckpt::replica::{Incoming, Outgoing};
    emit(&format!("REPLICATING {step}"));
    let r = (|| {
        let mut out = Outgoing::open(root, step, 0)?;
        let mut inc = Incoming::replica(root, step, 0)?;
        let src = out.as_ptr();
        transfer(|a, b| out.read_range(a, b), src, &mut inc, stop)
    })();
    match r {
        Ok(_) => emit(&format!("REPLICATED {step}")),
        Err(e) => fail(&format!("step {step}: replication failed: {e}")),
    }
}

/// The one-rank replica lane's file of committed `step`.
fn rank_file(root: &Path, step: u64) -> PathBuf {
    root.join(step_dir_name(step))
        .join(shmckpt::manifest::rank_file_name(0, 1))
}

/// The replica lane after a machine loss took the rank's files: every committed step whose
/// rank file is missing is restored from the replica (served, checked in place, received
/// piece by piece, checked again and written back as the file), `RESTORING` while it runs,
/// `RESTORED` once written. With `stop`, die at that piece of the first restore. An error
/// when a missing file has no replica that restores it.
fn repair(root: &Path, stop: Option<usize>, say: bool) -> Result<Vec<u64>, String> {
    use shmckpt::replica::Incoming;
    let mut restored = Vec::new();
    for step in crash::listed(root)? {
        if rank_file(root, step).exists() {
            continue;
        }
        if say {
            emit(&format!("RESTORING {step}"));
        }
        let r = (|| {
            let served = Incoming::serve(root, step, 0)?;
            let mut inc = Incoming::restore(root, step, 0)?;
            let src = served.as_mut_ptr().cast_const();
            transfer(|_, _| Ok(()), src, &mut inc, stop)
        })();
        r.map_err(|e| format!("step {step}: its file is lost and no replica restores it: {e}"))?;
        if say {
            emit(&format!("RESTORED {step}"));
        }
        restored.push(step);
    }
    Ok(restored)
}

/// The trainer (a child process, in its lane's machine). Environment: `SOAK_ROOT`, `SOAK_RANK`, `SOAK_WORLD`,
/// `SOAK_POINT` (where it kills itself: `none`, `open`, `load`, `staged`, `drain`,
/// `commit`, `committed`, `upload`, `replicate`, `restore`), `SOAK_AT` (which save of this
/// incarnation, from 1), `SOAK_DELAY_US` (for `open`, `load`, `drain`, `upload`; the piece
/// for `replicate` and `restore`), `SOAK_IOERR` (per mille of saves that get a write
/// error), `SOAK_SLOW_US` (delay of every write), `SOAK_BACKEND`, `SOAK_SEED`,
/// `SOAK_CADENCE`/`SOAK_KEEP` (tiered lane), `SOAK_BUCKET` (bucket lane), `SOAK_REPLICA`
/// (replica lane), `SOAK_PARTNER_NS` (the replica lane's partner machine: a
/// `/proc/PID/ns/mnt`, empty when the machines are simulated).
fn child_trainer() {
    let root = PathBuf::from(var("SOAK_ROOT"));
    let rank: u32 = var("SOAK_RANK").parse().unwrap();
    let world: u32 = var("SOAK_WORLD").parse().unwrap();
    let point = var("SOAK_POINT");
    let at: u64 = var("SOAK_AT").parse().unwrap();
    let delay: u64 = var("SOAK_DELAY_US").parse().unwrap();
    let ioerr: u64 = var("SOAK_IOERR").parse().unwrap();
    let slow: u64 = var("SOAK_SLOW_US").parse().unwrap();
    let mut rng: u64 = var("SOAK_SEED").parse().unwrap();
    let backend = match var("SOAK_BACKEND").as_str() {
        "uring" => BackendKind::IoUring,
        _ => BackendKind::Pwrite,
    };
    // The tiered lane: every `SOAK_CADENCE`-th save to disk (the others memory-only), and
    // flash restore when `SOAK_KEEP` is 1.
    let cadence: u64 = var("SOAK_CADENCE").parse().unwrap();
    let keep = var("SOAK_KEEP") == "1";
    // The bucket lane: every committed save uploaded to a bucket in a local directory.
    let bucket = var("SOAK_BUCKET");
    // The replica lane: every committed save replicated; lost files restored at open.
    let replica = var("SOAK_REPLICA") == "1";
    // The partner's machine, where the replicas live (the parent's mount namespace), when
    // this trainer's machine is a namespace of its own: the transfers' receiving side and
    // the restores' serving side run there (`in_ns`).
    let partner = match var("SOAK_PARTNER_NS").as_str() {
        "" => None,
        p => match std::fs::File::open(p) {
            Ok(f) => Some(f),
            Err(e) => fail(&format!("the partner's namespace {p}: {e}")),
        },
    };
    let partner = partner.as_ref();
    let slow_rule = Rule {
        kind: OpKind::Write,
        offsets: 0..u64::MAX,
        fault: Fault::Delay(Duration::from_micros(slow)),
        times: None,
    };
    let plan = Arc::new(FaultPlan::new());
    plan.add(slow_rule.clone());

    emit("OPENING");
    if point == "open" {
        kill_after(delay);
    }
    // The job's session: every rank of this incarnation shares it, the next one has
    // another, so no save of this incarnation commits with a dead one's part.
    let session = std::env::var("SOAK_SESSION").unwrap();
    let mut config = trainer_config(&root, rank, world, backend)
        .with_faults(Arc::clone(&plan))
        .with_session(Some(session.clone()));
    if cadence > 1 {
        config = config
            .with_disk_cadence(DiskCadence::Every(cadence))
            .with_keep_in_memory(keep);
    }
    if !bucket.is_empty() {
        config = with_bucket(config, Path::new(&bucket));
    }
    // The tiered lane with flash restore: the newest staged save of the dead trainer's kept
    // arena when some of its chunks were written to its file already (a disk save killed
    // while draining), which the open reads back and holds in memory.
    let partly = if keep && cadence > 1 {
        newest_staged_partly_written(&root, rank)
    } else {
        None
    };
    let engine = match Engine::open(config) {
        Ok(e) => e,
        Err(e) => fail(&format!("Engine::open: {e}")),
    };
    // The step the open took over from the dead engine's kept arena and holds in memory
    // (not durable: a machine loss takes it).
    let held: Vec<u64> = engine
        .recovered()
        .iter()
        .flat_map(shmckpt::recover::RecoveryReport::adopted_steps)
        .collect();
    // And the older saves it recovers on a thread behind the open.
    let behind: Vec<u64> = engine
        .recovered()
        .iter()
        .flat_map(|r| r.slots.iter())
        .filter(|s| matches!(s.outcome, shmckpt::recover::SlotOutcome::Behind))
        .map(|s| s.step)
        .collect();
    let partly: Vec<u64> = partly.into_iter().collect();
    emit(&format!(
        "OPENED {:?} held {held:?} behind {behind:?} partly {partly:?}",
        engine.recovered_steps()
    ));
    if replica {
        let stop = (point == "restore").then_some(delay as usize);
        if let Err(e) = in_ns(partner, || repair(&root, stop, true)).and_then(|r| r) {
            fail(&e);
        }
    }
    if world > 1 {
        // Every rank has opened (and recovered) before any looks at `latest`.
        assert_eq!(read_line(), "go");
    }
    let latest = match engine.latest() {
        Ok(l) => l,
        Err(e) => fail(&format!("latest: {e}")),
    };
    emit(&format!("LATEST {}", latest.map_or(-1, |l| l as i64)));
    if point == "load" {
        kill_after(delay);
    }
    if let Some(l) = latest {
        let source = match engine.load_with(&StepSel::Step(l).into(), shmckpt::LoadInto::owned()) {
            Ok(got) => {
                let ck = got.checkpoint.expect("an owned load has a checkpoint");
                if let Err(why) = crash::same(&ck, l, rank) {
                    fail(&format!("WRONG BYTES {why}"));
                }
                got.report.source
            }
            Err(e) => fail(&format!("load({l}) of the latest step: {e}")),
        };
        let source = if source == LoadSource::Memory {
            "memory"
        } else {
            "disk"
        };
        emit(&format!("VERIFIED {l} {source}"));
    }
    // Where the job goes on: agreed by every rank (the parent takes the newest `latest`).
    let start: u64 = if world > 1 {
        let s = read_line();
        s.strip_prefix("start ").unwrap().parse().unwrap()
    } else {
        latest.map_or(1, |l| l + 1)
    };
    for (n, step) in (start..).enumerate() {
        let n = n as u64 + 1;
        let target = n == at;
        // A write error in this save? Never in the save a named point waits for.
        let inject = !target && splitmix(&mut rng) % 1000 < ioerr;
        let errno = if splitmix(&mut rng).is_multiple_of(2) {
            libc::EIO
        } else {
            libc::ENOSPC
        };
        let st = crash::state(step, rank);
        if inject {
            // The error alone, at an offset inside the file (the header is at least 4 KiB,
            // so the data's length is): `fired` then counts exactly it. The previous save
            // has finished (each is waited for), so it hits this one.
            plan.clear();
            let offset = splitmix(&mut rng) % st.bytes();
            plan.add(Rule {
                kind: OpKind::Write,
                offsets: offset..offset + 1,
                fault: Fault::Errno(errno),
                times: Some(1),
            });
        }
        let fired = plan.fired();
        // Another rank's durable part of this step that a dead incarnation left (the
        // partial-part rule keeps it; with nothing committed, no load withdrew it): this
        // save must not commit with it (sessions). Named in the marker, and counted.
        let dead_part = (0..world).filter(|&r| r != rank).any(|r| {
            let part = root
                .join(partial_dir_name(step))
                .join(shmckpt::manifest::rank_manifest_name(r));
            std::fs::read(&part)
                .ok()
                .and_then(|b| serde_json::from_slice::<shmckpt::manifest::FileEntry>(&b).ok())
                .is_some_and(|e| e.session.as_deref() != Some(session.as_str()))
        });
        if dead_part {
            emit(&format!("SAVING {step} beside-a-dead-part"));
        } else {
            emit(&format!("SAVING {step}"));
        }
        let h = engine.save(step, &st.tensors(), &Metadata::new());
        let mut upload = None;
        let res = match h {
            Ok(h) => {
                emit(&format!("STAGED {step}"));
                if target {
                    match point.as_str() {
                        "staged" => sigkill_self(),
                        "drain" => kill_after(delay),
                        "commit" => kill_at_commit(root.clone(), step),
                        _ => {}
                    }
                }
                upload = h.remote();
                h.wait()
            }
            Err(e) => Err(e),
        };
        let hit = plan.fired() > fired;
        match res {
            Ok(r) if inject && hit => fail(&format!(
                "step {step}: a write failed with errno {errno} and the save reported success ({:?})",
                r.dir
            )),
            Ok(r) => {
                if r.memory_only {
                    // Staged, held in the arena: recovery must find it after a kill.
                    emit(&format!("MEMORY {step}"));
                } else if r.dir.is_some() {
                    emit(&format!("COMMITTED {step}"));
                    if target && point == "committed" {
                        sigkill_self(); // before the upload's wait: the upload is in flight
                    }
                    if let Some(p) = upload.as_ref().filter(|_| !bucket.is_empty()) {
                        wait_upload(p, step, target && point == "upload", delay);
                    }
                    if replica {
                        let stop = (target && point == "replicate").then_some(delay as usize);
                        if let Err(e) = in_ns(partner, || replicate(&root, step, stop)) {
                            fail(&e);
                        }
                    }
                } else if world == 1 {
                    fail(&format!(
                        "step {step}: a one-rank save succeeded and committed nothing"
                    ));
                } else {
                    // The other rank's part is missing (it failed this save, or died).
                    emit(&format!("PART {step}"));
                }
                if target && point == "committed" {
                    sigkill_self();
                }
            }
            Err(e) if inject && hit => {
                if e.raw_os_error() != Some(errno) {
                    fail(&format!(
                        "step {step}: injected errno {errno}, the save failed with {e:?}"
                    ));
                }
                match engine.list() {
                    Ok(l) if l.iter().any(|c| c.step == step) => {
                        fail(&format!("step {step} failed ({e}) and is listed"))
                    }
                    Ok(_) => {}
                    Err(le) => fail(&format!("list after a failed save: {le}")),
                }
                emit(&format!("IOERR {step} {errno}"));
            }
            // Two ranks: the other rank committed this step with the durable part a dead
            // incarnation of this rank left (the partial-part rule keeps it for a
            // recovery). Sessions make that impossible: a violation.
            Err(e @ shmckpt::Error::StepExists { .. }) if world > 1 => fail(&format!(
                "step {step}: committed by the other rank with this rank's part of a dead incarnation (another session): {e}"
            )),
            Err(e) => fail(&format!(
                "step {step}: the save failed with no fault injected: {e}"
            )),
        }
        if inject {
            plan.clear();
            plan.add(slow_rule.clone());
        }
    }
}

// ---- The parent: lanes of trainers ----

/// What a fault was, for the counts table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    KillRandom,
    KillOpen,
    KillLoad,
    KillStaged,
    KillDrain,
    KillCommit,
    KillCommitted,
    KillUpload,
    KillReplicate,
    KillRestore,
    MachineLoss,
    IoError,
    PowerCut,
    PowerCutFs,
    Bucket,
}

impl Class {
    fn label(self) -> &'static str {
        match self {
            Class::KillRandom => "SIGKILL at a random time (parent)",
            Class::KillOpen => "SIGKILL during open/recovery",
            Class::KillLoad => "SIGKILL during load",
            Class::KillStaged => "SIGKILL right after staging",
            Class::KillDrain => "SIGKILL while the writers drain",
            Class::KillCommit => "SIGKILL during commit/rename",
            Class::KillCommitted => "SIGKILL right after commit (retention)",
            Class::KillUpload => "SIGKILL during upload (bucket lane)",
            Class::KillReplicate => "SIGKILL during replication (replica lane)",
            Class::KillRestore => "SIGKILL during a restore from a replica (replica lane)",
            Class::MachineLoss => "machine loss (kill + /dev/shm gone)",
            Class::IoError => "write error EIO/ENOSPC (fault plan)",
            Class::PowerCut => "power cut (crashsim state)",
            Class::PowerCutFs => "power cut (crashfs)",
            Class::Bucket => "bucket crash (in-memory store)",
        }
    }

    /// The named point of a self-kill.
    fn point(self) -> &'static str {
        match self {
            Class::KillOpen => "open",
            Class::KillLoad => "load",
            Class::KillStaged => "staged",
            Class::KillDrain => "drain",
            Class::KillCommit => "commit",
            Class::KillCommitted => "committed",
            Class::KillUpload => "upload",
            Class::KillReplicate => "replicate",
            Class::KillRestore => "restore",
            _ => "none",
        }
    }
}

/// Counts shared by the lanes and the in-process classes.
#[derive(Default)]
struct Tally {
    faults: BTreeMap<Class, u64>,
    /// Where self-kills aimed at a point landed elsewhere (counted as random).
    missed: BTreeMap<Class, u64>,
    processes_killed: u64,
    resumes_verified: u64,
    steps_committed: u64,
    opens_with_arena: u64,
    /// Saves of a step whose partial directory held another rank's part of a dead
    /// incarnation (another session): never committed with it.
    beside_dead_part: u64,
    /// The tiered lane: memory-only saves reported staged, resumes at a step no trainer
    /// had reported committed (a memory-only step recovered after the kill), and resumes
    /// served from memory (flash restore of the kept arena).
    memory_saves: u64,
    memory_resumes: u64,
    flash_resumes: u64,
    /// The tiered lane: opens that took the dead trainer's memory-only step over in
    /// memory (flash restore, the same session) instead of committing it.
    held_opens: u64,
    /// ... and older saves of the dead trainer those opens recovered behind them.
    behind_saves: u64,
    /// Opens that found the dead trainer's newest staged save partly written to its file
    /// (a disk save killed while draining) ...
    partly_opens: u64,
    /// ... and held it in memory (its written chunks read back).
    partly_held: u64,
    /// The bucket lane: uploads reported committed in the bucket.
    uploads: u64,
    /// The replica lane: replicas reported sealed, machine losses that took the rank's
    /// file of the newest replicated step, files restored from a replica.
    replications: u64,
    files_lost: u64,
    restores: u64,
    /// Where the parent's random kills found the trainers (their last marker).
    landed: BTreeMap<&'static str, u64>,
    /// Every process started (their segments must be gone at the end).
    pids: BTreeSet<u32>,
    /// Machines as mount namespaces: trainers found running in their lane's namespace
    /// (`/proc/PID/ns/mnt` read right after the start; one that died first is not read),
    /// machines lost (holder killed, a fresh one started with an empty `/dev/shm`), and
    /// machines found empty at the end of their lane.
    ns_checked: u64,
    machines_lost: u64,
    machines_empty_at_end: u64,
    /// The crashfs power cuts: those that fired at their mutating request (the others cut
    /// on command once the incarnation's saves were done), requests per incarnation (the
    /// most seen), saves reported committed before the cuts, resumes checked after them.
    fs_fired: u64,
    fs_requests: u64,
    fs_reported: u64,
    fs_resumes: u64,
    /// Why the crashfs cuts did not run (no FUSE), when they did not.
    fs_skipped: Option<String>,
    violations: Vec<String>,
}

struct Soak {
    seed: u64,
    /// Why the machines are simulated (no mount namespaces here); `None`: namespaces.
    simulated: Option<String>,
    target: u64,
    total: AtomicU64,
    stop: AtomicBool,
    tally: Mutex<Tally>,
}

impl Soak {
    fn add(&self, class: Class, n: u64) {
        self.total.fetch_add(n, Ordering::Relaxed);
        *self.tally.lock().unwrap().faults.entry(class).or_default() += n;
    }

    fn violation(&self, msg: String) {
        eprintln!("SOAK VIOLATION (seed {}): {msg}", self.seed);
        self.tally.lock().unwrap().violations.push(msg);
        self.stop.store(true, Ordering::Relaxed);
    }

    fn done(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.total.load(Ordering::Relaxed) >= self.target
    }
}

enum Ev {
    Line(u32, String),
    Eof(u32),
}

struct Kid {
    child: Child,
    stdin: Option<ChildStdin>,
    pid: u32,
    markers: Vec<String>,
    dead: Option<std::process::ExitStatus>,
    eof: bool,
}

/// A trial that ends early (a violation) kills and reaps the trainers it leaves running.
impl Drop for Kid {
    fn drop(&mut self) {
        if self.dead.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One lane: a root, a world size, trials one after another.
struct Lane {
    id: usize,
    world: u32,
    root: PathBuf,
    /// Newest step some trainer reported committed.
    hwm: Option<u64>,
    /// The tiered lane (a disk cadence, memory-only saves, flash restore in some
    /// incarnations): the newest step some trainer reported staged or committed, which
    /// the next incarnation must resume at or after unless the machine was lost.
    tiered: bool,
    mem_hwm: Option<u64>,
    /// The step the current incarnation's open took over in memory, not durable (the
    /// tiered lane with flash restore and the same session: `SlotOutcome::Adopted`).
    held: Option<u64>,
    /// The bucket lane: its bucket's directory (every committed save uploaded there), and
    /// the newest step some trainer reported uploaded (committed in the bucket).
    bucket: Option<PathBuf>,
    up_hwm: Option<u64>,
    /// The replica lane: every committed save replicated; the newest step some trainer
    /// reported replicated, and the step whose rank file a machine loss took (restored
    /// from its replica by the next open).
    replica: bool,
    rep_hwm: Option<u64>,
    lost: Option<u64>,
    /// Steps whose save failed, never re-saved since.
    failed: BTreeSet<u64>,
    /// Every process this lane started (their segments must be gone at the end).
    pids: Vec<u32>,
    /// The lane's machine: a mount namespace with a `/dev/shm` of its own, where its
    /// trainers run (`None`: simulated, every lane in the host's `/dev/shm`).
    machine: Option<Machine>,
    /// The working directory the trainers start in (entering a namespace moves a thread's
    /// to its root).
    cwd: PathBuf,
    rng: u64,
    trial: u64,
    stderr: PathBuf,
    /// The libtest name of the soak (its trainers re-run the binary with it).
    test: String,
}

/// What a kill lane runs besides its ranks' disk saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaneKind {
    /// Every save to disk.
    Plain,
    /// A disk cadence: memory-only saves between disk saves, flash restore in some
    /// incarnations (`t`).
    Tiered,
    /// Every committed save uploaded to a bucket in a local directory (`b`).
    Bucket,
    /// Every committed save replicated; machine losses take the rank's files (`r`).
    Replica,
}

fn rand(rng: &mut u64, n: u64) -> u64 {
    splitmix(rng) % n.max(1)
}

/// Our segments in `/dev/shm`: named `shmckpt.<pid>.` after a process of `pids`.
///
/// Pids are reused, and other processes' segments may carry a trainer's pid: a trainer
/// opens one engine, so its arena is `shmckpt.<pid>.r<rank>.0` and records a lane's root
/// (one soak failed on `shmckpt.4286.r0.9115`, the 9,116th engine of another test process
/// that had reused a dead trainer's pid; another on `shmckpt.30600.r0.0` of root
/// `/tmp/tmpspv2ygug`, left in `/dev/shm` by a process that died before the soak began).
/// So a segment is a trainer's when it was not there when the soak began, its counter is
/// 0 and its root is a lane's (or its descriptor cannot be read: a trainer killed while
/// creating it). This process's own segments count whatever their counter and root.
fn our_segments(pids: &BTreeSet<u32>) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    let me = std::process::id();
    let before = BEFORE.get();
    let roots = LANE_ROOTS.lock().unwrap().clone();
    rd.flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            let mut parts = n.strip_prefix(NAME_PREFIX).unwrap_or("").split('.');
            let pid = parts.next().and_then(|p| p.parse::<u32>().ok());
            let counter = parts.nth(1);
            let Some(p) = pid.filter(|p| pids.contains(p)) else {
                return false;
            };
            if p == me {
                return true;
            }
            if counter != Some("0") || before.is_some_and(|b| b.contains(n)) {
                return false;
            }
            match shmckpt::recover::inspect_arena(n).details {
                Ok(d) => roots.iter().any(|r| d.root.starts_with(r)),
                Err(_) => true,
            }
        })
        .collect()
}

/// The `shmckpt.*` segments in `/dev/shm` when the soak began (never ours).
static BEFORE: OnceLock<BTreeSet<String>> = OnceLock::new();
/// Every lane's root, canonical and as given (the trainers' arenas record one of them).
static LANE_ROOTS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn prefixed_segments() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(NAME_PREFIX))
                .collect()
        })
        .unwrap_or_default()
}

/// The phase a trainer was in when it died, from its last marker.
fn phase(markers: &[String]) -> &'static str {
    match markers.last().map(|m| m.split(' ').next().unwrap_or("")) {
        None => "start",
        Some("OPENING") => "open",
        Some("OPENED") => "barrier",
        Some("LATEST") => "load",
        Some("VERIFIED") => "before saving",
        Some("SAVING") => "staging",
        Some("STAGED") => "drain/commit",
        Some("UPLOADING") => "upload",
        Some("REPLICATING") => "replication",
        Some("RESTORING") => "restore",
        Some("RESTORED") => "barrier",
        Some("REPLICATED") => "between saves",
        Some("COMMITTED") | Some("PART") | Some("IOERR") | Some("MEMORY") | Some("UPLOADED") => {
            "between saves"
        }
        Some(_) => "other",
    }
}

/// Whether a self-kill at `class`'s point landed there, judged from the last marker.
fn landed(class: Class, markers: &[String], at_step: Option<u64>) -> bool {
    let last = markers.last().map(String::as_str).unwrap_or("");
    let step_is = |tag: &str| at_step.is_some_and(|s| last == format!("{tag} {s}"));
    match class {
        Class::KillOpen => last == "OPENING",
        Class::KillLoad => last.starts_with("LATEST") && !last.ends_with("-1"),
        Class::KillStaged | Class::KillDrain | Class::KillCommit => step_is("STAGED"),
        Class::KillCommitted => step_is("COMMITTED"),
        Class::KillUpload => step_is("UPLOADING"),
        Class::KillReplicate => step_is("REPLICATING"),
        Class::KillRestore => last.starts_with("RESTORING "),
        _ => true,
    }
}

impl Lane {
    /// The kept arena of this lane's root (rank 0; the tiered lane has one rank), in the
    /// `/dev/shm` of the calling thread's namespace (the lane's machine: [`Lane::ns`]).
    fn kept_arena(&self) -> PathBuf {
        Path::new("/dev/shm").join(crate::common::kept_arena_name(&self.root))
    }

    /// The lane's machine's mount namespace, for [`in_ns`] (`None`: simulated machines,
    /// the host's).
    fn ns(&self) -> Option<Arc<std::fs::File>> {
        self.machine.as_ref().map(|m| Arc::clone(&m.ns))
    }

    fn check_disk(&self, when: &str) -> Result<Option<u64>, String> {
        let listed = crash::listed(&self.root)?;
        let newest = listed.last().copied();
        if let Some(h) = self.hwm
            && newest.is_none_or(|n| n < h)
        {
            return Err(format!(
                "{when}: step {h} was reported committed, the newest committed step is {newest:?} (listed {listed:?})"
            ));
        }
        if let Some(f) = listed.iter().find(|s| self.failed.contains(s)) {
            return Err(format!("{when}: step {f} failed to save and is listed"));
        }
        // Every listed step (retention keeps a few), not only the newest: a torn rank file
        // in an older one would be loaded by a user going back.
        for &n in &listed {
            let dir = self.root.join(step_dir_name(n));
            // `lost` is only ever set in the one-rank replica lane.
            if self.lost == Some(n) && !rank_file(&self.root, n).exists() {
                continue; // taken by a machine loss, not restored yet
            }
            crash::step_exact(&dir, n, self.world).map_err(|e| format!("{when}: {e}"))?;
            // A restore killed before its rename leaves its temporary file in the step's
            // directory; the restore that writes the file removes it: none is left beside
            // a file in place.
            let hidden: Vec<String> = std::fs::read_dir(&dir)
                .map_err(|e| format!("{when}: {}: {e}", dir.display()))?
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.'))
                .collect();
            if !hidden.is_empty() {
                return Err(format!("{when}: step {n} holds temporary files {hidden:?}"));
            }
        }
        Ok(newest)
    }

    /// The bucket lane's bucket, through the remote tier's own listing and loads: the
    /// newest committed step is at least the newest one a trainer reported uploaded, no
    /// failed step is listed, and every listed step holds exactly its bytes on every rank.
    fn check_bucket(&self, when: &str) -> Result<(), String> {
        let Some(dir) = &self.bucket else {
            return Ok(());
        };
        let remote = shmckpt::remote::Remote::with_store(
            bucket_store(dir),
            "soak",
            "soak-bucket",
            shmckpt::remote::RemoteOptions::default(),
        )
        .map_err(|e| format!("{when}: the bucket: {e}"))?;
        let listed = remote
            .list()
            .map_err(|e| format!("{when}: listing the bucket: {e}"))?;
        if let Some(h) = self.up_hwm
            && listed.last().is_none_or(|&n| n < h)
        {
            return Err(format!(
                "{when}: step {h} was reported uploaded, the bucket's newest is {:?} (listed {listed:?})",
                listed.last()
            ));
        }
        if let Some(f) = listed.iter().find(|s| self.failed.contains(s)) {
            return Err(format!(
                "{when}: step {f} failed to save and the bucket lists it"
            ));
        }
        for &n in &listed {
            for rank in 0..self.world {
                let (ck, _) = remote
                    .load(n, rank)
                    .map_err(|e| format!("{when}: the bucket's step {n}, rank {rank}: {e}"))?;
                crash::same(&ck, n, rank)
                    .map_err(|e| format!("{when}: the bucket's step {n}: {e}"))?;
            }
        }
        Ok(())
    }

    /// The replica lane's replicas in `/dev/shm`: every one of a step still committed
    /// loads (checked against its manifest: size, header, every CRC-32C) with exactly the
    /// bytes of the step's file; the newest is at least the newest step a trainer reported
    /// replicated (a sealed replica is only ever replaced by a newer one). Returns the
    /// newest replica's step.
    fn check_replicas(&self, when: &str) -> Result<Option<u64>, String> {
        if !self.replica {
            return Ok(None);
        }
        let tag = shmckpt::replica::tag_of(&self.root).map_err(|e| e.to_string())?;
        let steps: Vec<u64> = shmckpt::replica::list()
            .into_iter()
            .filter(|r| r.root_tag == tag && r.source_rank == 0)
            .map(|r| r.step)
            .collect();
        let newest = steps.iter().copied().max();
        if let Some(h) = self.rep_hwm
            && newest.is_none_or(|n| n < h)
        {
            return Err(format!(
                "{when}: step {h} was reported replicated, the newest replica is {newest:?}"
            ));
        }
        let listed = crash::listed(&self.root)?;
        for s in steps.iter().filter(|s| listed.contains(s)) {
            let got = shmckpt::replica::load(&self.root, *s, 0)
                .map_err(|e| format!("{when}: the replica of step {s}: {e}"))?;
            if let Ok(want) = std::fs::read(rank_file(&self.root, *s))
                && got.as_bytes() != &want[..]
            {
                return Err(format!(
                    "{when}: the replica of step {s} differs from its file"
                ));
            }
        }
        Ok(newest)
    }

    /// Spawn the job's trainers for one incarnation, in the lane's machine; checks that
    /// they run in its namespace.
    #[allow(clippy::type_complexity)]
    fn spawn(
        &mut self,
        class: Class,
        tx: &Sender<Ev>,
        soak: &Soak,
    ) -> Result<(Vec<Kid>, Option<u32>, Option<u64>), String> {
        let ns = self.ns();
        let r = in_ns(ns.as_deref(), || self.spawn_here(class, tx))?;
        if let Some(m) = &self.machine {
            for k in &r.0 {
                // A trainer that died already cannot be read (not counted).
                if let Ok(got) = ns_of(k.pid) {
                    if got != m.id {
                        return Err(format!(
                            "trainer pid {} runs in mount namespace {got}, not its machine's {} (holder pid {})",
                            k.pid,
                            m.id,
                            m.holder.id()
                        ));
                    }
                    soak.tally.lock().unwrap().ns_checked += 1;
                }
            }
        }
        Ok(r)
    }

    /// [`Lane::spawn`], in the calling thread's namespace.
    fn spawn_here(
        &mut self,
        class: Class,
        tx: &Sender<Ev>,
    ) -> (Vec<Kid>, Option<u32>, Option<u64>) {
        let aimed_rank =
            (class.point() != "none").then(|| rand(&mut self.rng, self.world as u64) as u32);
        // The tiered lane's disk saves are its 1st, 4th, 7th...: a point only a disk save
        // reaches (the drain, the commit) aims at one of them, or it would never land.
        let at = if self.tiered
            && matches!(
                class,
                Class::KillDrain | Class::KillCommit | Class::KillCommitted
            ) {
            1 + 3 * rand(&mut self.rng, 2)
        } else {
            1 + rand(&mut self.rng, 3)
        };
        // Per-point delay windows (microseconds), about the length of the phase.
        let delay = match class {
            Class::KillOpen => rand(&mut self.rng, 6000),
            Class::KillLoad => rand(&mut self.rng, 3000),
            Class::KillDrain => rand(&mut self.rng, 3000),
            Class::KillUpload => rand(&mut self.rng, 2000),
            // The piece of the transfer to die at (see `transfer`: ~5 pieces, then the
            // seal's two sides).
            Class::KillReplicate | Class::KillRestore => rand(&mut self.rng, 7),
            _ => 0,
        };
        let ioerr = if rand(&mut self.rng, 4) == 0 { 400 } else { 0 };
        let slow = [0, 200, 1000][rand(&mut self.rng, 3) as usize];
        let backend = if rand(&mut self.rng, 2) == 0 {
            "uring"
        } else {
            "pwrite"
        };
        // The tiered lane: every third save to disk; flash restore in half of the
        // incarnations (an incarnation without it recovers the kept arena like any other).
        let (cadence, keep) = if self.tiered {
            (3, rand(&mut self.rng, 2))
        } else {
            (1, 0)
        };
        // One rank: no other rank's part to keep apart, and the tiered lane keeps one
        // session, so flash restore takes a dead trainer's memory-only step over in place.
        let session = if self.tiered && self.world == 1 {
            "soak-tiered".to_owned()
        } else {
            format!("soak-{:016x}", splitmix(&mut self.rng))
        };
        // The replica lane's partner machine: the parent's namespace (the host's).
        let partner = if self.machine.is_some() {
            format!("/proc/{}/ns/mnt", std::process::id())
        } else {
            String::new()
        };
        let mut kids = Vec::new();
        for rank in 0..self.world {
            let point = if Some(rank) == aimed_rank {
                class.point()
            } else {
                "none"
            };
            let mut cmd = child_command_of(&self.test, "soak_trainer");
            let err = std::fs::File::options()
                .create(true)
                .append(true)
                .open(&self.stderr)
                .unwrap();
            cmd.env("SOAK_ROOT", &self.root)
                .env("SOAK_RANK", rank.to_string())
                .env("SOAK_WORLD", self.world.to_string())
                .env("SOAK_POINT", point)
                .env("SOAK_AT", at.to_string())
                .env("SOAK_DELAY_US", delay.to_string())
                .env("SOAK_IOERR", ioerr.to_string())
                .env("SOAK_SLOW_US", slow.to_string())
                .env("SOAK_BACKEND", backend)
                .env("SOAK_CADENCE", cadence.to_string())
                .env("SOAK_KEEP", keep.to_string())
                .env(
                    "SOAK_BUCKET",
                    self.bucket.as_deref().unwrap_or(Path::new("")),
                )
                .env("SOAK_REPLICA", if self.replica { "1" } else { "0" })
                .env("SOAK_PARTNER_NS", &partner)
                .current_dir(&self.cwd)
                .env("SOAK_SEED", splitmix(&mut self.rng).to_string())
                .env("SOAK_SESSION", &session)
                .env("RUST_LOG", "error")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::from(err));
            let mut child = cmd.spawn().unwrap();
            let pid = child.id();
            self.pids.push(pid);
            let out = child.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if let Some(at) = line.find("SOAK ") {
                        let _ = tx.send(Ev::Line(rank, line[at + 5..].to_owned()));
                    }
                }
                let _ = tx.send(Ev::Eof(rank));
            });
            kids.push(Kid {
                stdin: child.stdin.take(),
                child,
                pid,
                markers: Vec::new(),
                dead: None,
                eof: false,
            });
        }
        (kids, aimed_rank, Some(at))
    }

    /// One incarnation of the job, ended by a fault; returns the class counted.
    fn trial(&mut self, soak: &Soak) -> Result<(), String> {
        self.trial += 1;
        // A lost file restored by a trainer killed before it said so: restored (and
        // checked exactly with its step after every fault).
        if let Some(s) = self.lost
            && rank_file(&self.root, s).exists()
        {
            self.lost = None;
        }
        let r = rand(&mut self.rng, 100);
        let class = match r {
            // The replica lane, a file lost: every other time, a kill in its restore.
            _ if self.lost.is_some() && rand(&mut self.rng, 2) == 0 => Class::KillRestore,
            // The replica lane: its own points instead of the drain's and the commit's
            // (the other lanes have those), and more machine losses (they take files).
            60..84 if self.replica => Class::KillReplicate,
            84.. if self.replica => Class::MachineLoss,
            0..30 => Class::KillRandom,
            30..40 => Class::KillOpen,
            40..50 => Class::KillLoad,
            50..60 => Class::KillStaged,
            60..72 => Class::KillDrain,
            // The bucket lane: these kills wait for the upload (the commit's are in the
            // others).
            72..84 if self.bucket.is_some() => Class::KillUpload,
            72..84 => Class::KillCommit,
            84..92 => Class::KillCommitted,
            _ => Class::MachineLoss,
        };
        // Whether a dead engine's arena waits for this open's recovery (in the machine's
        // `/dev/shm`).
        let pids: BTreeSet<u32> = self.pids.iter().copied().collect();
        let arenas = in_ns(self.ns().as_deref(), || our_segments(&pids))?;
        let (tx, rx): (Sender<Ev>, Receiver<Ev>) = channel();
        let (mut kids, aimed, at) = self.spawn(class, &tx, soak)?;
        drop(tx);
        let t0 = Instant::now();
        // The parent's own kill: at a random time for the random classes; a generous
        // fallback for the named points (a point never reached is reported as a miss).
        let kill_at = match class {
            Class::KillRandom | Class::MachineLoss => {
                t0 + Duration::from_micros(rand(&mut self.rng, 120_000))
            }
            _ => t0 + Duration::from_secs(3),
        };
        let mut teardown: Option<Instant> = None;
        let mut went = false;
        let mut started = false;
        let mut seen_start: Option<u64> = None;
        let mut failed_now = Vec::new();
        loop {
            let now = Instant::now();
            if now > t0 + HANG {
                for k in &mut kids {
                    let _ = k.child.kill();
                }
                return Err(format!(
                    "the job hung for {HANG:?}; markers {:?}",
                    kids.iter().map(|k| &k.markers).collect::<Vec<_>>()
                ));
            }
            let due = teardown.map_or(kill_at, |t| t.min(kill_at));
            if now >= due {
                for k in kids.iter_mut().filter(|k| k.dead.is_none()) {
                    let _ = k.child.kill();
                }
            }
            if kids.iter().all(|k| k.eof) {
                for k in kids.iter_mut().filter(|k| k.dead.is_none()) {
                    k.dead = Some(k.child.wait().unwrap());
                }
                break;
            }
            let wait = due
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(50));
            match rx.recv_timeout(wait) {
                Ok(Ev::Line(rank, m)) => {
                    let kid = &mut kids[rank as usize];
                    if let Some(v) = m.strip_prefix("VIOLATION ") {
                        let pid = kid.pid;
                        return Err(format!(
                            "rank {rank} (pid {pid}): {v}\n  class {class:?}; markers per rank: {:?}",
                            kids.iter().map(|k| &k.markers).collect::<Vec<_>>()
                        ));
                    }
                    let mut it = m.split(' ');
                    let tag = it.next().unwrap_or("");
                    let num = it.next().and_then(|s| s.parse::<i64>().ok());
                    match (tag, num) {
                        ("COMMITTED", Some(s)) => {
                            let s = s as u64;
                            self.hwm = Some(self.hwm.map_or(s, |h| h.max(s)));
                            self.failed.remove(&s);
                            soak.tally.lock().unwrap().steps_committed += 1;
                        }
                        ("REPLICATED", Some(s)) => {
                            let s = s as u64;
                            self.rep_hwm = Some(self.rep_hwm.map_or(s, |h| h.max(s)));
                            soak.tally.lock().unwrap().replications += 1;
                        }
                        ("RESTORED", Some(s)) => {
                            if self.lost == Some(s as u64) {
                                self.lost = None;
                            }
                            soak.tally.lock().unwrap().restores += 1;
                        }
                        ("UPLOADED", Some(s)) => {
                            let s = s as u64;
                            self.up_hwm = Some(self.up_hwm.map_or(s, |h| h.max(s)));
                            soak.tally.lock().unwrap().uploads += 1;
                        }
                        ("MEMORY", Some(s)) => {
                            let s = s as u64;
                            self.mem_hwm = Some(self.mem_hwm.map_or(s, |h| h.max(s)));
                            self.failed.remove(&s);
                            soak.tally.lock().unwrap().memory_saves += 1;
                        }
                        ("SAVING", Some(s)) => {
                            // Re-saved: a previous failure no longer counts.
                            self.failed.remove(&(s as u64));
                            if m.ends_with(" beside-a-dead-part") {
                                soak.tally.lock().unwrap().beside_dead_part += 1;
                            }
                        }
                        ("IOERR", Some(s)) => {
                            failed_now.push(s as u64);
                            soak.add(Class::IoError, 1);
                        }
                        ("OPENED", _) => {
                            let list = |tag: &str| -> Vec<u64> {
                                m.split_once(tag)
                                    .and_then(|(_, r)| r.split_once(']'))
                                    .map(|(l, _)| {
                                        l.split(", ").filter_map(|x| x.parse().ok()).collect()
                                    })
                                    .unwrap_or_default()
                            };
                            self.held = list(" held [").first().copied();
                            let behind = list(" behind [").len() as u64;
                            let partly = list(" partly [").first().copied();
                            let mut t = soak.tally.lock().unwrap();
                            t.held_opens += u64::from(self.held.is_some());
                            t.behind_saves += behind;
                            t.partly_opens += u64::from(partly.is_some());
                            t.partly_held += u64::from(partly.is_some() && partly == self.held);
                        }
                        ("LATEST", Some(l)) => {
                            let l = (l >= 0).then_some(l as u64);
                            if let Some(h) = self.hwm
                                && l.is_none_or(|l| l < h)
                            {
                                return Err(format!(
                                    "rank {rank}: latest is {l:?} after step {h} was reported committed"
                                ));
                            }
                            if let Some(l) = l
                                && self.failed.contains(&l)
                            {
                                return Err(format!(
                                    "rank {rank}: latest is step {l}, whose save failed"
                                ));
                            }
                            // A memory-only step reported staged survives a process kill:
                            // recovery at open commits it.
                            if let Some(m) = self.mem_hwm
                                && l.is_none_or(|l| l < m)
                            {
                                return Err(format!(
                                    "rank {rank}: latest is {l:?} after step {m} was reported staged (memory-only)"
                                ));
                            }
                            if self.tiered
                                && let Some(l) = l
                            {
                                if self.hwm.is_none_or(|h| h < l) {
                                    soak.tally.lock().unwrap().memory_resumes += 1;
                                }
                                // Committed by recovery if it was memory-only: durable now;
                                // unless the open holds it in memory (a machine loss takes
                                // it, as it would have the dead trainer's).
                                if self.held != Some(l) {
                                    self.hwm = Some(self.hwm.map_or(l, |h| h.max(l)));
                                }
                            }
                            seen_start =
                                Some(seen_start.map_or(l.map_or(1, |l| l + 1), |s| {
                                    s.max(l.map_or(1, |l| l + 1))
                                }));
                        }
                        ("VERIFIED", Some(_)) => {
                            let mut t = soak.tally.lock().unwrap();
                            t.resumes_verified += 1;
                            if m.ends_with(" memory") {
                                t.flash_resumes += 1;
                            }
                        }
                        _ => {}
                    }
                    kid.markers.push(m);
                    // Two ranks: the parent is the job's barrier.
                    if self.world > 1 {
                        let opened = |k: &Kid| k.markers.iter().any(|m| m.starts_with("OPENED"));
                        if !went && kids.iter().all(opened) {
                            went = true;
                            for k in &mut kids {
                                if let Some(i) = &mut k.stdin {
                                    let _ = i.write_all(b"go\n");
                                }
                            }
                        }
                        let loaded = |k: &Kid| {
                            k.markers
                                .iter()
                                .any(|m| m.starts_with("VERIFIED") || m == "LATEST -1")
                        };
                        if !started && kids.iter().all(loaded) {
                            started = true;
                            let s = seen_start.unwrap();
                            for k in &mut kids {
                                if let Some(i) = &mut k.stdin {
                                    let _ = i.write_all(format!("start {s}\n").as_bytes());
                                }
                            }
                        }
                    }
                }
                Ok(Ev::Eof(rank)) => {
                    let kid = &mut kids[rank as usize];
                    kid.eof = true;
                    let st = kid.child.wait().unwrap();
                    kid.dead = Some(st);
                    if st.signal() != Some(libc::SIGKILL) {
                        let tail = std::fs::read_to_string(&self.stderr).unwrap_or_default();
                        let tail = &tail[tail.len().saturating_sub(3000)..];
                        return Err(format!(
                            "rank {rank} (pid {}) ended by {st:?}, not SIGKILL; markers {:?}\nstderr tail:\n{tail}",
                            kid.pid, kid.markers
                        ));
                    }
                    // The job is torn down with its first dead rank, a moment later.
                    if teardown.is_none() {
                        teardown =
                            Some(Instant::now() + Duration::from_micros(rand(&mut self.rng, 3000)));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    for k in kids.iter_mut().filter(|k| k.dead.is_none()) {
                        k.eof = true;
                        k.dead = Some(k.child.wait().unwrap());
                    }
                }
            }
        }
        self.failed.extend(failed_now);
        // What the fault was: a self-kill that did not land at its point counts as random.
        let counted = match aimed {
            Some(r) => {
                let k = &kids[r as usize];
                let step_at = k
                    .markers
                    .iter()
                    .filter_map(|m| m.strip_prefix("SAVING "))
                    .nth(at.unwrap_or(1) as usize - 1)
                    .and_then(|s| s.parse().ok());
                if landed(class, &k.markers, step_at) {
                    class
                } else {
                    *soak.tally.lock().unwrap().missed.entry(class).or_default() += 1;
                    Class::KillRandom
                }
            }
            None => class,
        };
        soak.add(counted, 1);
        {
            let mut t = soak.tally.lock().unwrap();
            t.processes_killed += kids.len() as u64;
            if counted == Class::KillOpen && !arenas.is_empty() {
                t.opens_with_arena += 1;
            }
        }
        if class == Class::MachineLoss
            && let Some(m) = self.machine.take()
        {
            // The machine is gone: its trainers are dead, its holder goes now, and with
            // them the last task in its namespace; so its `/dev/shm` goes, whatever the
            // names in it (the kept arena included, and with it every step that was only
            // staged). The machine comes back with an empty one (checked by `start`).
            let old = m.id.clone();
            m.lose();
            // No task is left in the lost namespace (the dead trainers' output readers end
            // a moment after their last line). Before the next machine starts: a new
            // namespace may take the number of one that is gone.
            let t = Instant::now();
            loop {
                let held = tasks_in_ns(&old);
                if held.is_empty() {
                    break;
                }
                if t.elapsed() > Duration::from_secs(5) {
                    return Err(format!(
                        "the lost machine's namespace {old} is still held by tasks {held:?}"
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            self.machine = Some(Machine::start().map_err(|e| format!("a new machine: {e}"))?);
            soak.tally.lock().unwrap().machines_lost += 1;
            self.mem_hwm = self.hwm;
        } else if class == Class::MachineLoss {
            // Simulated (no namespaces): the dead trainers' segments are removed from the
            // shared `/dev/shm` by name, the kept arena too.
            let pids: BTreeSet<u32> = kids.iter().map(|k| k.pid).collect();
            for s in our_segments(&pids) {
                let _ = std::fs::remove_file(Path::new("/dev/shm").join(s));
            }
            if self.tiered {
                let _ = std::fs::remove_file(self.kept_arena());
            }
            self.mem_hwm = self.hwm;
        }
        if matches!(class, Class::KillRandom | Class::MachineLoss) {
            let mut t = soak.tally.lock().unwrap();
            for k in &kids {
                *t.landed.entry(phase(&k.markers)).or_default() += 1;
            }
        }
        // Right after the fault, before any recovery: nothing committed was lost, and the
        // newest committed step holds exactly its bytes; in the bucket too.
        let with_markers = |e: String| {
            format!(
                "{e}\n  class {class:?}; markers per rank: {:?}",
                kids.iter().map(|k| &k.markers).collect::<Vec<_>>()
            )
        };
        self.check_disk("after the kill").map_err(with_markers)?;
        self.check_bucket("after the kill").map_err(with_markers)?;
        let newest_replica = self
            .check_replicas("after the kill")
            .map_err(with_markers)?;
        if class == Class::MachineLoss
            && let Some(s) = newest_replica
            && self.lost.is_none()
        {
            // The machine's disk went with it (a node-local root): the rank's file of the
            // newest replicated step is gone, which its replica on the partner restores.
            if std::fs::remove_file(rank_file(&self.root, s)).is_ok() {
                self.lost = Some(s);
                soak.tally.lock().unwrap().files_lost += 1;
            }
        }
        Ok(())
    }

    /// The end: every rank's engine opened once more (recovering what the last kill left),
    /// `latest` loaded and compared, every listed step verified, segments gone.
    fn finish(&mut self) -> Result<(), String> {
        if self.replica {
            // What the last fault took and no trainer restored (the replicas are on the
            // partner's machine: the host's namespace, where this thread runs).
            repair(&self.root, None, false).map_err(|e| format!("final: {e}"))?;
            self.lost = None;
        }
        // The engines, and the kept arena, on the lane's machine (its `/dev/shm` holds the
        // dead trainers' arenas they recover).
        let ns = self.ns();
        in_ns(ns.as_deref(), || self.finish_on_machine())??;
        self.check_bucket("final")?;
        if self.replica {
            self.check_replicas("final")?;
            // The replicas go (as `shmckpt shm rm` does), with the temporary files of
            // killed receivers: none may be left.
            let tag = shmckpt::replica::tag_of(&self.root).map_err(|e| e.to_string())?;
            shmckpt::replica::remove_older(&self.root, 0, u64::MAX)
                .map_err(|e| format!("final: removing the replicas: {e}"))?;
            let left: Vec<String> = shmckpt::replica::list()
                .into_iter()
                .filter(|r| r.root_tag == tag)
                .map(|r| r.name)
                .chain(
                    shmckpt::replica::list_unfinished()
                        .into_iter()
                        .filter(|u| u.replica.contains(&tag))
                        .map(|u| u.name),
                )
                .collect();
            if !left.is_empty() {
                return Err(format!("final: replicas left in /dev/shm: {left:?}"));
            }
        }
        Ok(())
    }

    /// [`Lane::finish`]'s part on the lane's machine (call it inside its namespace).
    fn finish_on_machine(&self) -> Result<(), String> {
        let engines: Vec<Engine> = (0..self.world)
            .map(|r| {
                Engine::open(trainer_config(
                    &self.root,
                    r,
                    self.world,
                    BackendKind::Pwrite,
                ))
                .map_err(|e| format!("final open of rank {r}: {e}"))
            })
            .collect::<Result<_, _>>()?;
        let listed = crash::listed(&self.root)?;
        for (r, e) in engines.iter().enumerate() {
            latest_is_newest_and_exact(e, &listed, r as u32).map_err(|e| format!("final: {e}"))?;
        }
        for &s in &listed {
            crash::step_exact(&self.root.join(step_dir_name(s)), s, self.world)?;
        }
        drop(engines);
        if self.tiered {
            // Recovered by the final open (a kept arena stays by design): removed, as
            // `shmckpt shm rm` does, and it must be gone.
            let kept = self.kept_arena();
            if kept.exists() {
                let name = kept.file_name().unwrap().to_string_lossy().into_owned();
                shmckpt::flash::remove_kept(&name)
                    .map_err(|e| format!("final: removing the kept arena {name}: {e}"))?;
            }
            if kept.exists() {
                return Err(format!(
                    "final: the kept arena {} is still there",
                    kept.display()
                ));
            }
        }
        Ok(())
    }
}

fn lane(soak: &Soak, test: String, id: usize, world: u32, kind: LaneKind) {
    let dir = real_dir(&format!("soak{id}"));
    let mut lane = Lane {
        id,
        world,
        root: dir.path().join("root"),
        hwm: None,
        tiered: kind == LaneKind::Tiered,
        mem_hwm: None,
        held: None,
        bucket: (kind == LaneKind::Bucket).then(|| dir.path().join("bucket")),
        up_hwm: None,
        replica: kind == LaneKind::Replica,
        rep_hwm: None,
        lost: None,
        failed: BTreeSet::new(),
        pids: Vec::new(),
        machine: None,
        cwd: std::env::current_dir().unwrap(),
        rng: soak.seed ^ (0x1000 * (id as u64 + 1)),
        trial: 0,
        stderr: dir.path().join("stderr.log"),
        test,
    };
    std::fs::create_dir(&lane.root).unwrap();
    if let Some(b) = &lane.bucket {
        std::fs::create_dir(b).unwrap();
    }
    {
        let mut roots = LANE_ROOTS.lock().unwrap();
        roots.push(lane.root.clone());
        if let Ok(c) = std::fs::canonicalize(&lane.root) {
            roots.push(c);
        }
    }
    if soak.simulated.is_none() {
        match Machine::start() {
            Ok(m) => lane.machine = Some(m),
            Err(e) => {
                soak.violation(format!("lane {id}: its machine: {e}"));
                return;
            }
        }
    }
    while !soak.done() {
        let _ = std::fs::remove_file(&lane.stderr);
        if let Err(e) = lane.trial(soak) {
            soak.violation(format!(
                "lane {} ({} rank(s)), trial {}: {e}",
                lane.id, lane.world, lane.trial
            ));
            // The dead trainers' arenas go with the root (a failed run leaks no segment):
            // with the machine, or by name from the shared `/dev/shm`.
            if let Some(m) = lane.machine.take() {
                m.lose();
            } else {
                let pids: BTreeSet<u32> = lane.pids.iter().copied().collect();
                for seg in our_segments(&pids) {
                    let _ = std::fs::remove_file(Path::new("/dev/shm").join(seg));
                }
                if lane.tiered {
                    let _ = std::fs::remove_file(lane.kept_arena());
                }
            }
            if lane.replica {
                // Its replicas and the temporary files of killed receivers too.
                let _ = shmckpt::replica::remove_older(&lane.root, 0, u64::MAX);
            }
            return;
        }
    }
    if let Err(e) = lane.finish() {
        soak.violation(format!(
            "lane {} ({} rank(s)), final check: {e}",
            lane.id, lane.world
        ));
    }
    let pids: BTreeSet<u32> = lane.pids.iter().copied().collect();
    soak.tally.lock().unwrap().pids.extend(&pids);
    // The machine's `/dev/shm` (or the shared one): no segment of the lane's processes is
    // left; a machine's must be empty altogether (it holds nothing but the lane's).
    let left = in_ns(lane.ns().as_deref(), || {
        let left = our_segments(&pids);
        // What each holds, and whose root: the lead to why the final open kept it.
        let what: Vec<String> = left
            .iter()
            .map(|n| format!("{n}: {:?}", shmckpt::recover::inspect_arena(n)))
            .collect();
        (what, shm_names())
    });
    let (what, names) = left.unwrap_or_else(|e| (vec![e], Vec::new()));
    if !what.is_empty() {
        soak.violation(format!(
            "lane {} (root {}): segments left in /dev/shm: {}",
            lane.id,
            lane.root.display(),
            what.join("; ")
        ));
    }
    if let Some(m) = lane.machine.take() {
        if names.is_empty() {
            soak.tally.lock().unwrap().machines_empty_at_end += 1;
        } else {
            soak.violation(format!(
                "lane {}: its machine's /dev/shm (namespace {}) is not empty at the end: {names:?}",
                lane.id, m.id
            ));
        }
        m.lose();
    }
}

/// Power cuts: random crash states of recorded saves (1 and 2 ranks), each checked as
/// `crash.rs` checks them.
fn power_cuts(soak: &Soak, n: u64) {
    use shmckpt_crashsim::states::{self, Variant};
    let mut rng = soak.seed ^ 0xc0de;
    let scratch = tempfile::Builder::new()
        .prefix("soak-cuts-")
        .tempdir_in("/dev/shm")
        .unwrap();
    let mut logs = Vec::new();
    for world in [1u32, 2] {
        let dir = real_dir("soak-rec");
        let steps: Vec<u64> = (1..=4).collect();
        let log = crash::record_saves(dir.path(), world, BackendKind::Pwrite, &steps);
        logs.push((world, steps, log));
    }
    for i in 0..n {
        if soak.stop.load(Ordering::Relaxed) {
            return;
        }
        let (world, steps, log) = &logs[(i % 2) as usize];
        let point = rand(&mut rng, log.ops.len() as u64 + 1) as usize;
        let variant = match rand(&mut rng, 4) {
            0 => Variant::Durable,
            1 => Variant::Everything,
            _ => Variant::Random(splitmix(&mut rng)),
        };
        let model = states::crash_state(log, point, variant);
        let reported = log.committed_before(point);
        let retired = crash::retired_before(log, point);
        let root = scratch.path().join(format!("s{i}"));
        std::fs::create_dir(&root).unwrap();
        model.materialize(&root).unwrap();
        let saved: BTreeSet<u64> = steps.iter().copied().collect();
        if let Err(why) = crash::check_state(&root, *world, &saved, &reported, &retired) {
            soak.violation(format!(
                "power cut {i}: {world} rank(s), crash at op {point}/{} ({variant:?}): {why}",
                log.ops.len()
            ));
            return;
        }
        let _ = std::fs::remove_dir_all(&root);
        soak.add(Class::PowerCut, 1);
    }
}

/// Saves of one crashfs incarnation (each ~70 KiB, two chunks).
const FS_SAVES: u64 = 3;

/// What one incarnation on crashfs did before its power cut.
struct FsRun {
    /// What a reboot finds.
    image: crashfs::Image,
    /// Whether the cut came at its request (not on command after the last save).
    fired: bool,
    mutations: u64,
    /// Steps reported committed (durable) before the cut.
    reported: Vec<u64>,
}

/// One incarnation of a one-rank trainer (an engine in this process, on the calling
/// thread's machine) on a crashfs mount of `image` at `mnt`: open (recovery on open),
/// [`FS_SAVES`] saves after `latest`, the power cut at the `cut_at`-th mutating request
/// (or on command after the last save). An error: something failed with the power on.
fn fs_incarnation(
    image: crashfs::Image,
    mnt: &Path,
    cut_at: u64,
    backend: BackendKind,
) -> Result<FsRun, String> {
    let m = crashfs::Mounted::mount(image, mnt).map_err(|e| format!("mounting crashfs: {e}"))?;
    m.power().cut_at_mutation(cut_at);
    let mut reported = Vec::new();
    let on = |e: &dyn std::fmt::Display, what: &str| -> Result<(), String> {
        if m.power().is_cut() {
            Ok(())
        } else {
            Err(format!("{what} failed with the power on: {e}"))
        }
    };
    let r = (|| -> Result<(), String> {
        let engine = match Engine::open(trainer_config(mnt, 0, 1, backend)) {
            Ok(e) => e,
            Err(e) => return on(&e, "Engine::open"),
        };
        let latest = match engine.latest() {
            Ok(l) => l,
            Err(e) => return on(&e, "latest"),
        };
        let start = latest.map_or(1, |l| l + 1);
        for step in start..start + FS_SAVES {
            let st = crash::state(step, 0);
            match engine
                .save(step, &st.tensors(), &Metadata::new())
                .and_then(|h| h.wait())
            {
                Ok(r) if r.dir.is_some() => reported.push(step),
                Ok(_) => return Err(format!("step {step}: a one-rank save committed nothing")),
                Err(e) => return on(&e, &format!("the save of step {step}")),
            }
        }
        Ok(())
    })();
    let fired = m.power().is_cut();
    let mutations = m.power().mutations();
    // Every descriptor of the mount is closed (the engine is gone): what a reboot finds.
    let image = m.crash();
    r?;
    Ok(FsRun {
        image,
        fired,
        mutations,
        reported,
    })
}

/// After a crashfs power cut, on the rebooted filesystem (a clean mount of `image`, the
/// power on): every listed step verifies with exactly its bytes; the newest is at least
/// `hwm`, the newest step ever reported committed, and every step `run` reported is listed
/// unless [`KEEP`] newer ones are (retention); the next open leaves no partial or trash
/// directory and its `latest` is the newest listed and loads exactly. Returns the image
/// as that open left it (a clean unmount), for the next incarnation.
fn fs_check(
    image: crashfs::Image,
    mnt: &Path,
    hwm: Option<u64>,
    run: &FsRun,
) -> Result<crashfs::Image, String> {
    let m = crashfs::Mounted::mount(image, mnt).map_err(|e| format!("mounting crashfs: {e}"))?;
    let r = (|| -> Result<(), String> {
        let listed = crash::listed(mnt)?;
        for &n in &listed {
            crash::step_exact(&mnt.join(step_dir_name(n)), n, 1)?;
        }
        if let Some(h) = hwm
            && listed.last().is_none_or(|&n| n < h)
        {
            return Err(format!(
                "step {h} was reported committed, the newest committed step is {:?} (listed {listed:?})",
                listed.last()
            ));
        }
        for &r in &run.reported {
            if !listed.contains(&r) && listed.iter().filter(|&&l| l > r).count() < KEEP {
                return Err(format!(
                    "step {r} was reported committed and is gone (listed {listed:?})"
                ));
            }
        }
        let engine = Engine::open(trainer_config(mnt, 0, 1, BackendKind::Pwrite))
            .map_err(|e| format!("Engine::open after the cut: {e}"))?;
        let left: Vec<String> = std::fs::read_dir(mnt)
            .map_err(|e| e.to_string())?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".partial") || n.ends_with(".trash"))
            .collect();
        if !left.is_empty() {
            return Err(format!("after Engine::open: {left:?}"));
        }
        latest_is_newest_and_exact(&engine, &crash::listed(mnt)?, 0)
    })();
    let image = m.unmount();
    r.map(|()| image)
}

/// Power cuts through the kernel: a one-rank trainer (an engine in this process, random
/// backend) saves on a crashfs mount (docs/crash.md section 4), the power cut at a random
/// mutating request; the filesystem is brought back as a reboot finds it and checked
/// ([`fs_check`]); the next incarnation goes on from there. Each incarnation runs on a
/// machine of its own (a mount namespace, the FUSE mount inside it) lost with the power:
/// its `/dev/shm` goes with it. Without namespaces, the engine's arenas are removed by name.
/// Skipped (said in the summary) without FUSE; `SHMCKPT_REQUIRE_FUSE=1` fails instead.
/// `e`'s `latest` is the newest step of `listed`, and loads with exactly rank `rank`'s
/// bytes of it.
fn latest_is_newest_and_exact(e: &Engine, listed: &[u64], rank: u32) -> Result<(), String> {
    let l = e.latest().map_err(|e| format!("rank {rank} latest: {e}"))?;
    if l != listed.last().copied() {
        return Err(format!("rank {rank} latest {l:?}, listed {listed:?}"));
    }
    if let Some(l) = l {
        let ck = e
            .load(StepSel::Latest)
            .map_err(|e| format!("rank {rank} load(latest = {l}): {e}"))?;
        crash::same(&ck, l, rank)?;
    }
    Ok(())
}

/// A fresh machine for crashfs power cut `i`, or none where machines are simulated; `None`
/// once a machine could not start (a violation, reported).
fn cut_machine(soak: &Soak, i: u64) -> Option<Option<Machine>> {
    if soak.simulated.is_some() {
        return Some(None);
    }
    match Machine::start() {
        Ok(m) => Some(Some(m)),
        Err(e) => {
            soak.violation(format!("crashfs power cut {i}: a machine: {e}"));
            None
        }
    }
}

fn crashfs_cuts(soak: &Soak, n: u64) {
    if let Err(why) = crashfs::can_mount() {
        assert!(
            std::env::var("SHMCKPT_REQUIRE_FUSE").as_deref() != Ok("1"),
            "SHMCKPT_REQUIRE_FUSE=1 but no FUSE mount can be made: {why}"
        );
        println!(
            "soak: SKIPPED power cuts through crashfs (no FUSE mount: {why}; SHMCKPT_REQUIRE_FUSE=1 makes this a failure)"
        );
        soak.tally.lock().unwrap().fs_skipped = Some(why);
        return;
    }
    let mut rng = soak.seed ^ 0xf5e;
    let dir = real_dir("soak-crashfs");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut image = crashfs::Image::empty();
    let mut hwm: Option<u64> = None;
    // Requests per incarnation, as the first one counts them (it is cut on command).
    let mut requests: Option<u64> = None;
    for i in 0..n {
        if soak.stop.load(Ordering::Relaxed) {
            return;
        }
        let cut_at = requests.map_or(u64::MAX, |m| rand(&mut rng, m + m / 4 + 1));
        let backend = if rand(&mut rng, 2) == 0 {
            BackendKind::IoUring
        } else {
            BackendKind::Pwrite
        };
        let Some(machine) = cut_machine(soak, i) else {
            return;
        };
        let ns = machine.as_ref().map(|m| Arc::clone(&m.ns));
        let img = std::mem::take(&mut image);
        let run =
            in_ns(ns.as_deref(), || fs_incarnation(img, &mnt, cut_at, backend)).and_then(|r| r);
        // The power is off: the machine goes, its `/dev/shm` with it.
        match machine {
            Some(m) => m.lose(),
            None => {
                let me: BTreeSet<u32> = [std::process::id()].into();
                for seg in our_segments(&me) {
                    let root = shmckpt::recover::inspect_arena(&seg)
                        .details
                        .map(|d| d.root);
                    if root.is_ok_and(|r| r.starts_with(&mnt)) {
                        let _ = std::fs::remove_file(Path::new("/dev/shm").join(seg));
                    }
                }
            }
        }
        let run = match run {
            Ok(r) => r,
            Err(e) => {
                soak.violation(format!(
                    "crashfs power cut {i} (cut at request {cut_at}, {backend:?}): {e}"
                ));
                return;
            }
        };
        // The reboot: a fresh machine, the durable state mounted again.
        let Some(machine) = cut_machine(soak, i) else {
            return;
        };
        let ns = machine.as_ref().map(|m| Arc::clone(&m.ns));
        let prev = hwm;
        let checked = in_ns(ns.as_deref(), || {
            fs_check(run.image.clone(), &mnt, prev, &run)
        })
        .and_then(|r| r);
        let names = in_ns(ns.as_deref(), shm_names).unwrap_or_default();
        drop(machine);
        hwm = run.reported.iter().copied().max().max(hwm);
        match checked {
            Ok(img) => image = img,
            Err(e) => {
                soak.violation(format!(
                    "crashfs power cut {i}: cut at request {cut_at} of ~{requests:?} ({backend:?}), after {} requests, steps reported {:?}: {e}",
                    run.mutations, run.reported
                ));
                return;
            }
        }
        if soak.simulated.is_none() && !names.is_empty() {
            soak.violation(format!(
                "crashfs power cut {i}: the check's machine kept {names:?} in /dev/shm"
            ));
            return;
        }
        if requests.is_none() {
            requests = Some(run.mutations);
        }
        {
            let mut t = soak.tally.lock().unwrap();
            t.fs_fired += u64::from(run.fired);
            t.fs_requests = t.fs_requests.max(run.mutations);
            t.fs_reported += run.reported.len() as u64;
            t.fs_resumes += 1;
        }
        soak.add(Class::PowerCutFs, 1);
    }
}

/// Bucket faults: the remote tier's crash harness at random requests.
fn bucket_faults(soak: &Soak, n: u64) {
    let mut rng = soak.seed ^ 0xb0c7;
    for _ in 0..n {
        if soak.stop.load(Ordering::Relaxed) {
            return;
        }
        let k = rand(&mut rng, 27) as usize;
        let r = std::panic::catch_unwind(|| crate::remote_crash::crash_at(1, 4, k));
        if let Err(p) = r {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            soak.violation(format!("bucket crash at request {k}: {msg}"));
            return;
        }
        soak.add(Class::Bucket, 1);
    }
}

fn env_u64(k: &str) -> Option<u64> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

const ROLES: &[Role] = &[("soak_trainer", child_trainer)];

#[test]
#[ignore = "the chaos soak runs in its own stage of scripts/test.sh: cargo test --all-features --test integration soak -- --ignored --nocapture"]
fn chaos_soak() {
    if run_role(ROLES) {
        return;
    }
    let seed = env_u64("SHMCKPT_SOAK_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        shmckpt_bench::synthetic::splitmix64(t.as_nanos() as u64 ^ u64::from(std::process::id()))
    });
    let target = env_u64("SHMCKPT_SOAK_FAULTS").unwrap_or(DEFAULT_FAULTS);
    // One kill lane per world size (default 1 and 2 ranks); `SHMCKPT_SOAK_WORLDS=2`
    // isolates a lane when replaying a seed.
    // A world size, `t` for the tiered lane (one rank, a disk cadence, flash restore), `b`
    // for the bucket lane (every committed save uploaded), `r` for the replica lane (one
    // rank, every committed save replicated, files lost and restored).
    let worlds: Vec<(u32, LaneKind)> = std::env::var("SHMCKPT_SOAK_WORLDS")
        .unwrap_or_else(|_| "1,2,1t,1b,1r".into())
        .split(',')
        .map(|w| {
            let w = w.trim();
            let kind = if w.ends_with('t') {
                LaneKind::Tiered
            } else if w.ends_with('b') {
                LaneKind::Bucket
            } else if w.ends_with('r') {
                LaneKind::Replica
            } else {
                LaneKind::Plain
            };
            let n = w
                .trim_end_matches(['t', 'b', 'r'])
                .parse()
                .expect("SHMCKPT_SOAK_WORLDS: world sizes, e.g. 1,2,1t,1b,1r");
            assert!(
                !matches!(kind, LaneKind::Tiered | LaneKind::Replica) || n == 1,
                "the tiered and replica lanes have one rank"
            );
            (n, kind)
        })
        .collect();
    println!(
        "soak: seed {seed} (SHMCKPT_SOAK_SEED={seed} replays it), {target} faults, kill lanes of {worlds:?} rank(s)"
    );
    let test = current_test();
    let before = prefixed_segments();
    let _ = BEFORE.set(before.clone());
    // Each kill lane's machine is a mount namespace with a `/dev/shm` of its own where
    // they can be made (root, `unshare`); elsewhere machine loss is simulated in the
    // shared `/dev/shm`, which `SHMCKPT_REQUIRE_NS=1` (CI) makes a failure.
    let simulated = Machine::start().err();
    if let Some(why) = &simulated {
        assert!(
            std::env::var("SHMCKPT_REQUIRE_NS").as_deref() != Ok("1"),
            "SHMCKPT_REQUIRE_NS=1 but no mount namespace with its own /dev/shm can be made: {why}"
        );
        println!(
            "soak: SKIPPED real machines (no mount namespace: {why}); machine loss is simulated in the shared /dev/shm (SHMCKPT_REQUIRE_NS=1 makes this a failure)"
        );
    }
    let soak = Soak {
        seed,
        simulated,
        target,
        total: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        tally: Mutex::new(Tally::default()),
    };
    let t = Instant::now();
    // The in-process classes first (a fixed share), then the kill lanes until the total.
    let cuts = (target / 8).max(1);
    let fs_cuts = (target / 40).max(1);
    let buckets = (target / 250).max(1);
    power_cuts(&soak, cuts);
    crashfs_cuts(&soak, fs_cuts);
    bucket_faults(&soak, buckets);
    std::thread::scope(|s| {
        for (id, &(world, kind)) in worlds.iter().enumerate() {
            let (soak, test) = (&soak, test.clone());
            s.spawn(move || lane(soak, test, id, world, kind));
        }
    });
    let wall = t.elapsed();
    let tally = soak.tally.into_inner().unwrap();
    let after = prefixed_segments();
    println!(
        "soak: {} faults in {:.1} s (seed {seed})",
        soak.total.load(Ordering::Relaxed),
        wall.as_secs_f64()
    );
    println!("| fault class | count |");
    println!("|---|---|");
    for (c, n) in &tally.faults {
        println!("| {} | {n} |", c.label());
    }
    println!("| **total** | **{}** |", tally.faults.values().sum::<u64>());
    println!(
        "soak: {} trainer processes SIGKILLed, {} resumes loaded and compared bit for bit, {} saves reported committed, {} saves beside another rank's part of a dead incarnation (never merged with it: sessions), {} kills during an open with a dead arena present; self-kills that missed their point (counted as random): {:?}",
        tally.processes_killed,
        tally.resumes_verified,
        tally.steps_committed,
        tally.beside_dead_part,
        tally.opens_with_arena,
        tally
            .missed
            .iter()
            .map(|(c, n)| (c.point(), *n))
            .collect::<Vec<_>>()
    );
    println!(
        "soak: where the random kills found the trainers: {:?}",
        tally.landed
    );
    println!(
        "soak: tiered lane: {} memory-only saves reported staged, {} resumes at a step no trainer had reported committed (a memory-only step recovered), {} resumes served from memory (flash restore), {} opens that held the dead trainer's memory-only step in memory (taken over in place) and recovered {} older saves behind them; {} opens found the newest staged save partly written to its file (a disk save killed while draining), {} of them held it (its written chunks read back)",
        tally.memory_saves,
        tally.memory_resumes,
        tally.flash_resumes,
        tally.held_opens,
        tally.behind_saves,
        tally.partly_opens,
        tally.partly_held
    );
    println!(
        "soak: bucket lane: {} uploads reported committed in the bucket; after every fault its listed steps loaded through the remote tier and compared bit for bit",
        tally.uploads
    );
    println!(
        "soak: replica lane: {} replicas reported sealed, {} machine losses took the rank file of the newest replicated step, {} files restored from a replica; after every fault every replica loaded and compared with its step's file",
        tally.replications, tally.files_lost, tally.restores
    );
    match &tally.fs_skipped {
        None => println!(
            "soak: crashfs: {} power cuts of a one-rank trainer on a FUSE mount ({} at a random mutating request of up to {} per incarnation, the others on command after its {FS_SAVES} saves), {} saves reported committed before them, {} reboots checked (every listed step exact, nothing reported lost, the next open's latest loaded exactly)",
            tally.faults.get(&Class::PowerCutFs).copied().unwrap_or(0),
            tally.fs_fired,
            tally.fs_requests,
            tally.fs_reported,
            tally.fs_resumes
        ),
        Some(why) => println!("soak: crashfs power cuts SKIPPED (no FUSE mount: {why})"),
    }
    match &soak.simulated {
        None => println!(
            "soak: machines: mount namespaces, each kill lane's with its own /dev/shm; {} trainers checked to run in their lane's namespace; {} machine losses killed the holder (no task left in the lost namespace, checked) and started a fresh machine (empty /dev/shm, checked); {} machines' /dev/shm empty at the end",
            tally.ns_checked, tally.machines_lost, tally.machines_empty_at_end
        ),
        Some(why) => println!(
            "soak: machines SIMULATED (no mount namespace: {why}): machine loss removed the dead trainers' segments from the shared /dev/shm by name"
        ),
    }
    // `/dev/shm` is flat: no segment of the soak's processes (the trainers, this one) is
    // left. Other test processes of the machine may come and go meanwhile: the listing is
    // compared by owner.
    let mut pids = tally.pids.clone();
    pids.insert(std::process::id());
    let ours = our_segments(&pids);
    let new: Vec<&String> = after.difference(&before).collect();
    println!(
        "soak: /dev/shm segments named {NAME_PREFIX}*: {} before, {} after, {} of them new, {} of the soak's {} processes",
        before.len(),
        after.len(),
        new.len(),
        ours.len(),
        pids.len()
    );
    assert!(
        ours.is_empty(),
        "SOAK FAILED (seed {seed}): segments left in /dev/shm: {ours:?}"
    );
    if soak.simulated.is_none() {
        assert!(
            tally.ns_checked > 0 || !tally.violations.is_empty(),
            "SOAK FAILED (seed {seed}): no trainer was seen running in its machine's namespace"
        );
    }
    assert!(
        tally.violations.is_empty(),
        "SOAK FAILED (seed {seed}; rerun with SHMCKPT_SOAK_SEED={seed}): {} violation(s):\n{}",
        tally.violations.len(),
        tally.violations.join("\n")
    );
    assert!(soak.total.load(Ordering::Relaxed) >= target);
}
