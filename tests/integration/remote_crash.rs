//! The object-storage tier under a crash (issue 28, item 5): every run of saves is
//! recorded against an in-memory bucket (`object_store`'s `InMemory`) through a wrapper
//! that counts the requests that change the bucket (each multipart part, each multipart
//! completion, each put, each delete) and "crashes" at the `k`-th: that request and every
//! later one (reads included) fail, and the trainer stops saving, as a killed trainer
//! would. Every `k` from 0 to the number of mutations of an uncrashed run is run. Then a
//! restarted trainer looks at the bucket through the remote tier's own list, load, verify
//! and gc, saves the next step with a new session, and the invariants are checked.
//!
//! Requests that only read change nothing in the bucket, so a crash before a read is the
//! same bucket state as a crash before the next mutation; a crash after a mutation and
//! before its answer leaves the state of a crash before the next one with fewer reports.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult, UploadPart,
};
use shmckpt::remote::{Remote, RemoteOptions};
use shmckpt::{BackendKind, Dtype, LoadSource, Metadata, StepSel};
use shmckpt_bench::synthetic::LayoutEntry;

use crate::common::{State, load_with_report, real_dir, small_config};

/// The crash switch shared by the wrapper and its multipart uploads.
#[derive(Debug, Default)]
struct Ctl {
    /// Mutations let through so far.
    done: usize,
    /// Crash at this mutation (`None`: never).
    limit: Option<usize>,
    crashed: bool,
    /// What each mutation let through was, in order (for failure messages).
    log: Vec<String>,
}

type Shared = Arc<Mutex<Ctl>>;

fn crashed_err() -> object_store::Error {
    object_store::Error::Generic {
        store: "CrashStore",
        source: "the trainer crashed (simulated)".into(),
    }
}

/// Let mutation `what` through, or crash.
fn admit(ctl: &Shared, what: impl FnOnce() -> String) -> object_store::Result<()> {
    let mut c = ctl.lock().unwrap();
    if c.crashed {
        return Err(crashed_err());
    }
    if c.limit == Some(c.done) {
        c.crashed = true;
        return Err(crashed_err());
    }
    c.done += 1;
    c.log.push(what());
    Ok(())
}

fn alive(ctl: &Shared) -> object_store::Result<()> {
    if ctl.lock().unwrap().crashed {
        Err(crashed_err())
    } else {
        Ok(())
    }
}

/// An `ObjectStore` that forwards to `inner` until the crash.
#[derive(Debug)]
struct CrashStore {
    inner: Arc<InMemory>,
    ctl: Shared,
}

impl fmt::Display for CrashStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CrashStore({})", self.inner)
    }
}

#[derive(Debug)]
struct CrashUpload {
    inner: Box<dyn MultipartUpload>,
    ctl: Shared,
    location: String,
    parts: usize,
}

#[async_trait]
impl MultipartUpload for CrashUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        let n = self.parts;
        self.parts += 1;
        let loc = &self.location;
        match admit(&self.ctl, || format!("part {n} of {loc}")) {
            Ok(()) => self.inner.put_part(data),
            Err(e) => Box::pin(futures::future::ready(Err(e))),
        }
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        let loc = &self.location;
        admit(&self.ctl, || format!("complete {loc}"))?;
        self.inner.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        alive(&self.ctl)?;
        self.inner.abort().await
    }
}

#[async_trait]
impl ObjectStore for CrashStore {
    async fn put_opts(
        &self,
        location: &ObjPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        admit(&self.ctl, || format!("put {location} ({:?})", opts.mode))?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        // Creating an upload changes nothing a listing or a read can see.
        alive(&self.ctl)?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(CrashUpload {
            inner,
            ctl: Arc::clone(&self.ctl),
            location: location.to_string(),
            parts: 0,
        }))
    }

    async fn get_opts(
        &self,
        location: &ObjPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        alive(&self.ctl)?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &ObjPath,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<bytes::Bytes>> {
        alive(&self.ctl)?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjPath>> {
        let ctl = Arc::clone(&self.ctl);
        let inner = Arc::clone(&self.inner);
        locations
            .then(move |p| {
                let ctl = Arc::clone(&ctl);
                let inner = Arc::clone(&inner);
                async move {
                    let p = p?;
                    admit(&ctl, || format!("delete {p}"))?;
                    inner.delete(&p).await?;
                    Ok(p)
                }
            })
            .boxed()
    }

    fn list(
        &self,
        prefix: Option<&ObjPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        match alive(&self.ctl) {
            Ok(()) => self.inner.list(prefix),
            Err(e) => futures::stream::once(futures::future::ready(Err(e))).boxed(),
        }
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjPath>,
    ) -> object_store::Result<ListResult> {
        alive(&self.ctl)?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjPath,
        to: &ObjPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        admit(&self.ctl, || format!("copy {from} to {to}"))?;
        self.inner.copy_opts(from, to, options).await
    }
}

/// Two 5 MiB parts per rank object (the smallest part S3 takes), the last one short.
fn layout() -> Vec<LayoutEntry> {
    vec![
        LayoutEntry {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![64, 257],
        },
        LayoutEntry {
            name: "big".into(),
            dtype: Dtype::U8,
            shape: vec![(5 << 20) + 123_457],
        },
    ]
}

/// The bytes rank `rank` saves as `step` (made once: every crash point saves them again).
fn state(step: u64, rank: u32) -> Arc<State> {
    static MADE: Mutex<BTreeMap<(u64, u32), Arc<State>>> = Mutex::new(BTreeMap::new());
    let mut g = MADE.lock().unwrap();
    Arc::clone(g.entry((step, rank)).or_insert_with(|| {
        Arc::new(State::new(
            layout(),
            0xc0de_0000 + step * 16 + u64::from(rank),
        ))
    }))
}

fn opts() -> RemoteOptions {
    RemoteOptions {
        part_size: 5 << 20,
        concurrency: 2,
        retries: 0,
        ..RemoteOptions::default()
    }
}

const KEEP: usize = 2;

/// What a (possibly crashed) run did.
struct Run {
    /// Steps whose remote commit some rank's `RemoteProgress` reported.
    reported: BTreeSet<u64>,
    mutations: usize,
    crashed: bool,
    log: Vec<String>,
}

/// Save `steps` with `world` ranks (one engine each, each with its own local root, in
/// parallel), each save waited for until its remote copy reports; stop at the crash.
fn run(bucket: &Arc<InMemory>, world: u32, steps: u64, limit: Option<usize>) -> Run {
    let ctl: Shared = Arc::new(Mutex::new(Ctl {
        limit,
        ..Ctl::default()
    }));
    let store: Arc<dyn ObjectStore> = Arc::new(CrashStore {
        inner: Arc::clone(bucket),
        ctl: Arc::clone(&ctl),
    });
    let reported = Mutex::new(BTreeSet::new());
    std::thread::scope(|sc| {
        for rank in 0..world {
            let store = Arc::clone(&store);
            let (ctl, reported) = (&ctl, &reported);
            sc.spawn(move || {
                let dir = real_dir("remote-crash");
                let engine = small_config(dir.path(), BackendKind::Pwrite)
                    .with_rank(rank, world)
                    .with_remote_store(store, "job")
                    .with_remote_options(opts())
                    .with_remote_keep_last(Some(KEEP))
                    .with_session(Some("run-1".into()))
                    .build()
                    .unwrap();
                for step in 1..=steps {
                    if ctl.lock().unwrap().crashed {
                        break; // the trainer is dead
                    }
                    let s = state(step, rank);
                    let h = engine.save(step, &s.tensors(), &Metadata::new()).unwrap();
                    let p = h.remote().expect("a remote tier");
                    h.wait().unwrap();
                    match p.wait() {
                        Ok(rep) => {
                            assert_eq!(rep.step, step);
                            reported.lock().unwrap().insert(step);
                        }
                        Err(e) => {
                            assert!(
                                ctl.lock().unwrap().crashed,
                                "rank {rank} step {step}: remote copy failed without a crash: {e}"
                            );
                            break;
                        }
                    }
                }
                engine.close();
            });
        }
    });
    let c = ctl.lock().unwrap();
    Run {
        reported: reported.into_inner().unwrap(),
        mutations: c.done,
        crashed: c.crashed,
        log: c.log.clone(),
    }
}

/// Every object in the bucket, as `step-N/name` strings, each upload's rank object
/// (`rank-R-of-W.<upload id>.safetensors`) under its file's name.
fn objects(remote_store: &Arc<InMemory>) -> BTreeSet<String> {
    let names: Vec<String> = futures::executor::block_on(async {
        remote_store
            .list(None)
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await
            .unwrap()
    });
    let canonical = |k: String| -> String {
        let Some((dir, name)) = k.rsplit_once('/') else {
            return k;
        };
        match name
            .strip_suffix(".safetensors")
            .and_then(|n| n.rsplit_once('.'))
        {
            Some((stem, id)) if id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) => {
                format!("{dir}/{stem}.safetensors")
            }
            _ => k,
        }
    };
    let n = names.len();
    let set: BTreeSet<String> = names.into_iter().map(canonical).collect();
    assert_eq!(
        set.len(),
        n,
        "two objects of one rank file in one step: {set:?}"
    );
    set
}

/// The objects of a committed step of `world` ranks.
fn full_step(step: u64, world: u32) -> BTreeSet<String> {
    let mut s = BTreeSet::from([format!("job/step-{step}/manifest.json")]);
    for r in 0..world {
        s.insert(format!(
            "job/step-{step}/{}",
            shmckpt::manifest::rank_file_name(r, world)
        ));
        s.insert(format!(
            "job/step-{step}/{}",
            shmckpt::manifest::rank_manifest_name(r)
        ));
    }
    s
}

fn assert_exact(ck: &shmckpt::Checkpoint, s: &State, what: &str) {
    assert_eq!(ck.tensors.len(), s.layout.len(), "{what}");
    for (e, d) in s.layout.iter().zip(&s.data) {
        let t = ck
            .get(&e.name)
            .unwrap_or_else(|| panic!("{what}: {} missing", e.name));
        assert!(t.data.as_bytes() == &d[..], "{what}: {} differs", e.name);
    }
}

/// The restarted trainer's view of the bucket after a crash at mutation `k`.
fn check(bucket: &Arc<InMemory>, world: u32, steps: u64, k: usize, r: &Run) {
    let ctx = || {
        format!(
            "world {world}, crash at mutation {k} (after: {:?})",
            r.log.last()
        )
    };
    let remote = Remote::with_store(
        Arc::clone(bucket) as Arc<dyn ObjectStore>,
        "job",
        "mem://job",
        opts(),
    )
    .unwrap();
    let listed = remote.list().unwrap();
    // Only complete, exact steps are listed.
    for &s in &listed {
        assert!((1..=steps).contains(&s), "{}: step {s} listed", ctx());
        for rank in 0..world {
            let (ck, _) = remote
                .load(s, rank)
                .unwrap_or_else(|e| panic!("{}: step {s} rank {rank}: {e}", ctx()));
            assert_eq!(ck.step, s);
            assert_exact(
                &ck,
                &state(s, rank),
                &format!("{}: step {s} rank {rank}", ctx()),
            );
        }
        remote
            .verify(s)
            .unwrap_or_else(|e| panic!("{}: verify {s}: {e}", ctx()));
    }
    // Every reported step is there, unless retention retired it for newer listed ones.
    for &s in &r.reported {
        if !listed.contains(&s) {
            let newer = listed.iter().filter(|&&l| l > s).count();
            assert!(
                newer >= KEEP,
                "{}: step {s} was reported committed and is gone (listed {listed:?})",
                ctx()
            );
        }
    }
    if let Some(&newest) = r.reported.iter().max() {
        assert!(
            listed.last().is_some_and(|&l| l >= newest),
            "{}: latest {:?} older than reported {newest}",
            ctx(),
            listed.last()
        );
    }
    // A restarted trainer (new local root, new session) loads the latest from the bucket,
    // then saves the next step over whatever the crash left of it.
    let dir = real_dir("remote-crash-restart");
    let restarted: Vec<_> = (0..world)
        .map(|rank| {
            let root = dir.path().join(format!("r{rank}"));
            std::fs::create_dir(&root).unwrap();
            small_config(&root, BackendKind::Pwrite)
                .with_rank(rank, world)
                .with_remote_store(Arc::clone(bucket) as Arc<dyn ObjectStore>, "job")
                .with_remote_options(opts())
                .with_remote_keep_last(Some(KEEP))
                .with_session(Some("run-2".into()))
                .build()
                .unwrap()
        })
        .collect();
    let next = listed.last().copied().unwrap_or(0) + 1;
    if let Some(&latest) = listed.last() {
        let (ck, rep) = load_with_report(&restarted[0], StepSel::Latest).unwrap();
        assert_eq!(
            (ck.step, rep.source),
            (latest, LoadSource::Remote),
            "{}",
            ctx()
        );
        assert_exact(&ck, &state(latest, 0), &ctx());
    }
    // The new run's bytes differ from the crashed run's for the same step.
    let new_state = |rank: u32| state(next + 1000, rank);
    std::thread::scope(|sc| {
        for (rank, e) in restarted.iter().enumerate() {
            sc.spawn(move || {
                let s = new_state(rank as u32);
                let h = e.save(next, &s.tensors(), &Metadata::new()).unwrap();
                let p = h.remote().unwrap();
                h.wait().unwrap();
                p.wait().unwrap();
            });
        }
    });
    for e in restarted {
        e.close();
    }
    let after = remote.list().unwrap();
    let expect: Vec<u64> = {
        let mut v: Vec<u64> = listed.iter().copied().chain([next]).collect();
        let cut = v.len().saturating_sub(KEEP);
        v.drain(..cut);
        v
    };
    assert_eq!(after, expect, "{}: after the restarted save", ctx());
    for rank in 0..world {
        let (ck, _) = remote.load(next, rank).unwrap();
        assert_exact(
            &ck,
            &new_state(rank),
            &format!("{}: restarted step {next}", ctx()),
        );
    }
    // gc removes every object of an uncommitted or half-retired step, nothing else.
    remote.gc(Duration::ZERO).unwrap();
    assert_eq!(remote.list().unwrap(), expect, "{}: gc", ctx());
    let want: BTreeSet<String> = expect.iter().flat_map(|&s| full_step(s, world)).collect();
    assert_eq!(objects(bucket), want, "{}: objects after gc", ctx());
}

/// One run of `steps` saves by `world` ranks crashed at mutation `k`, checked (the chaos
/// soak's bucket faults, `soak.rs`). Panics on a violation.
pub(crate) fn crash_at(world: u32, steps: u64, k: usize) {
    let bucket = Arc::new(InMemory::new());
    let r = run(&bucket, world, steps, Some(k));
    check(&bucket, world, steps, k, &r);
}

/// Crash at every mutation of a run of `steps` saves by `world` ranks; returns the number
/// of crash points checked.
fn every_crash_point(world: u32, steps: u64) -> usize {
    let t = Instant::now();
    let full = run(&Arc::new(InMemory::new()), world, steps, None);
    assert!(!full.crashed);
    assert_eq!(full.reported, (1..=steps).collect::<BTreeSet<_>>());
    let n = full.mutations;
    let mut points = 0;
    let mut k = 0;
    // With several ranks the interleaving (so the count) varies: go on until a run ends
    // without reaching its crash point.
    loop {
        let bucket = Arc::new(InMemory::new());
        let r = run(&bucket, world, steps, Some(k));
        check(&bucket, world, steps, k, &r);
        points += 1;
        if !r.crashed {
            break;
        }
        k += 1;
    }
    eprintln!(
        "remote crash harness: {world} rank(s), {steps} saves, keep {KEEP}: {n} mutations in the uncrashed run, {points} crash points checked in {:.1?}",
        t.elapsed()
    );
    assert!(
        points > n / 2 && points > 10,
        "{points} crash points for {n} mutations"
    );
    points
}

#[test]
fn one_rank_bucket_survives_a_crash_at_every_request() {
    every_crash_point(1, 4);
}

#[test]
fn two_rank_bucket_survives_a_crash_at_every_request() {
    every_crash_point(2, 3);
}
