//! The recorder: the library's filesystem observer ([`shmckpt::observe`], installed by the
//! first [`Recording::start`]). The library's funnel of every mutation of a checkpoint
//! root and its write backends show each call to it; while no [`Recording`] is active it
//! only checks one atomic counter. While one is active, each hook holds one global lock across the system
//! call and its record, so the log's order is an order in which the calls really happened,
//! across every thread of the process.
//!
//! An operation is recorded when it concerns a file or directory of an active recording's
//! tree (its parent directory for names, the file itself for descriptors): other tests'
//! roots, `/dev/shm` and the like are never recorded.

use std::collections::HashMap;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::fs::AtFlags;

use shmckpt::observe::{FsObserver, FsOp};

use crate::model::Model;
use crate::{Id, Log, Op};

/// Lock `m`, ignoring poisoning (a panicked test thread left plain data behind).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The recorder as the library's filesystem observer: each call goes to its hook below.
struct Recorder;

impl FsObserver for Recorder {
    fn around(&self, op: &FsOp<'_>, run: &mut dyn FnMut() -> bool) {
        let mut f = || if run() { Ok(()) } else { Err(()) };
        let _ = match *op {
            FsOp::Create { path, dir } => create_path(path, dir, f),
            FsOp::CreateAt { parent, name, dir } => create_at(parent, name, dir, f),
            FsOp::Remove { path } => remove_path(path, f),
            FsOp::RemoveAt { parent, name } => remove_at(parent, name, f),
            FsOp::RemoveTree { path } => remove_tree(path, f),
            FsOp::Rename { from, to } => rename(from, to, f),
            FsOp::Sync { fd, data_only } => sync_fd(fd, data_only, f),
            FsOp::Truncate { fd, len } => truncate_fd(fd, len, f),
            FsOp::Fallocate { fd, offset, len } => fallocate_fd(fd, offset, len, f),
            FsOp::Write { fd, offset, data } => write_fd(fd, offset, data, f),
            // A mutation this recorder does not know: made, not recorded.
            _ => f(),
        };
    }

    fn tracking_writes(&self) -> bool {
        active()
    }

    fn written(&self, fd: BorrowedFd<'_>, offset: u64, data: &[u8]) {
        written(fd, offset, data);
    }

    fn committed(&self, root: &Path, step: u64) {
        committed(root, step);
    }
}

static RECORDER: Recorder = Recorder;

/// Install the recorder as the process's filesystem observer (once); an error when
/// another observer was installed first.
fn install() -> io::Result<()> {
    static INSTALLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *INSTALLED.get_or_init(|| shmckpt::observe::install(&RECORDER)) {
        Ok(())
    } else {
        Err(io::Error::other(
            "another filesystem observer is installed: nothing would be recorded",
        ))
    }
}

type Key = (u64, u64);

struct Active {
    token: u64,
    root: Key,
    ids: HashMap<Key, Id>,
    next: Id,
    base: Model,
    ops: Vec<Op>,
}

impl Active {
    fn track(&mut self, k: Key) -> Id {
        let id = self.next;
        self.next += 1;
        self.ids.insert(k, id);
        id
    }
}

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static TOKEN: AtomicU64 = AtomicU64::new(1);
static STATE: Mutex<Vec<Active>> = Mutex::new(Vec::new());

/// Whether any recording is active (the backends skip all bookkeeping otherwise).
fn active() -> bool {
    ACTIVE.load(Ordering::SeqCst) > 0
}

fn guard() -> Option<MutexGuard<'static, Vec<Active>>> {
    active().then(|| lock(&STATE))
}

/// Recording of one root, from [`Recording::start`] to [`Recording::finish`] (or drop).
#[derive(Debug)]
pub struct Recording {
    token: u64,
    root: PathBuf,
}

impl Recording {
    /// Start recording every operation on the tree under `root`; what it holds now is the
    /// log's durable base.
    pub fn start(root: &Path) -> io::Result<Recording> {
        install()?;
        let token = TOKEN.fetch_add(1, Ordering::Relaxed);
        let mut st = lock(&STATE);
        let mut ids = HashMap::new();
        let mut next: Id = 0;
        let base = Model::scan(root, &mut |m| {
            let id = next;
            next += 1;
            ids.insert((m.dev(), m.ino()), id);
            id
        })?;
        let md = std::fs::metadata(root)?;
        st.push(Active {
            token,
            root: (md.dev(), md.ino()),
            ids,
            next,
            base,
            ops: Vec::new(),
        });
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        Ok(Recording {
            token,
            root: root.to_owned(),
        })
    }

    /// The recorded root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Operations recorded so far.
    pub fn len(&self) -> usize {
        lock(&STATE)
            .iter()
            .find(|a| a.token == self.token)
            .map_or(0, |a| a.ops.len())
    }

    /// Whether nothing was recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stop recording and return the log.
    pub fn finish(self) -> Log {
        let a = self.take().expect("an active recording is registered");
        Log {
            base: a.base,
            ops: a.ops,
        }
    }

    fn take(&self) -> Option<Active> {
        let mut st = lock(&STATE);
        let i = st.iter().position(|a| a.token == self.token)?;
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
        Some(st.swap_remove(i))
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let _ = self.take();
    }
}

fn key_of(st: &rustix::fs::Stat) -> Key {
    (st.st_dev, st.st_ino)
}

fn key_path(p: &Path, follow: bool) -> Option<Key> {
    let st = if follow {
        rustix::fs::stat(p)
    } else {
        rustix::fs::lstat(p)
    };
    st.ok().map(|s| key_of(&s))
}

fn key_fd(fd: BorrowedFd<'_>) -> Option<Key> {
    rustix::fs::fstat(fd).ok().map(|s| key_of(&s))
}

fn key_at(dir: BorrowedFd<'_>, name: &str) -> Option<(Key, bool)> {
    rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .ok()
        .map(|s| (key_of(&s), s.st_mode & libc::S_IFMT == libc::S_IFDIR))
}

fn parent_of(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    }
}

fn name_of(p: &Path) -> Option<String> {
    p.file_name()?.to_str().map(str::to_owned)
}

/// The recording that tracks `k`, and `k`'s id there.
fn find(st: &mut [Active], k: Key) -> Option<(&mut Active, Id)> {
    st.iter_mut()
        .find_map(|a| a.ids.get(&k).copied().map(|id| (a, id)))
}

fn record_new(st: &mut [Active], parent: Option<Key>, k: Option<Key>, name: String, dir: bool) {
    let (Some(pk), Some(k)) = (parent, k) else {
        return;
    };
    // A new inode: a number another recording saw before belongs to this file now (inode
    // numbers are reused once freed, on every root of the filesystem).
    for a in st.iter_mut() {
        a.ids.remove(&k);
    }
    if let Some((a, parent)) = find(st, pk) {
        let id = a.track(k);
        a.ops.push(if dir {
            Op::Mkdir { parent, name, id }
        } else {
            Op::Create { parent, name, id }
        });
    }
}

fn record_removed(st: &mut [Active], parent: Option<Key>, k: Key, name: String, dir: bool) {
    let Some(pk) = parent else { return };
    if let Some((a, parent)) = find(st, pk)
        && let Some(id) = a.ids.remove(&k)
    {
        a.ops.push(if dir {
            Op::Rmdir { parent, name, id }
        } else {
            Op::Unlink { parent, name, id }
        });
    }
}

/// Create `path` (a directory when `dir`) with `f`; recorded when `f` created it.
fn create_path<T, E>(path: &Path, dir: bool, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let existed = key_path(path, false).is_some();
    let r = f();
    if r.is_ok()
        && !existed
        && let Some(name) = name_of(path)
    {
        let parent = key_path(&parent_of(path), true);
        record_new(&mut st, parent, key_path(path, false), name, dir);
    }
    r
}

/// Create `name` in `dir` (a directory when `is_dir`) with `f`; recorded when `f`
/// created it.
fn create_at<T, E>(
    dir: BorrowedFd<'_>,
    name: &str,
    is_dir: bool,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let existed = key_at(dir, name).is_some();
    let r = f();
    if r.is_ok() && !existed {
        let k = key_at(dir, name).map(|(k, _)| k);
        record_new(&mut st, key_fd(dir), k, name.to_owned(), is_dir);
    }
    r
}

/// Remove the entry `path` (file or empty directory) with `f`; recorded when it did.
fn remove_path<T, E>(path: &Path, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let before = rustix::fs::lstat(path).ok();
    let r = f();
    if r.is_ok()
        && let (Some(s), Some(name)) = (before, name_of(path))
    {
        let dir = s.st_mode & libc::S_IFMT == libc::S_IFDIR;
        let parent = key_path(&parent_of(path), true);
        record_removed(&mut st, parent, key_of(&s), name, dir);
    }
    r
}

/// Remove the entry `name` of `dir` with `f`; recorded when it did.
fn remove_at<T, E>(
    dir: BorrowedFd<'_>,
    name: &str,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let before = key_at(dir, name);
    let r = f();
    if r.is_ok()
        && let Some((k, is_dir)) = before
    {
        record_removed(&mut st, key_fd(dir), k, name.to_owned(), is_dir);
    }
    r
}

/// Remove the tree `path` with `f` (which does not follow links); every entry it removed
/// is recorded, children before their directory.
fn remove_tree<T, E>(path: &Path, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    // (parent, entry, name, is_dir), children first.
    let mut entries = Vec::new();
    fn walk(p: &Path, parent: Option<Key>, out: &mut Vec<(Option<Key>, Key, PathBuf, bool)>) {
        let Ok(s) = rustix::fs::lstat(p) else { return };
        let is_dir = s.st_mode & libc::S_IFMT == libc::S_IFDIR;
        if is_dir && let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                walk(&e.path(), Some(key_of(&s)), out);
            }
        }
        out.push((parent, key_of(&s), p.to_owned(), is_dir));
    }
    walk(path, key_path(&parent_of(path), true), &mut entries);
    let r = f();
    for (parent, k, p, is_dir) in entries {
        if rustix::fs::lstat(&p).is_ok_and(|s| key_of(&s) == k) {
            continue; // still there (f failed before it)
        }
        if let Some(name) = name_of(&p) {
            record_removed(&mut st, parent, k, name, is_dir);
        }
    }
    r
}

/// Rename `from` to `to` with `f`; recorded when it did.
fn rename<T, E>(from: &Path, to: &Path, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let before = key_path(from, false);
    let r = f();
    if r.is_ok()
        && let (Some(k), Some(from_name), Some(to_name)) = (before, name_of(from), name_of(to))
        && let (Some(fp), Some(tp)) = (
            key_path(&parent_of(from), true),
            key_path(&parent_of(to), true),
        )
        && let Some((a, from_parent)) = find(&mut st, fp)
        && let (Some(&to_parent), Some(&id)) = (a.ids.get(&tp), a.ids.get(&k))
    {
        a.ops.push(Op::Rename {
            from_parent,
            from: from_name,
            to_parent,
            to: to_name,
            id,
        });
    }
    r
}

fn record_fd(fd: BorrowedFd<'_>, st: &mut [Active], op: impl FnOnce(Id) -> Op) {
    if let Some(k) = key_fd(fd)
        && let Some((a, id)) = find(st, k)
    {
        a.ops.push(op(id));
    }
}

/// `fsync` (`data_only`: `fdatasync`) of `fd` with `f`; recorded when it succeeded.
fn sync_fd<T, E>(
    fd: BorrowedFd<'_>,
    data_only: bool,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let r = f();
    if r.is_ok() {
        record_fd(fd, &mut st, |id| {
            if data_only {
                Op::Fdatasync { id }
            } else {
                Op::Fsync { id }
            }
        });
    }
    r
}

/// `ftruncate(fd, len)` with `f`; recorded when it succeeded.
fn truncate_fd<T, E>(
    fd: BorrowedFd<'_>,
    len: u64,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let r = f();
    if r.is_ok() {
        record_fd(fd, &mut st, |id| Op::Truncate { id, len });
    }
    r
}

/// `fallocate(fd, 0, offset, len)` with `f`; recorded when it succeeded.
fn fallocate_fd<T, E>(
    fd: BorrowedFd<'_>,
    offset: u64,
    len: u64,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let r = f();
    if r.is_ok() {
        record_fd(fd, &mut st, |id| Op::Fallocate { id, offset, len });
    }
    r
}

/// Write all of `data` at `offset` of `fd` with `f`; recorded when it succeeded.
fn write_fd<T, E>(
    fd: BorrowedFd<'_>,
    offset: u64,
    data: &[u8],
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let Some(mut st) = guard() else { return f() };
    let r = f();
    if r.is_ok() {
        record_fd(fd, &mut st, |id| Op::Write {
            id,
            offset,
            data: Arc::from(data),
        });
    }
    r
}

/// A write that a backend completed: `data` reached `fd` at `offset`.
fn written(fd: BorrowedFd<'_>, offset: u64, data: &[u8]) {
    if let Some(mut st) = guard() {
        record_fd(fd, &mut st, |id| Op::Write {
            id,
            offset,
            data: Arc::from(data),
        });
    }
}

/// The engine reports `step` of `root` committed to its caller: recorded, in order with
/// the operations, when `root` is being recorded. Tests call it for reports the engine
/// does not make itself (a recovery's report).
pub fn committed(root: &Path, step: u64) {
    let Some(mut st) = guard() else { return };
    let Some(k) = key_path(root, true) else {
        return;
    };
    if let Some(a) = st.iter_mut().find(|a| a.root == k) {
        a.ops.push(Op::Committed { step });
    }
}
