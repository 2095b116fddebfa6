//! Bucket contents that lie, committed steps never overwritten, stale parts of an earlier
//! run, calls from inside a runtime, and a bucket load through two staging chunks (split
//! from tests.rs).

use std::sync::Arc;

use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, PutPayload};

use super::tests::{small, state, tensors};
use super::*;

/// A manifest that claims more bytes than the object holds is an error before anything
/// is allocated on its word (`load` allocated a tensor of 2^60 bytes before it looked at
/// the object, and the process aborted).
#[test]
fn a_manifest_claiming_a_huge_tensor_is_an_error_not_an_allocation() {
    let mem = Arc::new(InMemory::new());
    let r = Remote::with_store(mem.clone(), "", "mem://", RemoteOptions::default()).unwrap();
    let rt = runtime().unwrap();
    let len: u64 = 1 << 60;
    let m = format!(
        r#"{{"format_version":1,"step":1,"world_size":1,"created_unix_ms":0,"total_bytes":{},
        "metadata":{{}},"files":[{{"rank":0,"file":"rank-00000-of-00001.safetensors",
        "bytes":{},"data_start":4096,"tensors":[{{"name":"t","dtype":"U8","shape":[{len}],
        "data_offsets":[0,{len}],"crc32c":0}}]}}]}}"#,
        len + 4096,
        len + 4096
    );
    rt.block_on(mem.put(&ObjPath::from("step-1/manifest.json"), PutPayload::from(m)))
        .unwrap();
    rt.block_on(mem.put(
        &ObjPath::from("step-1/rank-00000-of-00001.safetensors"),
        PutPayload::from(vec![0u8; 4096 + 16]),
    ))
    .unwrap();
    match r.load(1, 0) {
        Err(Error::Truncated {
            expected, actual, ..
        }) => assert_eq!((expected, actual), (len + 4096, 4096 + 16)),
        other => panic!("{other:?}"),
    }
}

/// A step already committed in the bucket is never overwritten by a later save of the
/// same step number (its objects would no longer match its manifest).
#[test]
fn a_committed_step_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = small(dir.path(), mem.clone()).build().unwrap();
    let s = state(1);
    let h = engine.save(2, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    p.wait().unwrap();
    std::fs::remove_dir_all(dir.path().join("step-2")).unwrap();
    let other = state(2);
    let h = engine.save(2, &tensors(&other), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    match p.wait() {
        Err(Error::RemoteFailed { step: 2, source }) => {
            assert!(
                matches!(&*source, Error::StepExists { step: 2, .. }),
                "{source}"
            )
        }
        other => panic!("{other:?}"),
    }
    let (ck, _) = engine.load_remote(2).unwrap();
    assert_eq!(ck.tensors[0].data.as_bytes(), &s[0].1[..]);
    engine.close();
}

/// Two ranks on separate roots sharing one bucket. An earlier run ("old") had rank 1
/// upload step 7 and died before rank 0 did; a new run ("new") saves step 7 again, rank 0
/// first: rank 1's stale part must not count, so the step commits only with both of the
/// new run's objects. Without sessions, rank 0 committed the stale rank-1 object.
#[test]
fn a_stale_part_of_an_earlier_run_never_commits() {
    let mem = Arc::new(InMemory::new());
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let open = |rank: u32, session: &str| {
        small(dirs[rank as usize].path(), mem.clone())
            .with_rank(rank, 2)
            .with_session(Some(session.to_owned()))
            .build()
            .unwrap()
    };
    let save = |e: &crate::Engine, seed: u32| {
        let s = state(seed);
        let h = e.save(7, &tensors(&s), &Metadata::new()).unwrap();
        let p = h.remote().unwrap();
        h.wait().unwrap();
        p
    };
    // The earlier run: only rank 1's object and part reach the bucket.
    let old1 = open(1, "old");
    let p = save(&old1, 100);
    assert!(
        p.wait_timeout(Some(std::time::Duration::from_millis(300)))
            .is_none()
    );
    old1.close();
    // The new run, rank 0 first: not committed (rank 1's part is of another session).
    let (new0, new1) = (open(0, "new"), open(1, "new"));
    let p0 = save(&new0, 1);
    assert!(
        p0.wait_timeout(Some(std::time::Duration::from_millis(300)))
            .is_none()
    );
    assert_eq!(new0.list_remote().unwrap(), Vec::<u64>::new());
    let p1 = save(&new1, 2);
    let (r0, r1) = (p0.wait().unwrap(), p1.wait().unwrap());
    assert!(!r0.committed_here && r1.committed_here);
    let (ck, _) = new1.load_remote(7).unwrap();
    assert_eq!(ck.tensors[0].data.as_bytes(), &state(2)[0].1[..]);
    let (ck, _) = new0.load_remote(7).unwrap();
    assert_eq!(ck.tensors[0].data.as_bytes(), &state(1)[0].1[..]);
}

/// Called from inside a tokio runtime (where tokio panics on a nested `block_on`), the
/// remote's calls return an error.
#[test]
fn calls_from_inside_a_tokio_runtime_are_an_error_not_a_panic() {
    let mem = Arc::new(InMemory::new());
    let r = Remote::with_store(mem, "p", "mem://p", RemoteOptions::default()).unwrap();
    let outer = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let got = outer.block_on(async { r.list() });
    match got {
        Err(Error::Config(m)) => assert!(m.contains("not from inside a tokio runtime"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(r.list().unwrap(), Vec::<u64>::new());
}

#[test]
fn a_bucket_load_through_two_staging_chunks_gives_exact_bytes_in_file_order() {
    use super::staged::Staged;
    use super::staged::tests::{ByRef, Checked, assert_from_chunks, chunks};
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = small(dir.path(), mem.clone()).build().unwrap();
    let s = state(11);
    let h = engine.save(3, &tensors(&s), &Metadata::new()).unwrap();
    let progress = h.remote().unwrap();
    h.wait().unwrap();
    progress.wait().unwrap();
    let remote = engine.remote().unwrap();
    let entry = remote.manifest(3).unwrap().files[0].clone();
    let lens: Vec<usize> = entry.tensors.iter().map(|t| t.len() as usize).collect();
    // 5 MiB ranged GETs through two 1 MiB + 4 KiB chunks (ranges and tensors straddle
    // chunks).
    let ch = chunks((1 << 20) + 4096);
    let ranges: Vec<(usize, usize)> = ch.iter().map(|c| (c.as_ptr() as usize, c.len())).collect();
    let mut c = Checked::new(&lens);
    let mut sink = Staged::new(ByRef(&mut c), ch).unwrap();
    let (_, load) = remote.read_rank(3, 0, &mut sink).unwrap();
    sink.finish().unwrap();
    let data_len: u64 = lens.iter().map(|&n| n as u64).sum();
    assert_eq!(sink.forwarded(), data_len);
    assert_eq!(load.bytes, entry.bytes);
    assert_eq!((load.staged, load.staging), (0, 0));
    drop(sink);
    assert_from_chunks(&c, &ranges);
    for (got, (name, d, _)) in c.out.iter().zip(&s) {
        assert_eq!(got, d, "tensor {name}");
    }
    engine.close();
}

/// An endpoint with a password in its userinfo: the error of an unreachable endpoint
/// names it without the password, and an `http://` endpoint needs no `aws_allow_http`.
#[test]
fn an_endpoints_password_never_appears_in_errors() {
    let opts = RemoteOptions {
        retries: 0,
        request_timeout: std::time::Duration::from_secs(5),
        config: vec![
            (
                "aws_endpoint".into(),
                "http://someone:S3cretPASS@127.0.0.1:1".into(),
            ),
            ("aws_access_key_id".into(), "AKIDEXAMPLE".into()),
            ("aws_secret_access_key".into(), "SECRETKEYVALUE".into()),
            ("aws_region".into(), "us-east-1".into()),
        ],
        ..RemoteOptions::default()
    };
    let e = Remote::open("s3://bucket/p", opts).unwrap_err();
    let text = format!("{e} {e:?}");
    assert!(matches!(e, Error::Remote { op: "list", .. }), "{text}");
    assert!(!text.contains("S3cretPASS"), "{text}");
    assert!(!text.contains("SECRETKEYVALUE"), "{text}");
    // Refused for the closed port, not for its scheme.
    assert!(!text.contains("builder error"), "{text}");
    assert!(text.contains("127.0.0.1:1"), "{text}");
}
