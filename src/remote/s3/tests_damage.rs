//! A damaged local copy of a step the bucket also holds: loads read the bucket's copy
//! when (and only when) it holds the same bytes, and say so.

use std::sync::Arc;

use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, PutPayload};

use super::tests::{small, state, tensors};
use super::*;
use crate::{Engine, LoadSource, StepSel};

const FILE: &str = "rank-00000-of-00001.safetensors";

/// An engine over `dir` and `mem` that saved `state(seed)` as step 5 to both tiers.
fn saved(dir: &std::path::Path, mem: &Arc<InMemory>, seed: u32) -> Engine {
    let engine = small(dir, mem.clone()).build().unwrap();
    let s = state(seed);
    let h = engine.save(5, &tensors(&s), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    p.wait().unwrap();
    engine
}

/// XOR one byte of the local file of step 5 at `at` (from the end when negative).
fn flip(dir: &std::path::Path, at: i64) {
    let path = dir.join("step-5").join(FILE);
    let mut b = std::fs::read(&path).unwrap();
    let i = if at < 0 { b.len() as i64 + at } else { at } as usize;
    b[i] ^= 0x40;
    std::fs::write(&path, b).unwrap();
}

fn assert_state(ck: &crate::restore::Checkpoint, seed: u32) {
    let s = state(seed);
    let names: Vec<&str> = ck.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, vec!["a", "b", "c", "empty"]);
    for (t, (_, d, _)) in ck.tensors.iter().zip(&s) {
        assert_eq!(t.data.as_bytes(), &d[..], "tensor {}", t.name);
    }
}

fn load_into_bufs(engine: &Engine, seed: u32) -> Result<Vec<Vec<u8>>> {
    let s = state(seed);
    let mut bufs: Vec<Vec<u8>> = s.iter().map(|(_, d, _)| vec![0xAA; d.len()]).collect();
    let mut dest: Vec<(&str, &mut [u8])> = s
        .iter()
        .zip(bufs.iter_mut())
        .map(|((n, _, _), b)| (n.as_str(), b.as_mut_slice()))
        .collect();
    engine.load_into(5, &mut dest)?;
    Ok(bufs)
}

/// A flipped byte in the data (a checksum error) or a cut file (truncated): `load`,
/// `load_into` and the header's metadata come from the bucket, and the report says why.
#[test]
fn a_damaged_local_file_is_read_from_the_bucket() {
    for damage in ["data", "header", "cut"] {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(InMemory::new());
        let engine = saved(dir.path(), &mem, 1);
        let meta = engine.file_metadata(5).unwrap();
        match damage {
            "data" => flip(dir.path(), -100),
            "header" => flip(dir.path(), 20),
            _ => {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(dir.path().join("step-5").join(FILE))
                    .unwrap();
                f.set_len(f.metadata().unwrap().len() - 4096).unwrap();
            }
        }
        // Without a bucket the damage is an error.
        let local = crate::restore::load_owned(
            &dir.path().join("step-5"),
            0,
            &crate::restore::ReadOptions {
                direct_io: false,
                ..Default::default()
            },
        );
        assert!(
            matches!(
                (damage, &local),
                ("data", Err(Error::Checksum { .. }))
                    | ("header", Err(Error::Corrupt { .. }))
                    | ("cut", Err(Error::Truncated { .. }))
            ),
            "{damage}: {local:?}"
        );
        let (ck, report) = engine.load_with_report(StepSel::Latest).unwrap();
        assert_eq!(
            (report.step, report.source),
            (5, LoadSource::Remote),
            "{damage}"
        );
        assert_eq!(
            report.fallback_reason,
            Some(local.err().unwrap().to_string())
        );
        assert_state(&ck, 1);
        drop(ck);
        let s = state(1);
        let bufs = load_into_bufs(&engine, 1).unwrap();
        for (b, (_, d, _)) in bufs.iter().zip(&s) {
            assert_eq!(b, d, "{damage}");
        }
        assert_eq!(engine.file_metadata(5).unwrap(), meta, "{damage}");
        engine.close();
    }
}

/// The bucket's step 5 holds other bytes than the disk's step 5 (another run's save of
/// that number): a damaged local file is an error, the bucket's bytes are never served.
#[test]
fn a_bucket_step_of_other_bytes_is_never_served_for_a_damaged_file() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    saved(dir.path(), &mem, 1).close();
    // Step 5 saved again on the disk with other values; the bucket keeps its step 5.
    std::fs::remove_dir_all(dir.path().join("step-5")).unwrap();
    let engine = small(dir.path(), mem.clone()).build().unwrap();
    let s2 = state(2);
    let h = engine.save(5, &tensors(&s2), &Metadata::new()).unwrap();
    let p = h.remote().unwrap();
    h.wait().unwrap();
    // The bucket's committed step 5 is never overwritten.
    assert!(matches!(p.wait(), Err(Error::RemoteFailed { step: 5, .. })));
    assert_state(&engine.load(5).unwrap(), 2);
    flip(dir.path(), -100);
    assert!(matches!(engine.load(5), Err(Error::Checksum { .. })));
    assert!(matches!(
        load_into_bufs(&engine, 2),
        Err(Error::Checksum { .. })
    ));
    // The bucket's own step 5 is still there, read only when asked for.
    assert_state(&engine.load_remote(5).unwrap().0, 1);
    engine.close();
}

/// Both copies damaged: the local error is returned (the bucket's is logged), nothing is
/// served.
#[test]
fn a_damaged_bucket_copy_too_is_the_local_error() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let engine = saved(dir.path(), &mem, 1);
    flip(dir.path(), -100);
    let key = ObjPath::from(super::tests::rank_object(&mem, "run1/step-5", FILE));
    let rt = runtime().unwrap();
    let mut obj = rt
        .block_on(async { mem.get(&key).await.unwrap().bytes().await })
        .unwrap()
        .to_vec();
    let n = obj.len();
    obj[n - 100] ^= 0x40;
    rt.block_on(mem.put(&key, PutPayload::from(obj))).unwrap();
    let local_path = dir.path().join("step-5").join(FILE);
    match engine.load(5) {
        Err(Error::Checksum { path, .. }) => assert_eq!(path, local_path),
        other => panic!("{:?}", other.map(|c| c.step)),
    }
    match load_into_bufs(&engine, 1) {
        Err(Error::Checksum { path, .. }) => assert_eq!(path, local_path),
        other => panic!("{:?}", other.map(|_| ())),
    }
    engine.close();
}
