//! Two writers of one step on one bucket prefix (a restarted job whose previous instance
//! is still uploading): no upload ever completes over an object a committed manifest
//! names, and only the writer whose manifest is in the bucket is told "committed"; and
//! steps written before uploads were named apart still load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use super::tests::{multipart_wrapper, objects, small, state, tensors};
use super::*;
use crate::Tensor;

/// Holds every upload at its start (after the uploader checked the step is not
/// committed) until `open` is set, and says when one got there.
#[derive(Debug)]
struct Held {
    inner: Arc<InMemory>,
    open: Arc<AtomicBool>,
    reached: Arc<AtomicBool>,
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Held({})", self.inner)
    }
}

multipart_wrapper!(Held, |this, location, opts| {
    this.reached.store(true, Ordering::SeqCst);
    while !this.open.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    this.inner.put_multipart_opts(location, opts).await
});

fn bytes_of(ck: &crate::restore::Checkpoint) -> Vec<(String, Vec<u8>)> {
    ck.tensors
        .iter()
        .map(|t| (t.name.clone(), t.data.as_bytes().to_vec()))
        .collect()
}

fn expected(s: &[(String, Vec<u8>, Vec<usize>)]) -> Vec<(String, Vec<u8>)> {
    s.iter().map(|(n, d, _)| (n.clone(), d.clone())).collect()
}

/// B (the old instance) passed its "not committed yet" check and is uploading; A commits
/// the step; then B's upload completes. B's object is its own: A's committed step keeps
/// its bytes, and B's `wait` is a `RemoteConflict`, not a success.
#[test]
fn a_second_writer_never_replaces_a_committed_object_and_is_told_so() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mem = Arc::new(InMemory::new());
    let open = Arc::new(AtomicBool::new(false));
    let reached = Arc::new(AtomicBool::new(false));
    let held = Arc::new(Held {
        inner: Arc::clone(&mem),
        open: Arc::clone(&open),
        reached: Arc::clone(&reached),
    });
    let b = small(db.path(), held)
        .with_session(Some("B".into()))
        .build()
        .unwrap();
    let a = small(da.path(), mem.clone())
        .with_session(Some("A".into()))
        .build()
        .unwrap();
    // B's state is larger: were its object completed over A's, A's manifest would read
    // trailing bytes.
    let (sa, sb) = (state(1), state(2));
    let tb: Vec<Tensor<'_>> = tensors(&sb);
    let hb = b.save(1, &tb, &Metadata::new()).unwrap();
    let pb = hb.remote().unwrap();
    hb.wait().unwrap();
    let t = std::time::Instant::now();
    while !reached.load(Ordering::SeqCst) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "B's upload never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let ta: Vec<Tensor<'_>> = tensors(&sa)[..3].to_vec();
    let ha = a.save(1, &ta, &Metadata::new()).unwrap();
    let pa = ha.remote().unwrap();
    ha.wait().unwrap();
    let ra = pa.wait().unwrap();
    assert!(ra.committed_here);
    open.store(true, Ordering::SeqCst);
    match pb.wait() {
        Err(Error::RemoteConflict { step, url, reason }) => {
            assert_eq!((step, url.as_str()), (1, "Held(InMemory)/run1"));
            assert!(reason.contains("names object"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // The bucket's step 1 is A's, byte for byte; B's object lies beside it, unnamed.
    let r = a.remote().unwrap();
    let (ck, _) = r.load(1, 0).unwrap();
    assert_eq!(bytes_of(&ck), expected(&sa[..3]));
    assert_eq!(r.verify(1).unwrap(), ra.bytes);
    let objs: Vec<String> = objects(&mem)
        .into_iter()
        .filter(|k| k.starts_with("run1/step-1/rank-00000-of-00001."))
        .collect();
    assert_eq!(objs.len(), 2, "{objs:?}");
    // gc removes B's object (not named by the committed step), when old enough.
    let named = format!(
        "run1/step-1/{}",
        r.manifest(1).unwrap().files[0].object_name()
    );
    let stray = objs.iter().find(|k| **k != named).unwrap().clone();
    assert!(
        r.gc(Duration::from_secs(3600))
            .unwrap()
            .stray_objects
            .is_empty()
    );
    let rep = r.gc(Duration::ZERO).unwrap();
    assert_eq!(rep.stray_objects, vec![format!("InMemory/{stray}")]);
    assert_eq!(
        objects(&mem)
            .into_iter()
            .filter(|k| k.starts_with("run1/step-1/"))
            .collect::<Vec<_>>(),
        vec![
            "run1/step-1/manifest.json".to_owned(),
            named,
            "run1/step-1/rank-00000.manifest.json".to_owned()
        ]
    );
    let (ck, _) = r.load(1, 0).unwrap();
    assert_eq!(bytes_of(&ck), expected(&sa[..3]));
    a.close();
    b.close();
}

/// Both writers' objects complete before either commits, B's manifest part last: A is
/// refused (its part was replaced), B commits, and the step holds B's bytes.
#[test]
fn of_two_uploads_only_the_one_whose_part_is_in_the_bucket_commits() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mem = Arc::new(InMemory::new());
    let r =
        Remote::with_store(mem.clone(), "run1", "mem://run1", RemoteOptions::default()).unwrap();
    let (sa, sb) = (state(3), state(4));
    let mut entries = Vec::new();
    for (d, s) in [(&da, &sa), (&db, &sb)] {
        // A local checkpoint to upload from.
        let e = crate::EngineConfig::new(d.path())
            .with_staging_capacity(16 << 20)
            .with_chunk_size(1 << 20)
            .with_direct_io(false)
            .build()
            .unwrap();
        e.save(1, &tensors(s), &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
        let m = e.manifest(1).unwrap();
        e.close();
        entries.push((d.path().join("step-1"), m));
    }
    let mut mine = Vec::new();
    for (dir, m) in &entries {
        let f = std::fs::File::open(dir.join(&m.files[0].file)).unwrap();
        mine.push(r.upload_rank_entry(1, &f, &m.files[0], None).unwrap());
    }
    assert_ne!(mine[0].object, mine[1].object);
    let md = Metadata::new();
    match r.commit_step(1, 1, &md, Committer::Rank(&mine[0])) {
        Err(Error::RemoteConflict {
            step: 1, reason, ..
        }) => {
            assert!(reason.contains("manifest part"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let (m, created) = r
        .commit_step(1, 1, &md, Committer::Rank(&mine[1]))
        .unwrap()
        .unwrap();
    assert!(created);
    assert_eq!(m.files[0].object, mine[1].object);
    // A, asking again, is still refused: the manifest names B's object.
    assert!(matches!(
        r.commit_step(1, 1, &md, Committer::Rank(&mine[0])),
        Err(Error::RemoteConflict { step: 1, .. })
    ));
    let (ck, _) = r.load(1, 0).unwrap();
    assert_eq!(bytes_of(&ck), expected(&sb));
}

/// A step committed before uploads were named apart (its object at `step-N/<file>`, no
/// `object` in its manifest) still lists, loads and verifies.
#[test]
fn a_step_of_the_earlier_layout_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = small(dir.path(), mem.clone()).build().unwrap();
    let s = state(5);
    let h = engine.save(1, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    let bytes = p.wait().unwrap().bytes;
    engine.close();
    // Rewrite it as the earlier layout wrote it.
    let rt = runtime().unwrap();
    let r =
        Remote::with_store(mem.clone(), "run1", "mem://run1", RemoteOptions::default()).unwrap();
    let mut m = r.manifest(1).unwrap();
    let object = m.files[0].object.take().unwrap();
    rt.block_on(async {
        let from = ObjPath::from(format!("run1/step-1/{object}"));
        let to = ObjPath::from(format!("run1/step-1/{}", m.files[0].file));
        mem.rename(&from, &to).await.unwrap();
        let body = serde_json::to_vec(&m).unwrap();
        assert!(!String::from_utf8_lossy(&body).contains("\"object\""));
        mem.put(&ObjPath::from("run1/step-1/manifest.json"), body.into())
            .await
            .unwrap();
    });
    assert_eq!(
        objects(&mem),
        vec![
            "run1/step-1/manifest.json",
            "run1/step-1/rank-00000-of-00001.safetensors",
            "run1/step-1/rank-00000.manifest.json",
        ]
    );
    assert_eq!(r.list().unwrap(), vec![1]);
    let (ck, _) = r.load(1, 0).unwrap();
    assert_eq!(bytes_of(&ck), expected(&s));
    assert_eq!(r.verify(1).unwrap(), bytes);
}

/// Two ranks, no session: writer A's rank 0 uploads and waits for rank 1; writer B's rank
/// 0 then uploads the same step (its manifest part replaces A's); A's rank 1 commits the
/// step, over B's rank-0 object. A's rank 0, waiting for the manifest, is told
/// `RemoteConflict`, not "committed"; B's rank 0, whose object the manifest names, is.
#[test]
fn a_rank_waiting_for_the_commit_is_told_when_it_names_another_writers_object() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let mem = Arc::new(InMemory::new());
    let engine = |d: &tempfile::TempDir, rank: u32| {
        small(d.path(), mem.clone())
            .with_rank(rank, 2)
            .build()
            .unwrap()
    };
    let done = |p: &RemoteProgress| {
        let t = std::time::Instant::now();
        while !p.is_done() {
            assert!(t.elapsed() < Duration::from_secs(60), "upload never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let s = state(6);
    let t = tensors(&s);
    let (a0, b0, a1) = (
        engine(&dirs[0], 0),
        engine(&dirs[1], 0),
        engine(&dirs[2], 1),
    );
    let save = |e: &crate::Engine| {
        let h = e.save(1, &t, &Metadata::new()).unwrap();
        let p = h.remote().unwrap();
        h.wait().unwrap();
        done(&p);
        p
    };
    let pa0 = save(&a0);
    let pb0 = save(&b0);
    let pa1 = save(&a1);
    assert!(pa1.wait().unwrap().committed_here);
    match pa0.wait() {
        Err(Error::RemoteConflict {
            step: 1, reason, ..
        }) => {
            assert!(reason.contains("names object"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!pb0.wait().unwrap().committed_here);
    for e in [a0, b0, a1] {
        e.close();
    }
}
