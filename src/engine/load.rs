//! Loads: from the disk, from the kept image in memory (flash restore) and into caller
//! destinations on the host or the device; the disk copy's checks and the manifest.

#[cfg(feature = "s3")]
use super::remote_ops::bucket_or;
use super::*;

impl Engine {
    /// Load this rank's tensors of a committed checkpoint, verifying every checksum.
    ///
    /// The file's data section is read with O_DIRECT (`max(queue_depth, 16)` reads of
    /// 4 MiB in flight) straight into one allocation, and the tensors' bytes are views of
    /// it (no copy; checksums computed on a second thread as the reads complete). When all
    /// tensors of a loaded checkpoint are dropped, the engine keeps that allocation (one
    /// file's size) for its next `load`, so repeated loads do not pay the first touch of
    /// fresh memory again; [`Engine::release_load_buffers`] frees it.
    ///
    /// With [`EngineConfig::with_keep_in_memory`], the step that a previous engine kept in
    /// shared memory, adopted (copied and checked) at open, is served from this engine's
    /// arena; [`Engine::load_with_report`] says which path served the load.
    pub fn load(&self, which: impl Into<StepSel>) -> Result<Checkpoint> {
        self.load_with_report(which).map(|(ck, _)| ck)
    }

    /// [`Engine::load`], also reporting which path served the load and, when flash restore
    /// is on but the disk served it, why.
    ///
    /// With a remote tier (`EngineConfig::with_remote`, feature `s3`), a step the disk does not hold
    /// (or "latest" with no step on disk) is loaded from the bucket
    /// ([`LoadSource::Remote`]).
    ///
    /// A step whose file on the disk is damaged (missing, short, malformed, failing a
    /// checksum, unreadable) is loaded from the bucket too, when the bucket's manifest of
    /// that step lists this rank's file exactly as the disk's does (the same bytes); the
    /// report's `fallback_reason` is the disk's error.
    pub fn load_with_report(&self, which: impl Into<StepSel>) -> Result<(Checkpoint, LoadReport)> {
        self.load_tiers(which.into(), true)
    }

    /// [`Engine::load_with_report`] from memory or the disk only: never the bucket, even
    /// for a step the disk does not hold or holds damaged.
    pub fn load_local_with_report(
        &self,
        which: impl Into<StepSel>,
    ) -> Result<(Checkpoint, LoadReport)> {
        self.load_tiers(which.into(), false)
    }

    #[cfg_attr(not(feature = "s3"), allow(unused_variables))]
    fn load_tiers(&self, which: StepSel, bucket: bool) -> Result<(Checkpoint, LoadReport)> {
        let tiers = if bucket { Tiers::All } else { Tiers::Local };
        // Without the `s3` feature the bucket's arm is compiled out.
        #[cfg_attr(not(feature = "s3"), allow(clippy::infallible_destructuring_match))]
        let info = match self.resolve_in(which, tiers)? {
            Resolved::Local(info) => info,
            #[cfg(feature = "s3")]
            Resolved::Bucket { step, disk } => return self.load_fallback_remote(step, disk),
        };
        let fallback_reason = match self.try_memory(&info)? {
            Memory::Served(ck, disk_problem) => {
                let report = LoadReport {
                    step: info.step,
                    source: LoadSource::Memory,
                    fallback_reason: None,
                    disk_problem,
                };
                return Ok((ck, report));
            }
            Memory::Not(why) => why,
        };
        let ck = match restore::load_owned_pooled(
            &info.dir,
            self.shared.cfg.rank,
            &self.read_options(),
            Some(&self.load_buffers),
        ) {
            Ok(ck) => ck,
            // A damaged file, when the bucket holds the same step's same bytes.
            #[cfg(feature = "s3")]
            Err(e) if bucket && self.bucket_replaces(&info, &e) => {
                return self.load_damaged_from_bucket(&info, e);
            }
            Err(e) => return Err(e),
        };
        let report = LoadReport {
            step: info.step,
            source: LoadSource::Disk,
            fallback_reason,
            disk_problem: None,
        };
        Ok((ck, report))
    }

    /// Flash restore: `info`'s step from the adopted image, if it can serve it, with what
    /// the cheap check of the disk copy found; else why not (`None` with the option off).
    pub(super) fn try_memory(&self, info: &CheckpointInfo) -> Result<Memory> {
        let (image, manifest, _, disk_problem) = match self.memory_image(info)? {
            Ok(found) => found,
            Err(why) => return Ok(Memory::Not(why)),
        };
        let a = image.as_ref().expect("memory_image returns a held image");
        match a.to_checkpoint(&info.dir, &manifest, &self.load_buffers) {
            Ok(ck) => {
                tracing::info!(
                    step = info.step,
                    "load served from the kept image (flash restore)"
                );
                Ok(Memory::Served(ck, disk_problem))
            }
            Err(why) => {
                tracing::warn!(step = info.step, reason = %why, "flash restore not possible; loading from disk");
                Ok(Memory::Not(Some(why)))
            }
        }
    }

    /// Flash restore: the adopted image, locked (a save waits to give it up until the
    /// caller is done with its chunks), with `info`'s manifest, this rank's entry and what
    /// the cheap check of the disk copy found wrong (logged as an error), if it can serve
    /// `info`'s step: else why not (`None` with the option off). The guard always holds an
    /// image when `Ok(Ok)`.
    #[allow(clippy::type_complexity)]
    pub(super) fn memory_image(
        &self,
        info: &CheckpointInfo,
    ) -> Result<
        std::result::Result<
            (
                std::sync::MutexGuard<'_, Option<flash::Adopted>>,
                Manifest,
                manifest::FileEntry,
                Option<String>,
            ),
            Option<String>,
        >,
    > {
        if !self.shared.cfg.keep_in_memory {
            return Ok(Err(None));
        }
        let image = lock(&self.shared.adopted);
        let Some(a) = image.as_ref() else {
            let why = self
                .shared
                .kept_note
                .clone()
                .unwrap_or_else(|| "no kept image (a save started since)".into());
            return Ok(Err(Some(why)));
        };
        let (manifest, entry) = restore::rank_file(&info.dir, self.shared.cfg.rank)?;
        let latest = self.latest()?;
        if let Err(why) = a.check(info.step, &entry, latest) {
            tracing::warn!(step = info.step, reason = %why, "flash restore not possible; loading from disk");
            return Ok(Err(Some(why)));
        }
        let disk_problem = a.check_disk_copy(&info.dir).err();
        if let Some(why) = &disk_problem {
            tracing::error!(step = info.step, problem = %why, "the disk copy of the step served from memory is damaged: a load from disk would fail (`shmckpt verify` checks every byte)");
        }
        Ok(Ok((image, manifest, entry, disk_problem)))
    }

    /// Bytes the engine holds for its next [`Engine::load`] (the allocation of a loaded
    /// checkpoint whose tensors were all dropped).
    pub fn load_buffer_bytes(&self) -> usize {
        self.load_buffers.held_bytes()
    }

    /// Free the memory kept for the next [`Engine::load`].
    pub fn release_load_buffers(&self) {
        self.load_buffers.clear();
        lock(&self.device_ring).take();
    }

    /// Load this rank's tensors into caller buffers, by name, verifying every checksum.
    /// Every tensor of the checkpoint must have a destination of exactly its size. Returns
    /// the step loaded.
    ///
    /// With [`EngineConfig::with_keep_in_memory`], a step held by the image adopted at open
    /// is copied from memory (verified at adoption), like [`Engine::load`]; with a remote
    /// tier, a step not on disk is read from the bucket.
    pub fn load_into(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut [u8])],
    ) -> Result<u64> {
        let which = which.into();
        // Without the `s3` feature the bucket's arm is compiled out.
        #[cfg_attr(not(feature = "s3"), allow(clippy::infallible_destructuring_match))]
        let info = match self.resolve_in(which, Tiers::All)? {
            Resolved::Local(info) => info,
            // Not on disk: from the bucket, with a remote tier.
            #[cfg(feature = "s3")]
            Resolved::Bucket { step, .. } => {
                return self.load_into_remote(step, dest).map(|r| r.step);
            }
        };
        if let Ok((image, _, entry, _)) = self.memory_image(&info)? {
            let named: Vec<(&str, u64)> = dest.iter().map(|(n, b)| (*n, b.len() as u64)).collect();
            let order = restore::match_destinations(&entry, &named)?;
            let mut slots: Vec<Option<&mut [u8]>> =
                dest.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
            let ordered = order
                .iter()
                .map(|&i| slots[i].take().expect("each destination used once"))
                .collect();
            let a = image.as_ref().expect("memory_image returns a held image");
            a.send(&mut HostSink { dest: ordered })?;
            tracing::info!(
                step = info.step,
                "load_into served from the kept image (flash restore)"
            );
            return Ok(info.step);
        }
        match restore::load_into(&info.dir, self.shared.cfg.rank, dest, &self.read_options()) {
            Ok(_) => Ok(info.step),
            // A damaged file, when the bucket holds the same step's same bytes: every
            // destination is written again from there.
            #[cfg(feature = "s3")]
            Err(e) if self.bucket_replaces(&info, &e) => {
                let got = self.load_into_remote(StepSel::Step(info.step), dest);
                bucket_or(info.step, e, got).map(|r| r.step)
            }
            Err(e) => Err(e),
        }
    }

    /// Load this rank's tensors into device buffers, by name, verifying every checksum on
    /// the host before the bytes go to the device. Every tensor needs a buffer of exactly
    /// its size. Returns the step loaded.
    #[allow(unsafe_code)]
    pub fn load_into_device(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut DeviceBuffer)],
    ) -> Result<u64> {
        let slices: Vec<(&str, DeviceSlice<'_>)> =
            dest.iter().map(|(n, b)| (*n, b.slice())).collect();
        // SAFETY: each slice is a whole `DeviceBuffer` borrowed mutably for this call, so it
        // is valid for writes and nobody else uses it until we return.
        unsafe { self.load_into_device_raw(which, &slices) }
    }

    /// [`Engine::load_into_device`] with raw device ranges.
    ///
    /// # Safety
    /// Every range must be device memory of its device, valid for writes of its length and
    /// not accessed by anyone else until this call returns.
    #[allow(unsafe_code)]
    pub unsafe fn load_into_device_raw(
        &self,
        which: impl Into<StepSel>,
        dest: &[(&str, DeviceSlice<'_>)],
    ) -> Result<u64> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.load_into_device_raw_with_report(which, dest) }.map(|r| r.step)
    }

    /// [`Engine::load_into_device`], also reporting which path served the load (flash
    /// restore: the image adopted at open, checked completely then, is copied to the
    /// device straight from the engine's CUDA-registered arena).
    #[allow(unsafe_code)]
    pub fn load_into_device_with_report(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut DeviceBuffer)],
    ) -> Result<LoadReport> {
        let slices: Vec<(&str, DeviceSlice<'_>)> =
            dest.iter().map(|(n, b)| (*n, b.slice())).collect();
        // SAFETY: each slice is a whole `DeviceBuffer` borrowed mutably for this call, so it
        // is valid for writes and nobody else uses it until we return.
        unsafe { self.load_into_device_raw_with_report(which, &slices) }
    }

    /// [`Engine::load_into_device_raw`] with the report of
    /// [`Engine::load_into_device_with_report`]. As [`Engine::load_with_report`], a step
    /// the disk does not hold, or holds damaged, is read from the bucket (the same bytes).
    ///
    /// # Safety
    /// As [`Engine::load_into_device_raw`].
    #[allow(unsafe_code)]
    pub unsafe fn load_into_device_raw_with_report(
        &self,
        which: impl Into<StepSel>,
        dest: &[(&str, DeviceSlice<'_>)],
    ) -> Result<LoadReport> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.load_into_device_tiers(which.into(), dest, true) }
    }

    /// [`Engine::load_into_device_raw_with_report`] from memory or the disk only: never
    /// the bucket.
    ///
    /// # Safety
    /// As [`Engine::load_into_device_raw`].
    #[allow(unsafe_code)]
    pub unsafe fn load_into_device_local_raw_with_report(
        &self,
        which: impl Into<StepSel>,
        dest: &[(&str, DeviceSlice<'_>)],
    ) -> Result<LoadReport> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.load_into_device_tiers(which.into(), dest, false) }
    }

    /// # Safety
    /// As [`Engine::load_into_device_raw`].
    #[allow(unsafe_code)]
    #[cfg_attr(not(feature = "s3"), allow(unused_variables))]
    unsafe fn load_into_device_tiers(
        &self,
        which: StepSel,
        dest: &[(&str, DeviceSlice<'_>)],
        bucket: bool,
    ) -> Result<LoadReport> {
        let tiers = if bucket { Tiers::All } else { Tiers::Local };
        // Without the `s3` feature the bucket's arm is compiled out.
        #[cfg_attr(not(feature = "s3"), allow(clippy::infallible_destructuring_match))]
        let info = match self.resolve_in(which, tiers)? {
            Resolved::Local(info) => info,
            // Not on disk: from the bucket, with a remote tier (through registered
            // buffers, no host copy of the file).
            #[cfg(feature = "s3")]
            Resolved::Bucket { step, disk } => {
                // SAFETY: forwarded from this function's contract.
                let got = unsafe { self.load_into_device_remote_raw(step, dest)? };
                return Ok(LoadReport::from_bucket(got.step, disk.as_ref()));
            }
        };
        let (_, entry) = restore::rank_file(&info.dir, self.shared.cfg.rank)?;
        let named: Vec<(&str, u64)> = dest.iter().map(|(n, d)| (*n, d.len() as u64)).collect();
        let order = restore::match_destinations(&entry, &named)?;
        let ordered: Vec<Option<DeviceSlice<'_>>> =
            order.iter().map(|&i| Some(dest[i].1)).collect();
        let fallback_reason = match self.memory_image(&info)? {
            Ok((image, _, mem_entry, disk_problem)) if mem_entry == entry => {
                // SAFETY: forwarded from this function's contract.
                let mut sink = unsafe { DeviceSink::new(self.shared.cuda(), ordered)? };
                // Every checksum was verified when the image was adopted: straight from the
                // engine's own (CUDA-registered) arena chunks to the device, in file order;
                // the image stays locked (its chunks untouched) until the copies finished.
                let a = image.as_ref().expect("memory_image returns a held image");
                a.send(&mut sink)?;
                tracing::info!(
                    step = info.step,
                    "device load served from the kept image (flash restore)"
                );
                return Ok(LoadReport {
                    step: info.step,
                    source: LoadSource::Memory,
                    fallback_reason: None,
                    disk_problem,
                });
            }
            Ok(_) => Some(format!(
                "the manifest of step {} changed during the load",
                info.step
            )),
            Err(why) => why,
        };
        // From disk: O_DIRECT reads into a small ring of registered buffers of their own
        // (`EngineConfig::with_device_read`), each copied to the device as soon as it is
        // read and checksummed (the staging arena is not used: it may hold a kept image,
        // and its chunks are sized for writes).
        let ring = self.device_ring()?;
        // SAFETY: forwarded from this function's contract.
        let read = unsafe {
            ring.read_to_device(
                &info.dir.join(&entry.file),
                &entry,
                ordered,
                &self.read_options(),
                None,
            )
        };
        match read {
            Ok(_) => {}
            // A damaged file, when the bucket holds the same step's same bytes: every
            // destination is written again from there.
            #[cfg(feature = "s3")]
            Err(e) if bucket && self.bucket_replaces(&info, &e) => {
                let report = LoadReport::from_bucket(info.step, Some(&e));
                // SAFETY: forwarded from this function's contract.
                let got =
                    unsafe { self.load_into_device_remote_raw(StepSel::Step(info.step), dest) };
                return bucket_or(info.step, e, got).map(|_| report);
            }
            Err(e) => return Err(e),
        }
        Ok(LoadReport {
            step: info.step,
            source: LoadSource::Disk,
            fallback_reason,
            disk_problem: None,
        })
    }

    /// Flash restore: check the disk copy of the step the adopted image holds completely,
    /// as `shmckpt verify` does for this rank's file (every byte read, header against the
    /// manifest, every tensor's CRC-32C). Loads served from memory only check the disk
    /// copy's size and header ([`LoadReport::disk_problem`]); call this (on a thread of
    /// your own: it reads the whole file, with the engine's read settings) to learn of
    /// damage inside the data section too. Returns the step checked, `None` when no image
    /// is adopted (none was, or a save dropped it); the error names the file and tensor.
    pub fn verify_disk_copy(&self) -> Result<Option<u64>> {
        let step = lock(&self.shared.adopted).as_ref().map(|a| a.step());
        let Some(step) = step else {
            return Ok(None);
        };
        let info = self.resolve(StepSel::Step(step))?;
        let (_, entry) = restore::rank_file(&info.dir, self.shared.cfg.rank)?;
        restore::read_file(
            &info.dir.join(&entry.file),
            &entry,
            &self.read_options(),
            &mut restore::Discard,
        )?;
        Ok(Some(step))
    }

    /// Manifest of a committed checkpoint.
    pub fn manifest(&self, which: impl Into<StepSel>) -> Result<Manifest> {
        Manifest::read(&self.resolve(which.into())?.dir)
    }

    /// The `__metadata__` of this rank's file of a committed checkpoint, read from the
    /// file's header after the header is checked against the manifest (its tensors, and
    /// its CRC-32C where the manifest records one): each rank's own metadata, which the
    /// manifest (the committing rank's) does not hold for the other ranks.
    pub fn file_metadata(&self, which: impl Into<StepSel>) -> Result<manifest::Metadata> {
        let dir = self.resolve(which.into())?.dir;
        let m = Manifest::read(&dir)?;
        let rank = self.shared.cfg.rank;
        let entry = m.files.iter().find(|f| f.rank == rank).ok_or_else(|| {
            Error::corrupt(
                dir.join(manifest::MANIFEST),
                None,
                format!("the manifest has no file of rank {rank}"),
            )
        })?;
        match restore::read_file_metadata(&dir.join(&entry.file), entry) {
            // A damaged header, when the bucket holds the same step's same bytes.
            #[cfg(feature = "s3")]
            Err(e) if self.bucket_replaces(&CheckpointInfo { step: m.step, dir }, &e) => {
                bucket_or(m.step, e, self.remote_file_metadata(StepSel::Step(m.step)))
            }
            other => other,
        }
    }

    /// The registered read buffers of device loads from disk, made at the first one.
    pub(super) fn device_ring(&self) -> Result<Arc<restore::DeviceRing>> {
        let mut ring = lock(&self.device_ring);
        if let Some(r) = &*ring {
            return Ok(Arc::clone(r));
        }
        let cfg = &self.shared.cfg;
        let r = Arc::new(restore::DeviceRing::new(
            cfg.device_read,
            cfg.device_read_depth,
        )?);
        *ring = Some(Arc::clone(&r));
        Ok(r)
    }

    pub(crate) fn read_options(&self) -> restore::ReadOptions {
        restore::ReadOptions {
            backend: self.shared.cfg.backend,
            queue_depth: self.shared.cfg.queue_depth.max(2),
            direct_io: self.shared.cfg.direct_io,
            // A kept image lives in the arena's chunks, and so does a committed image held
            // for replication (whose chunks are free until the commit): loads must not
            // overwrite them.
            arena: (!self.shared.arena.keeps() && !self.shared.cfg.replica_hold)
                .then(|| Arc::clone(&self.shared.arena)),
            any_dir_name: false,
        }
    }
}

/// What flash restore did for a load.
pub(super) enum Memory {
    /// Served it, with what the cheap check of the disk copy found wrong.
    Served(Checkpoint, Option<String>),
    /// Did not: why (`None` with the option off).
    Not(Option<String>),
}
