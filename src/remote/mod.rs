//! The object-storage tier: committed checkpoints mirrored to a bucket (S3 or any
//! `object_store` backend), committed there by the same rule as on disk, and read back
//! (feature `s3`; without it this module is empty).
//!
//! Layout, mirroring the local one under the URL's prefix:
//! ```text
//! prefix/step-N/rank-00000-of-00002.<id>.safetensors   one object per rank and upload
//! prefix/step-N/rank-00000.manifest.json              each rank's manifest part
//! prefix/step-N/manifest.json                         written last: the commit
//! ```
//! Each upload names its object apart (`<id>`,
//! [`FileEntry::object`](crate::manifest::FileEntry::object)), so two writers of one step
//! never complete the same object; a rank is told its step is committed only when the
//! manifest names its upload's object
//! ([`Error::RemoteConflict`](crate::Error::RemoteConflict) otherwise).
//! A step is committed in the bucket when exactly `prefix/step-N/manifest.json` is a
//! manifest of step N (the disk's rule, `Remote::list`): it is created (with
//! `PutMode::Create`, `If-None-Match: *` on S3) only after every rank's object is
//! complete and its part is present, by whichever rank sees all parts first; a rank that
//! loses that race finds the manifest present and reports the commit. Nothing else is ever
//! listed or loaded, so a failed or killed upload leaves no visible step; a failed
//! multipart upload is aborted.
//!
//! The rank objects are uploaded from the staging arena (`s3/feed.rs`: each chunk stays
//! pinned until its local write and its part's upload are both done), in `part_size` parts
//! with `concurrency` in flight; bytes whose chunks were given back under staging pressure
//! are read from the committed local file (`s3/upload.rs`).
//!
//! Everything read from the bucket is untrusted: the manifest is size-capped and parsed by
//! [`Manifest::parse`](crate::Manifest::parse), each object's size and safetensors
//! header are checked against it, and every tensor's CRC-32C is verified
//! (`Remote::read_rank`).
//!
//! The tier is a plug-in of the engine (`crate::tier`): this module and its `s3`
//! submodule are the only code that names object_store, and the only code compiled
//! with the `s3` feature alone. The engine holds the opened tier as a
//! `dyn crate::tier::RemoteTier`; `EngineConfig::with_remote` and the tier's public
//! API on `Engine` and `SaveHandle` are defined here (`s3/engine.rs`).

pub use crate::tier::RemoteLoad;

#[cfg(feature = "s3")]
mod s3;
#[cfg(feature = "s3")]
pub use s3::*;

/// The export source of a bucket's step `url` (`s3://bucket/prefix[/step-N]`) and its
/// manifest; a [`crate::error::Error::Config`] in a build without the `s3` feature.
pub(crate) fn export_source(
    url: &str,
) -> crate::error::Result<(Box<dyn crate::tier::RankFiles>, crate::manifest::Manifest)> {
    #[cfg(feature = "s3")]
    {
        let (b, m) = s3::export::BucketStep::open(url)?;
        Ok((Box::new(b), m))
    }
    #[cfg(not(feature = "s3"))]
    Err(crate::error::Error::Config(format!(
        "{url}: this build of shmckpt has no bucket support (the `s3` feature)"
    )))
}
