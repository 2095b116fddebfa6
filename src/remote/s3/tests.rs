//! The remote tier against object_store's `InMemory` (and a wrapper of it that fails
//! chosen requests, as object_store's `throttle.rs` wraps a store to slow it).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult, UploadPart,
};

use super::*;
use crate::{Dtype, EngineConfig, LoadSource, StepSel, Tensor};

/// Fails the `n`-th multipart part (counting from 1) and every later one while armed.
#[derive(Debug)]
struct FailParts {
    inner: Arc<InMemory>,
    fail_from: Arc<AtomicUsize>,
    parts: Arc<AtomicUsize>,
}

impl std::fmt::Display for FailParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FailParts({})", self.inner)
    }
}

#[derive(Debug)]
struct FailUpload {
    inner: Box<dyn MultipartUpload>,
    fail_from: Arc<AtomicUsize>,
    parts: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl MultipartUpload for FailUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        let n = self.parts.fetch_add(1, Ordering::SeqCst) + 1;
        let from = self.fail_from.load(Ordering::SeqCst);
        if from != 0 && n >= from {
            return Box::pin(async move {
                Err(object_store::Error::Generic {
                    store: "FailParts",
                    source: format!("injected failure of part {n} (503 Slow Down)").into(),
                })
            });
        }
        self.inner.put_part(data)
    }
    async fn complete(&mut self) -> object_store::Result<PutResult> {
        self.inner.complete().await
    }
    async fn abort(&mut self) -> object_store::Result<()> {
        self.inner.abort().await
    }
}

/// `impl ObjectStore for $ty` over its field `inner` (an `Arc<InMemory>`), every request
/// passed through except `put_multipart_opts`, whose body (with `$this`, `$location` and
/// `$opts` bound) is given: the test wrappers differ only there.
macro_rules! multipart_wrapper {
    ($ty:ty, |$this:ident, $location:ident, $opts:ident| $multipart:block) => {
        #[async_trait::async_trait]
        impl ObjectStore for $ty {
            async fn put_opts(
                &self,
                location: &ObjPath,
                payload: PutPayload,
                opts: PutOptions,
            ) -> object_store::Result<PutResult> {
                self.inner.put_opts(location, payload, opts).await
            }
            async fn put_multipart_opts(
                &self,
                location: &ObjPath,
                opts: PutMultipartOptions,
            ) -> object_store::Result<Box<dyn MultipartUpload>> {
                let ($this, $location, $opts) = (self, location, opts);
                $multipart
            }
            async fn get_opts(
                &self,
                location: &ObjPath,
                options: GetOptions,
            ) -> object_store::Result<GetResult> {
                self.inner.get_opts(location, options).await
            }
            fn delete_stream(
                &self,
                locations: BoxStream<'static, object_store::Result<ObjPath>>,
            ) -> BoxStream<'static, object_store::Result<ObjPath>> {
                self.inner.delete_stream(locations)
            }
            fn list(
                &self,
                prefix: Option<&ObjPath>,
            ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
                self.inner.list(prefix)
            }
            async fn list_with_delimiter(
                &self,
                prefix: Option<&ObjPath>,
            ) -> object_store::Result<ListResult> {
                self.inner.list_with_delimiter(prefix).await
            }
            async fn copy_opts(
                &self,
                from: &ObjPath,
                to: &ObjPath,
                options: CopyOptions,
            ) -> object_store::Result<()> {
                self.inner.copy_opts(from, to, options).await
            }
        }
    };
}
pub(super) use multipart_wrapper;

multipart_wrapper!(FailParts, |this, location, opts| {
    Ok(Box::new(FailUpload {
        inner: this.inner.put_multipart_opts(location, opts).await?,
        fail_from: Arc::clone(&this.fail_from),
        parts: Arc::clone(&this.parts),
    }))
});

pub(super) fn small(root: &std::path::Path, store: Arc<dyn ObjectStore>) -> EngineConfig {
    EngineConfig::new(root)
        .with_staging_capacity(16 << 20)
        .with_chunk_size(1 << 20)
        .with_writer_threads(1)
        .with_direct_io(false)
        .with_backend(crate::BackendKind::Pwrite)
        .with_remote_store(store, "run1")
        .with_remote_options(RemoteOptions {
            part_size: 5 << 20,
            concurrency: 4,
            ..RemoteOptions::default()
        })
}

/// 11 MiB of f32 over three tensors (three 5 MiB parts) plus an empty one.
pub(super) fn state(seed: u32) -> Vec<(String, Vec<u8>, Vec<usize>)> {
    let mk = |n: usize, k: u32| -> Vec<u8> {
        (0..n as u32)
            .flat_map(|i| (i.wrapping_mul(2654435761) ^ k).to_le_bytes())
            .collect()
    };
    vec![
        ("a".into(), mk(1 << 20, seed), vec![1 << 20]),
        ("b".into(), mk(3 << 19, seed + 1), vec![3 << 19]),
        ("c".into(), mk(1000, seed + 2), vec![10, 100]),
        ("empty".into(), Vec::new(), vec![0]),
    ]
}

pub(super) fn tensors(s: &[(String, Vec<u8>, Vec<usize>)]) -> Vec<Tensor<'_>> {
    s.iter()
        .map(|(n, d, sh)| Tensor::host(n.as_str(), Dtype::F32, sh.clone(), d))
        .collect()
}

pub(super) fn objects(store: &InMemory) -> Vec<String> {
    let rt = runtime().unwrap();
    let mut v: Vec<String> = rt.block_on(async {
        store
            .list(None)
            .map(|o| o.unwrap().location.to_string())
            .collect()
            .await
    });
    v.sort();
    v
}

/// The key of the one upload of rank file `file` under `step_prefix` (`run1/step-5`):
/// `step_prefix/rank-R-of-W.<upload id>.safetensors`.
pub(super) fn rank_object(store: &InMemory, step_prefix: &str, file: &str) -> String {
    let found: Vec<String> = objects(store)
        .into_iter()
        .filter(|k| {
            k.strip_prefix(step_prefix)
                .and_then(|r| r.strip_prefix('/'))
                .is_some_and(|n| n != file && super::upload::is_object_of(n, file))
        })
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found.into_iter().next().unwrap()
}

#[test]
fn save_uploads_commits_and_loads_back_after_the_local_copy_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = small(dir.path(), mem.clone()).build().unwrap();
    let s = state(7);
    let h = engine.save(5, &tensors(&s), &Metadata::new()).unwrap();
    let progress = h.remote().unwrap();
    let local = h.wait().unwrap();
    let rep = progress.wait().unwrap();
    assert_eq!(rep.step, 5);
    assert_eq!(rep.bytes, local.bytes);
    assert!(rep.committed_here);
    let obj_key = rank_object(&mem, "run1/step-5", "rank-00000-of-00001.safetensors");
    assert_eq!(
        objects(&mem),
        vec![
            "run1/step-5/manifest.json",
            obj_key.as_str(),
            "run1/step-5/rank-00000.manifest.json",
        ]
    );
    // The object is the local file, byte for byte.
    let file = std::fs::read(dir.path().join("step-5/rank-00000-of-00001.safetensors")).unwrap();
    let rt = runtime().unwrap();
    let obj = rt
        .block_on(async {
            mem.get(&ObjPath::from(obj_key.as_str()))
                .await
                .unwrap()
                .bytes()
                .await
        })
        .unwrap();
    assert_eq!(&obj[..], &file[..]);
    assert_eq!(engine.list_remote().unwrap(), vec![5]);
    // The bucket's manifest is the local one but for its commit time and the object's
    // name.
    let mut remote_m = engine.remote().unwrap().manifest(5).unwrap();
    let local_m = engine.manifest(5).unwrap();
    remote_m.created_unix_ms = local_m.created_unix_ms;
    assert_eq!(
        remote_m.files[0]
            .object
            .take()
            .map(|o| format!("run1/step-5/{o}")),
        Some(obj_key.clone())
    );
    assert_eq!(remote_m, local_m);

    // Local copy deleted: `load` falls back to the bucket and says so.
    std::fs::remove_dir_all(dir.path().join("step-5")).unwrap();
    let (ck, report) = engine.load_with_report(StepSel::Latest).unwrap();
    assert_eq!(report.source, LoadSource::Remote);
    assert_eq!(ck.step, 5);
    let names: Vec<&str> = ck.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, vec!["a", "b", "c", "empty"]);
    for (t, (_, d, sh)) in ck.tensors.iter().zip(&s) {
        assert_eq!(t.data.as_bytes(), &d[..], "tensor {}", t.name);
        assert_eq!(&t.shape, sh);
    }
    // load_into from the bucket.
    let mut bufs: Vec<Vec<u8>> = s.iter().map(|(_, d, _)| vec![0xAA; d.len()]).collect();
    let mut dest: Vec<(&str, &mut [u8])> = s
        .iter()
        .zip(bufs.iter_mut())
        .map(|((n, _, _), b)| (n.as_str(), b.as_mut_slice()))
        .collect();
    let got = engine.load_into_remote(5, &mut dest).unwrap();
    assert_eq!(got.bytes, local.bytes);
    for (b, (_, d, _)) in bufs.iter().zip(&s) {
        assert_eq!(b, d);
    }
    // And `load_into` falls back to the bucket.
    let mut bufs: Vec<Vec<u8>> = s.iter().map(|(_, d, _)| vec![0x55; d.len()]).collect();
    let mut dest: Vec<(&str, &mut [u8])> = s
        .iter()
        .zip(bufs.iter_mut())
        .map(|((n, _, _), b)| (n.as_str(), b.as_mut_slice()))
        .collect();
    assert_eq!(engine.load_into(StepSel::Latest, &mut dest).unwrap(), 5);
    for (b, (_, d, _)) in bufs.iter().zip(&s) {
        assert_eq!(b, d);
    }
    assert_eq!(engine.remote().unwrap().verify(5).unwrap(), local.bytes);
    engine.close();
}

#[test]
fn retention_keeps_the_newest_steps_in_the_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = small(dir.path(), mem.clone())
        .with_remote_keep_last(Some(2))
        .with_keep_last(Some(1))
        .build()
        .unwrap();
    let s = state(1);
    let mut retired = Vec::new();
    for step in 1..=4 {
        let h = engine.save(step, &tensors(&s), &Metadata::new()).unwrap();
        let p = h.remote().unwrap();
        h.wait().unwrap();
        retired.extend(p.wait().unwrap().retired);
    }
    assert_eq!(retired, vec![1, 2]);
    assert_eq!(engine.list_remote().unwrap(), vec![3, 4]);
    assert_eq!(
        engine
            .list()
            .unwrap()
            .iter()
            .map(|c| c.step)
            .collect::<Vec<_>>(),
        vec![4]
    );
    // Nothing of the retired steps is left.
    assert!(
        objects(&mem)
            .iter()
            .all(|k| k.starts_with("run1/step-3/") || k.starts_with("run1/step-4/"))
    );
    // Step 3 is only in the bucket now: loaded from there.
    let (ck, report) = engine.load_with_report(3).unwrap();
    assert_eq!(report.source, LoadSource::Remote);
    assert_eq!(ck.tensors[0].data.as_bytes(), &s[0].1[..]);
    engine.close();
}

#[test]
fn retention_never_deletes_the_newest_step() {
    let mem = Arc::new(InMemory::new());
    let r = Remote::with_store(mem.clone(), "p", "mem://p", RemoteOptions::default()).unwrap();
    let rt = runtime().unwrap();
    for step in [3u64, 9] {
        rt.block_on(mem.put(
            &ObjPath::from(format!("p/step-{step}/manifest.json")),
            PutPayload::from(format!("{{\"step\": {step}}}")),
        ))
        .unwrap();
    }
    // An upload in progress (no manifest) of a step newer than the newest committed one.
    rt.block_on(mem.put(
        &ObjPath::from("p/step-12/rank-00000.manifest.json"),
        PutPayload::from("{}"),
    ))
    .unwrap();
    assert_eq!(r.apply_retention(1).unwrap(), vec![3]);
    assert_eq!(r.list().unwrap(), vec![9]);
    assert_eq!(r.apply_retention(1).unwrap(), Vec::<u64>::new());
    assert_eq!(
        objects(&mem),
        vec![
            "p/step-12/rank-00000.manifest.json",
            "p/step-9/manifest.json"
        ]
    );
}

#[test]
fn a_failed_part_aborts_the_upload_and_leaves_no_step() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let fail_from = Arc::new(AtomicUsize::new(2));
    let store = Arc::new(FailParts {
        inner: mem.clone(),
        fail_from: Arc::clone(&fail_from),
        parts: Arc::default(),
    });
    let engine = small(dir.path(), store).build().unwrap();
    let s = state(3);
    let h = engine.save(1, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    // The local tier is not held back: committed.
    h.wait().unwrap();
    let e = p.wait().unwrap_err();
    assert!(matches!(&e, Error::RemoteFailed { step: 1, .. }), "{e}");
    // Part 2 fails, and part 3 too if it was started: either is reported.
    assert!(e.to_string().contains("injected failure of part "), "{e}");
    assert!(objects(&mem).is_empty(), "{:?}", objects(&mem));
    assert_eq!(engine.list_remote().unwrap(), Vec::<u64>::new());
    // The next save works.
    fail_from.store(0, Ordering::SeqCst);
    let h = engine.save(2, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    let rep = p.wait().unwrap();
    assert_eq!(rep.step, 2);
    // Step 1, still the newest on the local disk and not in the bucket, was uploaded
    // again (from the local file) before step 2.
    assert_eq!(rep.retried, Some((1, Ok(()))));
    assert_eq!(engine.list_remote().unwrap(), vec![1, 2]);
    let r = engine.remote().unwrap();
    assert_eq!(r.verify(1).unwrap(), r.manifest(1).unwrap().total_bytes);
    engine.close();
}

/// The next save does not upload a failed step again once a newer step is committed in
/// the bucket, or when the failed step left the local disk: it reports why.
#[test]
fn a_failed_step_gone_from_the_disk_is_reported_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let fail_from = Arc::new(AtomicUsize::new(1));
    let store = Arc::new(FailParts {
        inner: mem.clone(),
        fail_from: Arc::clone(&fail_from),
        parts: Arc::default(),
    });
    let engine = small(dir.path(), store).build().unwrap();
    let s = state(4);
    let h = engine.save(1, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    assert!(matches!(p.wait(), Err(Error::RemoteFailed { step: 1, .. })));
    std::fs::remove_dir_all(dir.path().join("step-1")).unwrap();
    fail_from.store(0, Ordering::SeqCst);
    let h = engine.save(2, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    let rep = p.wait().unwrap();
    match &rep.retried {
        Some((1, Err(why))) => assert!(why.contains("no longer on the local disk"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(engine.list_remote().unwrap(), vec![2]);
    engine.close();
}

/// What a bucket returns is not trusted: a flipped byte, a truncated object, a manifest
/// claiming a larger object, a manifest of another step are typed errors.
#[test]
fn hostile_bucket_contents_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = small(dir.path(), mem.clone()).build().unwrap();
    let s = state(5);
    let h = engine.save(1, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    p.wait().unwrap();
    let r = engine.remote().unwrap();
    let rt = runtime().unwrap();
    let key = ObjPath::from(rank_object(
        &mem,
        "run1/step-1",
        "rank-00000-of-00001.safetensors",
    ));
    let good = rt
        .block_on(async { mem.get(&key).await.unwrap().bytes().await })
        .unwrap();

    let mut flipped = good.to_vec();
    let last = flipped.len() - 10;
    flipped[last] ^= 1;
    rt.block_on(mem.put(&key, PutPayload::from(flipped)))
        .unwrap();
    match r.load(1, 0) {
        Err(Error::Checksum { tensor, .. }) => assert_eq!(tensor, "c"),
        other => panic!("{other:?}"),
    }
    rt.block_on(mem.put(&key, PutPayload::from(good.slice(..good.len() - 1))))
        .unwrap();
    assert!(matches!(r.verify(1), Err(Error::Truncated { .. })));
    let mut longer = good.to_vec();
    longer.push(0);
    rt.block_on(mem.put(&key, PutPayload::from(longer)))
        .unwrap();
    assert!(matches!(r.load(1, 0), Err(Error::Corrupt { .. })));
    // A header that disagrees with the manifest.
    let mut hdr = good.to_vec();
    let pos = hdr.windows(3).position(|w| w == b"F32").unwrap();
    hdr[pos..pos + 3].copy_from_slice(b"I32");
    rt.block_on(mem.put(&key, PutPayload::from(hdr))).unwrap();
    assert!(matches!(r.load(1, 0), Err(Error::Corrupt { .. })));
    // A manifest of another step, and garbage.
    let mkey = ObjPath::from("run1/step-1/manifest.json");
    let m = rt
        .block_on(async { mem.get(&mkey).await.unwrap().bytes().await })
        .unwrap();
    let other = String::from_utf8(m.to_vec())
        .unwrap()
        .replacen("\"step\": 1", "\"step\": 2", 1);
    rt.block_on(mem.put(&mkey, PutPayload::from(other)))
        .unwrap();
    assert!(matches!(r.manifest(1), Err(Error::Corrupt { .. })));
    rt.block_on(mem.put(
        &mkey,
        PutPayload::from("{\"format_version\": 1, \"step\": 18446744073709551615"),
    ))
    .unwrap();
    assert!(matches!(r.manifest(1), Err(Error::Corrupt { .. })));
    assert!(matches!(r.manifest(77), Err(Error::NotFound { .. })));
    engine.close();
}

#[test]
fn gc_removes_uncommitted_steps_only() {
    let mem = Arc::new(InMemory::new());
    let r = Remote::with_store(mem.clone(), "", "mem://", RemoteOptions::default()).unwrap();
    let rt = runtime().unwrap();
    rt.block_on(mem.put(
        &ObjPath::from("step-1/manifest.json"),
        PutPayload::from("{\"step\":1}"),
    ))
    .unwrap();
    for k in [
        "step-1/rank-00000-of-00001.safetensors",
        "step-2/rank-00000-of-00001.safetensors",
        "step-2/rank-00000.manifest.json",
        "other/file",
    ] {
        rt.block_on(mem.put(&ObjPath::from(k), PutPayload::from("xyz")))
            .unwrap();
    }
    // Younger than the minimum age: kept (it may be an upload in progress).
    assert_eq!(
        r.gc(std::time::Duration::from_secs(3600)).unwrap(),
        GcReport::default()
    );
    let rep = r.gc(std::time::Duration::ZERO).unwrap();
    assert_eq!(rep.uncommitted_steps, vec![2]);
    assert_eq!((rep.objects, rep.bytes), (2, 6));
    assert_eq!(
        objects(&mem),
        vec![
            "other/file",
            "step-1/manifest.json",
            "step-1/rank-00000-of-00001.safetensors"
        ]
    );
}

#[test]
fn foreign_manifests_never_commit_a_step_nor_make_retention_or_gc_delete_one() {
    let mem = Arc::new(InMemory::new());
    let r = Remote::with_store(mem.clone(), "p", "mem://p", RemoteOptions::default()).unwrap();
    let rt = runtime().unwrap();
    let put = |k: &str, v: &str| {
        rt.block_on(mem.put(&ObjPath::from(k), PutPayload::from(v.to_owned())))
            .unwrap();
    };
    for step in [1u64, 2] {
        put(
            &format!("p/step-{step}/manifest.json"),
            &format!("{{\"step\": {step}}}"),
        );
        put(
            &format!("p/step-{step}/rank-00000-of-00001.safetensors"),
            "data",
        );
    }
    put("p/step-99/notes/manifest.json", "{\"step\": 99}"); // deeper: not a commit
    put("p/step-98/manifest.json", "{\"step\": 5}"); // of another step
    put("p/step-97/manifest.json", "not json");
    put("p/step-096/manifest.json", "{\"step\": 96}"); // non-canonical name
    put("p/step-50/rank-00000-of-00001.safetensors", "leftover");
    put("p/step-50/notes.txt", "theirs");
    assert_eq!(r.list().unwrap(), vec![1, 2]);
    assert_eq!(r.latest().unwrap(), Some(2));
    assert!(matches!(r.manifest(99), Err(Error::NotFound { .. })));
    // Retention counts the two committed steps only: with keep 2 nothing goes, with keep
    // 1 step 1 (never step 2, the newest).
    assert_eq!(r.apply_retention(2).unwrap(), Vec::<u64>::new());
    assert_eq!(r.apply_retention(1).unwrap(), vec![1]);
    let rep = r.gc(std::time::Duration::ZERO).unwrap();
    assert_eq!(rep.uncommitted_steps, vec![50]);
    assert_eq!((rep.objects, rep.bytes), (1, 8));
    let why_other = "not an object of shmckpt's uploads".to_owned();
    assert_eq!(
        rep.ignored,
        vec![
            ("mem://p/step-50/notes.txt".to_owned(), why_other.clone()),
            (
                "mem://p/step-97".to_owned(),
                "its manifest is not valid: expected ident at line 1 column 2".to_owned()
            ),
            (
                "mem://p/step-98".to_owned(),
                "its manifest is of step 5".to_owned()
            ),
            ("mem://p/step-99/notes/manifest.json".to_owned(), why_other),
        ]
    );
    assert_eq!(
        objects(&mem),
        vec![
            "p/step-096/manifest.json",
            "p/step-2/manifest.json",
            "p/step-2/rank-00000-of-00001.safetensors",
            "p/step-50/notes.txt",
            "p/step-97/manifest.json",
            "p/step-98/manifest.json",
            "p/step-99/notes/manifest.json",
        ]
    );
    assert_eq!(r.list().unwrap(), vec![2]);
}

#[test]
fn urls_are_parsed_strictly() {
    let u = RemoteUrl::parse("s3://bucket-1/run/a/").unwrap();
    assert_eq!(
        (u.bucket.as_str(), u.prefix.as_str()),
        ("bucket-1", "run/a")
    );
    assert_eq!(u.to_string(), "s3://bucket-1/run/a");
    assert_eq!(RemoteUrl::parse("s3://bkt").unwrap().prefix, "");
    for bad in [
        "/tmp/x",
        "s3://",
        "s3://bk/x",
        "s3://Bucket/x",
        "s3://bkt/a//c",
        "s3://bkt/../x",
        "s3://bkt/step-3",
        "gs://bkt/x",
    ] {
        assert!(
            matches!(RemoteUrl::parse(bad), Err(Error::Config(_))),
            "{bad}"
        );
    }
}

/// Backpressure: with one save allowed to wait behind a slow upload, a burst of saves
/// skips the intermediate steps (reported on their progress), uploads the first and the
/// newest, and the local tier commits all of them without waiting: steps 2 and 3 can be
/// skipped only if saves 3 and 4 were committed locally while step 1's upload (at least
/// four puts of 1 s each) was still running. No wall-clock bound is asserted (a loaded
/// machine, e.g. CI's wheel build beside this test, made one flaky).
#[test]
fn a_slow_bucket_skips_intermediate_steps() {
    use object_store::throttle::{ThrottleConfig, ThrottledStore};
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let slow = ThrottledStore::new(
        Arc::clone(&mem),
        ThrottleConfig {
            wait_put_per_call: std::time::Duration::from_secs(1),
            ..ThrottleConfig::default()
        },
    );
    let engine = small(dir.path(), Arc::new(slow))
        .with_remote_max_pending(1)
        .build()
        .unwrap();
    let s = state(9);
    let mut progress = Vec::new();
    for step in 1..=4 {
        let h = engine.save(step, &tensors(&s), &Metadata::new()).unwrap();
        progress.push(h.remote().unwrap());
        assert!(
            h.wait().unwrap().dir.is_some(),
            "step {step} committed locally"
        );
    }
    let results: Vec<_> = progress.iter().map(|p| p.wait()).collect();
    assert_eq!(results[0].as_ref().unwrap().step, 1);
    for (i, r) in results.iter().enumerate().take(3).skip(1) {
        match r {
            Err(Error::RemoteSkipped { step, reason }) => {
                assert_eq!(*step, i as u64 + 1);
                assert!(reason.contains("remote_max_pending"), "{reason}");
            }
            other => panic!("step {}: {other:?}", i + 1),
        }
    }
    assert_eq!(results[3].as_ref().unwrap().step, 4);
    assert_eq!(engine.list_remote().unwrap(), vec![1, 4]);
    engine.close();
}
