//! Objects of a step other than the checkpoint's own (its rank objects, their manifest
//! parts and `manifest.json`): a framework's metadata stored beside a committed step, such
//! as DCP's `.metadata` that `shmckpt.dcp.ShmckptWriter` writes after the step is
//! committed in the bucket. Created once (a conditional create), read size-capped.

use bytes::Bytes;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};

use super::Remote;
use crate::error::{Error, Result};
use crate::manifest::MANIFEST;

/// Whether `name` may be used as an extra object of a step: one path component, not
/// `manifest.json` and not the name of a rank object or manifest part (those belong to
/// the commit protocol).
fn check_name(url: &str, name: &str) -> Result<()> {
    let bad = name.is_empty()
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\\')
        || name == MANIFEST
        || name.starts_with("rank-");
    if bad {
        return Err(Error::Config(format!(
            "{url}: {name:?} cannot name an extra object of a step (one path component, \
             not manifest.json nor a rank object)"
        )));
    }
    Ok(())
}

impl Remote {
    /// Create `step-N/<name>` holding `data`, only if it does not exist
    /// (`PutMode::Create`: `If-None-Match: *` on S3), and only once `step` is committed
    /// (its `manifest.json` exists). Returns `false` when the object already existed
    /// (nothing is written).
    pub fn put_step_extra(&self, step: u64, name: &str, data: Vec<u8>) -> Result<bool> {
        check_name(&self.url, name)?;
        if self.block(self.read_manifest_async(step))?.is_none() {
            return Err(Error::NotFound {
                what: format!("step {step} (committed)"),
                root: std::path::PathBuf::from(&self.url),
                step: Some(step),
            });
        }
        let key = self.key(step, name);
        self.block(async {
            let put = PutOptions {
                mode: PutMode::Create,
                ..PutOptions::default()
            };
            match self
                .store
                .put_opts(&key, PutPayload::from(Bytes::from(data)), put)
                .await
            {
                Ok(_) => Ok(true),
                Err(object_store::Error::AlreadyExists { .. })
                | Err(object_store::Error::Precondition { .. }) => Ok(false),
                Err(e) => Err(self.err("put (conditional create)", &e)),
            }
        })
    }

    /// The bytes of `step-N/<name>`, `None` when it does not exist; an object larger than
    /// `cap` bytes is refused (the bucket is untrusted).
    pub fn get_step_extra(&self, step: u64, name: &str, cap: u64) -> Result<Option<Vec<u8>>> {
        check_name(&self.url, name)?;
        let key = self.key(step, name);
        self.block(async {
            match self.get_capped(&key, cap).await {
                Ok(b) => Ok(Some(b.to_vec())),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.err("get", &e)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use object_store::memory::InMemory;

    use super::*;
    use crate::manifest::Metadata;
    use crate::remote::RemoteOptions;
    use crate::{Dtype, EngineConfig, Tensor};

    fn remote(mem: Arc<InMemory>) -> Remote {
        Remote::with_store(mem, "run1", "mem://run1", RemoteOptions::default()).unwrap()
    }

    #[test]
    fn extra_names_are_checked() {
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "manifest.json",
            "rank-00000.manifest.json",
        ] {
            let e = check_name("s3://b/p", bad).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad:?}: {e}");
        }
        check_name("s3://b/p", ".metadata").unwrap();
    }

    #[test]
    fn an_extra_object_is_created_once_beside_a_committed_step_only() {
        let mem = Arc::new(InMemory::new());
        let r = remote(mem.clone());
        let e = r.put_step_extra(5, ".metadata", b"x".to_vec()).unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        assert_eq!(r.get_step_extra(5, ".metadata", 10).unwrap(), None);

        let dir = tempfile::tempdir().unwrap();
        let engine = EngineConfig::new(dir.path())
            .with_staging_capacity(4 << 20)
            .with_chunk_size(1 << 20)
            .with_direct_io(false)
            .with_remote_store(mem.clone(), "run1")
            .build()
            .unwrap();
        let data = vec![7u8; 64];
        let t = [Tensor::host("w", Dtype::U8, vec![64], &data)];
        let h = engine.save(5, &t, &Metadata::new()).unwrap();
        let progress = h.remote().unwrap();
        h.wait().unwrap();
        progress.wait().unwrap();

        assert!(r.put_step_extra(5, ".metadata", b"first".to_vec()).unwrap());
        assert!(
            !r.put_step_extra(5, ".metadata", b"second".to_vec())
                .unwrap()
        );
        assert_eq!(
            r.get_step_extra(5, ".metadata", 10).unwrap().as_deref(),
            Some(&b"first"[..])
        );
        // Larger than the cap: refused, not read.
        let e = r.get_step_extra(5, ".metadata", 4).unwrap_err();
        assert!(matches!(e, Error::Remote { .. }), "{e}");
        let e = r
            .put_step_extra(5, "manifest.json", Vec::new())
            .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e}");
    }
}
