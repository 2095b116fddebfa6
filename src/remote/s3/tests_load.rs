//! Tests of [`Engine::load_with`] against a bucket (issue 37):
//! the bucket as a source of its own and as the damaged disk's fallback.

use std::sync::Arc;

use object_store::memory::InMemory;

use super::tests_tiers::{engine, save};
use crate::Checkpoint;
use crate::engine::{Engine, LoadInto, LoadReport, LoadRequest, LoadSource, Sources, StepSel};
use crate::error::{Error, Result};
use crate::tier::RemoteLoad;

/// Issue 37: the bucket as a source of its own, and as the disk's fallback, through
/// the one `load_with`; a wrong destination is the caller's error, never a fallback.
#[test]
fn load_request_reads_the_bucket_alone_or_after_a_damaged_disk() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let e = engine(dir.path(), mem);
    save(&e, 1);
    let want: Vec<u8> = (0..4096u32).flat_map(|i| (i ^ 1).to_le_bytes()).collect();
    let bytes = |got: &crate::Loaded| {
        got.checkpoint
            .as_ref()
            .unwrap()
            .get("w")
            .unwrap()
            .data
            .as_bytes()
            .to_vec()
    };
    let req = LoadRequest::new(1);
    let got = e
        .load_with(&req.with_sources(Sources::BUCKET), LoadInto::owned())
        .unwrap();
    assert_eq!(got.report.source, LoadSource::Remote);
    assert!(got.remote.unwrap().bytes > 0);
    assert_eq!(bytes(&got), want);
    let got = e
        .load_with(&req.with_sources(Sources::DISK), LoadInto::owned())
        .unwrap();
    assert_eq!((got.report.source, got.remote), (LoadSource::Disk, None));
    assert_eq!(bytes(&got), want);

    // A buffer a byte short: the caller's error from every source, nothing written.
    for sources in [Sources::DISK, Sources::BUCKET, Sources::ALL] {
        let mut short = vec![0u8; want.len() - 1];
        let mut dest = [("w", &mut short[..])];
        let got = e.load_with(&req.with_sources(sources), LoadInto::host(&mut dest));
        assert!(
            matches!(got, Err(Error::Destination { .. })),
            "{sources:?}: {got:?}"
        );
        assert!(short.iter().all(|&b| b == 0));
    }

    // This rank's file damaged on the disk: the disk alone fails, every source falls
    // back to the bucket (the same bytes) and says why.
    let info = e.list().unwrap().into_iter().find(|c| c.step == 1).unwrap();
    let (_, entry) = crate::restore::rank_file(&info.dir, 0).unwrap();
    let path = info.dir.join(&entry.file);
    let mut file = std::fs::read(&path).unwrap();
    // (Inside the 16 KiB data section, whatever padding ends the file.)
    let at = file.len() - 8192;
    file[at] ^= 0xFF;
    std::fs::write(&path, &file).unwrap();
    assert!(matches!(
        e.load_with(&req.with_sources(Sources::LOCAL), LoadInto::owned()),
        Err(Error::Checksum { .. })
    ));
    let got = e.load_with(&req, LoadInto::owned()).unwrap();
    assert_eq!(got.report.source, LoadSource::Remote);
    assert!(
        got.report
            .fallback_reason
            .as_deref()
            .unwrap()
            .contains("checksum"),
        "{:?}",
        got.report
    );
    assert_eq!(bytes(&got), want);
    let mut buf = vec![0u8; want.len()];
    let mut dest = [("w", &mut buf[..])];
    let got = e.load_with(&req, LoadInto::host(&mut dest)).unwrap();
    assert_eq!(
        (got.report.step, got.report.source),
        (1, LoadSource::Remote)
    );
    assert_eq!(buf, want);
    e.close();
}

/// Shorthands of [`Engine::load_with`] for the crate's tests of the remote tier.
impl Engine {
    /// Into owned buffers from every source: the checkpoint and its report.
    pub(crate) fn load_with_report(
        &self,
        which: impl Into<StepSel>,
    ) -> Result<(Checkpoint, LoadReport)> {
        let got = self.load_with(&LoadRequest::new(which), LoadInto::owned())?;
        Ok((got.checkpoint.expect("an owned load"), got.report))
    }

    /// Into the caller's host buffers by name from every source: the step loaded.
    pub(crate) fn load_into(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut [u8])],
    ) -> Result<u64> {
        let got = self.load_with(&LoadRequest::new(which), LoadInto::host(dest))?;
        Ok(got.report.step)
    }

    /// Into owned buffers from the bucket only, whatever the local disk holds.
    pub(crate) fn load_remote(
        &self,
        which: impl Into<StepSel>,
    ) -> Result<(Checkpoint, RemoteLoad)> {
        let req = LoadRequest::new(which).with_sources(Sources::BUCKET);
        let got = self.load_with(&req, LoadInto::owned())?;
        let remote = got.remote.expect("the bucket served the load");
        Ok((got.checkpoint.expect("an owned load"), remote))
    }

    /// Into the caller's host buffers by name from the bucket only.
    pub(crate) fn load_into_remote(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut [u8])],
    ) -> Result<RemoteLoad> {
        let req = LoadRequest::new(which).with_sources(Sources::BUCKET);
        let got = self.load_with(&req, LoadInto::host(dest))?;
        Ok(got.remote.expect("the bucket served the load"))
    }
}
