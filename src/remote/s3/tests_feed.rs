//! Uploads fed from the staging arena, chunks given back under staging pressure, remote
//! only without a file, and the journal of multipart uploads that `gc` aborts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use super::tests::{multipart_wrapper, objects, rank_object, small, state, tensors};
use super::*;
use crate::EngineConfig;

/// Holds every multipart upload at its start until `open` is set (an uploader that is
/// behind), over `InMemory`.
#[derive(Debug)]
struct Gate {
    inner: Arc<InMemory>,
    open: Arc<AtomicBool>,
    /// Through [`MultipartStore`]: fail the part of this index (0-based), if set.
    fail_part: Option<usize>,
}

#[async_trait::async_trait]
impl MultipartStore for Gate {
    async fn create_multipart(&self, path: &ObjPath) -> object_store::Result<String> {
        self.inner.create_multipart(path).await
    }
    async fn put_part(
        &self,
        path: &ObjPath,
        id: &String,
        part_idx: usize,
        data: PutPayload,
    ) -> object_store::Result<object_store::multipart::PartId> {
        if self.fail_part == Some(part_idx) {
            return Err(object_store::Error::Generic {
                store: "Gate",
                source: format!("injected failure of part {part_idx}").into(),
            });
        }
        self.inner.put_part(path, id, part_idx, data).await
    }
    async fn complete_multipart(
        &self,
        path: &ObjPath,
        id: &String,
        parts: Vec<object_store::multipart::PartId>,
    ) -> object_store::Result<PutResult> {
        self.inner.complete_multipart(path, id, parts).await
    }
    async fn abort_multipart(&self, path: &ObjPath, id: &String) -> object_store::Result<()> {
        self.inner.abort_multipart(path, id).await
    }
}

impl Gate {
    /// A gate over `mem` that holds every upload until the returned flag is set.
    fn held(mem: &Arc<InMemory>) -> (Arc<Gate>, Arc<AtomicBool>) {
        let open = Arc::new(AtomicBool::new(false));
        let gate = Gate {
            inner: Arc::clone(mem),
            open: Arc::clone(&open),
            fail_part: None,
        };
        (Arc::new(gate), open)
    }
}

impl std::fmt::Display for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gate({})", self.inner)
    }
}

multipart_wrapper!(Gate, |this, location, opts| {
    // Runs on the uploader's own thread (inside its `block_on`): blocking it is the point.
    while !this.open.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    this.inner.put_multipart_opts(location, opts).await
});

fn object(mem: &InMemory, key: &str) -> Vec<u8> {
    let rt = runtime().unwrap();
    rt.block_on(async { mem.get(&ObjPath::from(key)).await.unwrap().bytes().await })
        .unwrap()
        .to_vec()
}

const RANK_FILE: &str = "rank-00000-of-00001.safetensors";

/// The upload reads the staged chunks, not the local file: the committed file is
/// overwritten with zeros before the (held back) upload starts, and the bucket still gets
/// the checkpoint's bytes.
#[test]
fn the_upload_comes_from_the_staging_arena_not_the_local_file() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let (gate, open) = Gate::held(&mem);
    let engine = small(dir.path(), gate).build().unwrap();
    let s = state(11);
    let h = engine.save(3, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    let local = h.wait().unwrap();
    let path = dir.path().join("step-3").join(RANK_FILE);
    let good = std::fs::read(&path).unwrap();
    assert_eq!(good.len() as u64, local.bytes);
    // Same inode (the uploader holds it open): zeros in place.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| std::os::unix::fs::FileExt::write_all_at(&f, &vec![0u8; good.len()], 0))
        .unwrap();
    open.store(true, Ordering::SeqCst);
    let rep = p.wait().unwrap();
    assert_eq!(rep.read_from_file, 0);
    assert_eq!(
        object(&mem, &rank_object(&mem, "run1/step-3", RANK_FILE)),
        good
    );
    assert_eq!(engine.remote().unwrap().verify(3).unwrap(), local.bytes);
    engine.close();
}

/// A save that needs the staging chunks an earlier save's upload still holds does not
/// wait for the bucket: the held chunks are given back and that upload reads the rest
/// from its local file. Both steps reach the bucket byte for byte.
#[test]
fn staging_pressure_gives_held_chunks_back_to_the_next_save() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let (gate, open) = Gate::held(&mem);
    // 16 MiB of staging, two saves of 11 MiB: the second needs chunks the first's upload
    // holds while the bucket is held back.
    let engine = small(dir.path(), gate).build().unwrap();
    // A safety valve, so a regression hangs for 60 s and fails instead of hanging forever.
    let valve = {
        let open = Arc::clone(&open);
        let fired = Arc::new(AtomicBool::new(false));
        let f = Arc::clone(&fired);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(60));
            if !open.swap(true, Ordering::SeqCst) {
                f.store(true, Ordering::SeqCst);
            }
        });
        fired
    };
    let (s1, s2) = (state(21), state(22));
    let h1 = engine.save(1, &tensors(&s1), &Metadata::new()).unwrap();
    let p1 = h1.remote().unwrap();
    h1.wait().unwrap();
    let h2 = engine.save(2, &tensors(&s2), &Metadata::new()).unwrap();
    let p2 = h2.remote().unwrap();
    h2.wait().unwrap();
    // Both saves staged and committed locally while the bucket was still held back.
    assert!(
        !valve.load(Ordering::SeqCst),
        "the second save waited for the bucket"
    );
    assert!(!open.load(Ordering::SeqCst));
    let f1 = std::fs::read(dir.path().join("step-1").join(RANK_FILE)).unwrap();
    let f2 = std::fs::read(dir.path().join("step-2").join(RANK_FILE)).unwrap();
    open.store(true, Ordering::SeqCst);
    let r1 = p1.wait().unwrap();
    let r2 = p2.wait().unwrap();
    // Step 1's chunks were all given back: its upload read the file.
    assert_eq!(r1.read_from_file, r1.bytes);
    assert_eq!(r2.bytes, f2.len() as u64);
    assert_eq!(
        object(&mem, &rank_object(&mem, "run1/step-1", RANK_FILE)),
        f1
    );
    assert_eq!(
        object(&mem, &rank_object(&mem, "run1/step-2", RANK_FILE)),
        f2
    );
    assert_eq!(engine.list_remote().unwrap(), vec![1, 2]);
    engine.close();
}

/// Remote only writes no file: the root holds only the engine's lock, and the bucket
/// gets the checkpoint (checked by loading it back, every CRC verified).
#[test]
fn remote_only_writes_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = small(dir.path(), mem.clone())
        .with_remote_only(true)
        .build()
        .unwrap();
    let s = state(31);
    // Back to back: 16 MiB of staging holds one 11 MiB save, so the second save's staging
    // waits for the chunks the first one's upload releases (the only drain).
    let hs: Vec<_> = [1, 2]
        .into_iter()
        .map(|step| engine.save(step, &tensors(&s), &Metadata::new()).unwrap())
        .collect();
    for h in hs {
        let p = h.remote().unwrap();
        let local = h.wait().unwrap();
        assert_eq!(local.dir, None);
        let rep = p.wait().unwrap();
        assert_eq!(rep.bytes, local.bytes);
        assert_eq!(rep.read_from_file, 0);
    }
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec![".shmckpt-rank-0.lock"]);
    assert_eq!(engine.list_remote().unwrap(), vec![1, 2]);
    let (ck, _) = engine.load_remote(2).unwrap();
    for (t, (_, d, _)) in ck.tensors.iter().zip(&s) {
        assert_eq!(t.data.as_bytes(), &d[..], "tensor {}", t.name);
    }
    engine.close();
}

/// Every multipart upload is journaled while open; a completed one leaves no journal, and
/// `gc` aborts an upload whose process died (its journal remains) and removes the journal.
#[test]
fn gc_aborts_journaled_uploads_a_dead_process_left_open() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(16 << 20)
        .with_chunk_size(1 << 20)
        .with_direct_io(false)
        .with_remote_multipart_store(mem.clone(), "run1")
        .with_remote_options(RemoteOptions {
            part_size: 5 << 20,
            concurrency: 4,
            ..RemoteOptions::default()
        })
        .build()
        .unwrap();
    let s = state(41);
    let h = engine.save(1, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    p.wait().unwrap();
    // Completed: no journal left.
    assert_eq!(
        objects(&mem),
        vec![
            "run1/step-1/manifest.json",
            rank_object(&mem, "run1/step-1", RANK_FILE).as_str(),
            "run1/step-1/rank-00000.manifest.json",
        ]
    );
    engine.close();

    // A process that died mid-upload: the upload was created and journaled, one part sent.
    let r =
        Remote::with_multipart_store(mem.clone(), "run1", "mem://run1", RemoteOptions::default())
            .unwrap();
    let key = ObjPath::from(format!("run1/step-2/{RANK_FILE}"));
    let id = r
        .block(async {
            let mut up = r.begin(&key, 2, 0, Some("sess"), Arc::default()).await?;
            up.put_part(PutPayload::from(vec![7u8; 5 << 20]));
            up.wait_for_capacity(0)
                .await
                .map_err(|e| r.err("part", &e))?;
            // Dropped, neither completed nor aborted: the process died.
            Ok(up.id().expect("InMemory has upload ids"))
        })
        .unwrap();
    let journals: Vec<String> = objects(&mem)
        .into_iter()
        .filter(|o| o.starts_with("run1/.shmckpt/uploads/sess-0-2-"))
        .collect();
    assert_eq!(journals.len(), 1, "{:?}", objects(&mem));
    let open = r.open_uploads().unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!((open[0].step, open[0].rank), (2, 0));
    assert_eq!(open[0].session.as_deref(), Some("sess"));
    // Younger than min_age: an upload in progress, kept.
    assert_eq!(r.gc(Duration::from_secs(3600)).unwrap().aborted_uploads, 0);
    let rep = r.gc(Duration::ZERO).unwrap();
    assert_eq!(rep.aborted_uploads, 1);
    assert!(
        !objects(&mem).iter().any(|o| o.contains(".shmckpt")),
        "{:?}",
        objects(&mem)
    );
    assert_eq!(r.open_uploads().unwrap(), Vec::new());
    // The upload is gone: it can no longer be completed.
    let rt = runtime().unwrap();
    let done = rt.block_on(mem.complete_multipart(&key, &id, Vec::new()));
    assert!(done.is_err(), "{done:?}");
    // And a second gc finds nothing to do; committed step 1 is untouched.
    assert_eq!(r.gc(Duration::ZERO).unwrap(), GcReport::default());
    assert_eq!(r.list().unwrap(), vec![1]);
}

/// A failure of the last part surfaces when the upload completes: the upload is aborted
/// then too, and its journal removed (it stayed open, journal and all, when only failures
/// while sending aborted).
#[test]
fn a_failed_last_part_aborts_the_upload_and_removes_its_journal() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    // 11 MiB in 5 MiB parts: parts 0, 1 and the last, 2, sent when the upload completes.
    let store = Arc::new(Gate {
        inner: mem.clone(),
        open: Arc::new(AtomicBool::new(true)),
        fail_part: Some(2),
    });
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(16 << 20)
        .with_chunk_size(1 << 20)
        .with_direct_io(false)
        .with_remote_multipart_store(store, "run1")
        .with_remote_options(RemoteOptions {
            part_size: 5 << 20,
            concurrency: 4,
            ..RemoteOptions::default()
        })
        .build()
        .unwrap();
    let s = state(51);
    let h = engine.save(1, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    let e = p.wait().unwrap_err();
    assert!(matches!(&e, Error::RemoteFailed { step: 1, .. }), "{e}");
    assert!(e.to_string().contains("injected failure of part 2"), "{e}");
    // Aborted (its journal goes only after a successful abort): nothing in the bucket.
    assert_eq!(objects(&mem), Vec::<String>::new());
    assert_eq!(engine.remote().unwrap().open_uploads().unwrap(), Vec::new());
    engine.close();
}

/// An engine over `mem` (upload ids: journaled) whose local writes follow `plan`.
#[cfg(feature = "fault-injection")]
fn faulty(
    root: &std::path::Path,
    mem: &Arc<InMemory>,
    plan: Vec<crate::io::fault::Rule>,
) -> crate::Engine {
    let faults = Arc::new(crate::io::fault::FaultPlan::new());
    for r in plan {
        faults.add(r);
    }
    small(root, mem.clone())
        .with_remote_multipart_store(mem.clone(), "run1")
        // One write at a time: a held-back write holds back no other chunk's completion.
        .with_queue_depth(1)
        .with_faults(faults)
        .build()
        .unwrap()
}

/// A local write of the file chunk at `at` (1 MiB chunks) gets `fault`, once.
#[cfg(feature = "fault-injection")]
fn at_chunk(at: u64, fault: crate::io::fault::Fault) -> crate::io::fault::Rule {
    crate::io::fault::Rule {
        kind: crate::io::OpKind::Write,
        offsets: (at << 20)..(at << 20) + 1,
        fault,
        times: Some(1),
    }
}

/// The upload starts with the save: its parts reach the bucket while the save is still
/// being written locally (the write of the last chunk held back 5 s), and the object is
/// the committed file byte for byte.
#[cfg(feature = "fault-injection")]
#[test]
fn parts_reach_the_bucket_before_the_local_commit() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    // 10 MiB + 4 KiB + header: chunks 0..=10; parts 0 and 1 (5 MiB each) need chunks
    // 0..=9 only.
    let delay = crate::io::fault::Fault::Delay(Duration::from_secs(5));
    let engine = faulty(dir.path(), &mem, vec![at_chunk(10, delay)]);
    let s = state(61);
    let h = engine.save(1, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    let t = std::time::Instant::now();
    while p.uploaded_bytes() < 10 << 20 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "parts waited for the local commit: {} bytes uploaded",
            p.uploaded_bytes()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // Two parts accepted, and the step is not committed locally yet.
    assert_eq!(p.uploaded_bytes(), 10 << 20);
    assert!(!dir.path().join("step-1").exists());
    assert!(dir.path().join("step-1.partial").exists());
    assert!(!p.is_done());
    let local = h.wait().unwrap();
    let rep = p.wait().unwrap();
    assert_eq!(rep.bytes, local.bytes);
    assert_eq!(rep.read_from_file, 0);
    let good = std::fs::read(dir.path().join("step-1").join(RANK_FILE)).unwrap();
    assert_eq!(good.len() as u64, local.bytes);
    assert_eq!(
        object(&mem, &rank_object(&mem, "run1/step-1", RANK_FILE)),
        good
    );
    assert_eq!(engine.list_remote().unwrap(), vec![1]);
    let (ck, _) = engine.load_remote(1).unwrap();
    for (t, (_, d, _)) in ck.tensors.iter().zip(&s) {
        assert_eq!(t.data.as_bytes(), &d[..], "tensor {}", t.name);
    }
    assert_eq!(engine.remote().unwrap().open_uploads().unwrap(), Vec::new());
    engine.close();
}

/// A save that fails locally after some of its parts were uploaded aborts the upload:
/// nothing of it is in the bucket (no object, no journal, no open upload), its remote
/// copy reports the local failure, and the next save reaches the bucket.
#[cfg(feature = "fault-injection")]
#[test]
fn a_save_that_fails_locally_aborts_its_started_upload() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    use crate::io::fault::Fault;
    // Chunk 9 held back 2 s (part 0 goes meanwhile), then chunk 10's write fails.
    let engine = faulty(
        dir.path(),
        &mem,
        vec![
            at_chunk(9, Fault::Delay(Duration::from_secs(2))),
            at_chunk(10, Fault::Errno(libc::EIO)),
        ],
    );
    let s = state(71);
    let h = engine.save(1, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    assert!(h.wait().is_err());
    let e = p.wait().unwrap_err();
    match &e {
        Error::RemoteFailed { step: 1, source } => {
            assert!(matches!(**source, Error::SaveFailed { step: 1, .. }), "{e}")
        }
        _ => panic!("{e}"),
    }
    assert!(p.uploaded_bytes() >= 5 << 20, "{}", p.uploaded_bytes());
    assert_eq!(objects(&mem), Vec::<String>::new());
    assert_eq!(engine.remote().unwrap().open_uploads().unwrap(), Vec::new());
    // The next save (no faults left) commits in the bucket; step 1 never does.
    let h = engine.save(2, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    let rep = p.wait().unwrap();
    assert_eq!(rep.retried, None);
    assert_eq!(engine.list_remote().unwrap(), vec![2]);
    let good = std::fs::read(dir.path().join("step-2").join(RANK_FILE)).unwrap();
    assert_eq!(
        object(&mem, &rank_object(&mem, "run1/step-2", RANK_FILE)),
        good
    );
    engine.close();
}
