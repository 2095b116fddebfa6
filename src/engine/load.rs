//! Loads: one request ([`LoadRequest`]), one fallback order over the sources (the image
//! kept in memory, the local disk, the bucket), one destination per load ([`LoadInto`]:
//! owned buffers, caller host buffers, device memory); the disk copy's checks and the
//! manifest.

use super::remote_ops::bucket_or;
use super::request::Target;
use super::*;

impl Engine {
    /// Load this rank's tensors of a committed checkpoint into owned buffers, verifying
    /// every checksum: [`Engine::load_with`] with [`LoadInto::owned`]. `req` is a
    /// [`LoadRequest`], a step number or a [`StepSel`] (then from every source).
    ///
    /// From the disk, the file's data section is read with O_DIRECT (`max(queue_depth,
    /// 16)` reads of 4 MiB in flight) straight into one allocation, and the tensors' bytes
    /// are views of it (no copy; checksums computed on a second thread as the reads
    /// complete). When all tensors of a loaded checkpoint are dropped, the engine keeps
    /// that allocation (one file's size) for its next load, so repeated loads do not pay
    /// the first touch of fresh memory again; [`Engine::release_load_buffers`] frees it.
    pub fn load(&self, req: impl Into<LoadRequest>) -> Result<Checkpoint> {
        let got = self.load_with(&req.into(), LoadInto::owned())?;
        Ok(got
            .checkpoint
            .expect("a load into owned buffers returns its checkpoint"))
    }

    /// The one load: `req`'s step from `req`'s sources into `into`, every checksum
    /// verified (for device destinations, on the host before the bytes go to the device).
    ///
    /// # The fallback order
    /// This function is the only place that decides it:
    /// 1. **Which step.** `Engine::resolve_in` with the sources' tiers (the same rule as
    ///    [`Engine::latest_in`]): the disk's committed step when memory or the disk may
    ///    serve and the disk holds it ("latest": the disk's newest); else, with the
    ///    bucket allowed, the bucket's (then the bucket serves: steps 2 and 3 are skipped).
    /// 2. **Memory** (flash restore, [`EngineConfig::with_keep_in_memory`]): the image a
    ///    previous engine kept in shared memory, adopted and checked at open, when it holds
    ///    exactly that step's file. Why it could not is the report's `fallback_reason`.
    /// 3. **Disk**: this rank's file under the step's directory. A damaged file (missing,
    ///    short, malformed, failing a checksum, unreadable) is read from the bucket instead,
    ///    with the bucket allowed, when the bucket's manifest lists this rank's file exactly
    ///    as the disk's does (the same bytes); the report's `fallback_reason` is the disk's
    ///    error, and the disk's error is returned if the bucket's copy fails too. An error
    ///    of the caller's (a destination that does not fit) never falls back.
    /// 4. **Bucket**, with the disk not allowed and memory unable to serve: the step the
    ///    disk lists, from the bucket.
    ///
    /// [`Error::NotFound`] when no source allowed holds the step (for [`Sources::MEMORY`],
    /// when the kept image cannot serve it, with the reason); [`Error::Config`] for an
    /// empty source set, or the bucket asked of an engine without a remote tier.
    ///
    /// # A resume
    /// A load before this engine's first save is a resume from its step: this rank's parts
    /// of uncommitted steps newer than it are withdrawn ([`Engine::withdraw_stale_parts`]).
    pub fn load_with(&self, req: &LoadRequest, into: LoadInto<'_>) -> Result<Loaded> {
        let got = self.load_from_sources(req, into)?;
        self.withdraw_stale_parts(got.report.step);
        Ok(got)
    }

    /// Before this engine's first save (a resume from `loaded`), withdraw this rank's
    /// parts (and their files) of the steps newer than `loaded` that are not committed
    /// (`commit::withdraw_rank`): they are a dead incarnation's (its recovery's
    /// included), the run saves those steps again, and another rank's new save of one must
    /// never merge with this rank's stale part: it would commit a step whose files come
    /// from two runs, and this rank's own save of the step would then fail
    /// ([`Error::StepExists`]). Nothing with one rank (its save replaces the whole partial
    /// directory), nor once this engine began a save (its own parts are never touched).
    /// Best effort: what cannot be withdrawn is logged. Returns the steps withdrawn.
    pub fn withdraw_stale_parts(&self, loaded: u64) -> Vec<u64> {
        let cfg = &self.shared.cfg;
        let began = || {
            self.shared
                .began_saving
                .load(std::sync::atomic::Ordering::Acquire)
        };
        if cfg.world_size < 2 || !self.shared.files || began() {
            return Vec::new();
        }
        let committed: BTreeSet<u64> = match manifest::list_committed(&cfg.root) {
            Ok(c) => c.iter().map(|c| c.step).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "stale parts not withdrawn: the root cannot be listed");
                return Vec::new();
            }
        };
        let steps: Vec<u64> = match manifest::list_partial(&cfg.root) {
            Ok(p) => p
                .into_iter()
                .filter(|s| *s > loaded && !committed.contains(s))
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "stale parts not withdrawn: the root cannot be listed");
                return Vec::new();
            }
        };
        let file_name = manifest::rank_file_name(cfg.rank, cfg.world_size);
        let mut withdrawn = Vec::new();
        // No save begins while the gate is held (a save takes it before it marks
        // `began_saving`): none of this engine's parts is touched.
        self.shared.gate.enter();
        if began() {
            self.shared.gate.leave();
            return withdrawn;
        }
        for step in steps {
            let partial = cfg.root.join(manifest::partial_dir_name(step));
            let part = partial.join(manifest::rank_manifest_name(cfg.rank));
            // A link or anything else in the part's place is not this rank's part.
            if !std::fs::symlink_metadata(&part).is_ok_and(|m| m.file_type().is_file()) {
                continue;
            }
            tracing::warn!(step, loaded, dir = %partial.display(), "resuming from an older step: withdrawing this rank's part of an uncommitted save of a dead run");
            commit::withdraw_rank(&partial, cfg.rank, &file_name);
            withdrawn.push(step);
        }
        self.shared.gate.leave();
        withdrawn
    }

    fn load_from_sources(&self, req: &LoadRequest, into: LoadInto<'_>) -> Result<Loaded> {
        let mut target = into.0;
        let tiers = req
            .sources
            .tiers()
            .ok_or_else(|| Error::Config("a load request needs at least one source".into()))?;
        let info = match self.resolve_with(req.step, tiers, req.sources.memory())? {
            Resolved::Memory(step) => {
                return match self.read_memory_tier(step, &mut target)? {
                    Some(checkpoint) => Ok(Loaded::local(
                        LoadReport {
                            step,
                            source: LoadSource::Memory,
                            fallback_reason: None,
                            disk_problem: None,
                        },
                        checkpoint,
                    )),
                    None => Err(Error::NotFound {
                        what: format!("step {step} (its memory-only save was given up meanwhile)"),
                        step: Some(step),
                        root: self.shared.cfg.root.clone(),
                    }),
                };
            }
            Resolved::Local(info) => info,
            Resolved::Bucket { step, disk } => {
                let report = LoadReport::from_bucket(step, disk.as_ref());
                let (checkpoint, remote) = self.read_bucket(step, &mut target)?;
                tracing::info!(step, "load served from the bucket");
                return Ok(Loaded {
                    report,
                    checkpoint,
                    remote: Some(remote),
                });
            }
        };
        let mut fallback_reason = None;
        if req.sources.memory() {
            match self.read_memory(&info, &mut target)? {
                Ok((checkpoint, disk_problem)) => {
                    let report = LoadReport {
                        step: info.step,
                        source: LoadSource::Memory,
                        fallback_reason: None,
                        disk_problem,
                    };
                    return Ok(Loaded::local(report, checkpoint));
                }
                Err(why) => fallback_reason = why,
            }
        }
        if req.sources.disk() {
            return match self.read_disk(&info, &mut target) {
                Ok(checkpoint) => {
                    let report = LoadReport {
                        step: info.step,
                        source: LoadSource::Disk,
                        fallback_reason,
                        disk_problem: None,
                    };
                    Ok(Loaded::local(report, checkpoint))
                }
                // A damaged file, when the bucket holds the same step's same bytes: every
                // destination is written again from there.
                Err(e) if req.sources.bucket() && self.bucket_replaces(&info, &e) => {
                    let report = LoadReport::from_bucket(info.step, Some(&e));
                    let (checkpoint, remote) =
                        bucket_or(info.step, e, self.read_bucket(info.step, &mut target))?;
                    Ok(Loaded {
                        report,
                        checkpoint,
                        remote: Some(remote),
                    })
                }
                Err(e) => Err(e),
            };
        }
        if req.sources.bucket() {
            let (checkpoint, remote) = self.read_bucket(info.step, &mut target)?;
            let mut report = LoadReport::from_bucket(info.step, None);
            report.fallback_reason = fallback_reason;
            return Ok(Loaded {
                report,
                checkpoint,
                remote: Some(remote),
            });
        }
        let why = fallback_reason.unwrap_or_else(|| "flash restore is off".into());
        Err(Error::NotFound {
            what: format!("step {} in the kept image ({why})", info.step),
            step: Some(info.step),
            root: self.shared.cfg.root.clone(),
        })
    }

    /// Source 1, memory: `info`'s step from the adopted image into `target`, with what the
    /// cheap check of the disk copy found wrong; else why not (`None` with flash restore
    /// off). A destination that does not fit is an error, not a reason to fall back.
    #[allow(unsafe_code, clippy::type_complexity)]
    fn read_memory(
        &self,
        info: &CheckpointInfo,
        target: &mut Target<'_>,
    ) -> Result<std::result::Result<(Option<Checkpoint>, Option<String>), Option<String>>> {
        let (image, manifest, entry, disk_problem) = match self.memory_image(info)? {
            Ok(found) => found,
            Err(why) => return Ok(Err(why)),
        };
        let a = image.as_ref().expect("memory_image returns a held image");
        match target {
            Target::Owned => {
                match a.to_checkpoint(&info.dir, &manifest.metadata, &self.load_buffers) {
                    Ok(ck) => {
                        tracing::info!(
                            step = info.step,
                            "load served from the kept image (flash restore)"
                        );
                        return Ok(Ok((Some(ck), disk_problem)));
                    }
                    Err(why) => {
                        tracing::warn!(step = info.step, reason = %why, "flash restore not possible; loading from disk");
                        return Ok(Err(Some(why)));
                    }
                }
            }
            Target::Host(dest) => {
                let ordered = host_in_file_order(&entry, dest)?;
                a.send(&mut HostSink { dest: ordered })?;
            }
            Target::Device(dest) => {
                let ordered = device_in_file_order(&entry, dest)?;
                // SAFETY: a `Target::Device` holds ranges valid for writes and used by
                // nobody else during the load: `LoadInto::device` borrows whole
                // `DeviceBuffer`s mutably for the load, `LoadInto::device_raw`'s caller
                // promised it.
                let mut sink = unsafe { DeviceSink::new(self.shared.cuda(), ordered)? };
                // Every checksum was verified when the image was adopted: straight from the
                // engine's own (CUDA-registered) arena chunks to the device, in file order;
                // the image stays locked (its chunks untouched) until the copies finished.
                a.send(&mut sink)?;
            }
        }
        tracing::info!(
            step = info.step,
            "load into caller buffers served from the kept image (flash restore)"
        );
        Ok(Ok((None, disk_problem)))
    }

    /// Source 1, memory, for a memory-only step of this engine (`super::memory`): `step`
    /// from the memory tier into `target` (`Some(checkpoint or None for caller buffers)`),
    /// or `None` when the tier no longer holds it. The bytes never left shared memory
    /// (this engine's arena; for a step taken over at open, the dead engine's arena this
    /// engine took over, its layout checked as recovery checks it): they are served
    /// without a checksum (computed when the step goes to disk), as recovery would have
    /// committed them.
    #[allow(unsafe_code)]
    fn read_memory_tier(
        &self,
        step: u64,
        target: &mut Target<'_>,
    ) -> Result<Option<Option<Checkpoint>>> {
        let g = self.shared.memory.lock();
        let Some(m) = g.iter().find(|m| m.step == step) else {
            return Ok(None);
        };
        let a = &m.image;
        let entry = a.entry();
        let dir = self.shared.cfg.root.join(manifest::step_dir_name(step));
        let got = match target {
            Target::Owned => {
                let ck = a
                    .to_checkpoint(&dir, &m.metadata, &self.load_buffers)
                    .map_err(|why| Error::Internal(format!("memory-only step {step}: {why}")))?;
                Some(ck)
            }
            Target::Host(dest) => {
                let ordered = host_in_file_order(entry, dest)?;
                a.send(&mut HostSink { dest: ordered })?;
                None
            }
            Target::Device(dest) => {
                let ordered = device_in_file_order(entry, dest)?;
                // SAFETY: as in `read_memory`: the ranges of a `Target::Device` are valid
                // for writes and used by nobody else during the load.
                let mut sink = unsafe { DeviceSink::new(self.shared.cuda(), ordered)? };
                // The tier stays locked (its chunks untouched) until the copies finished.
                a.send(&mut sink)?;
                None
            }
        };
        tracing::info!(
            step,
            "load served from the memory tier (a memory-only step)"
        );
        Ok(Some(got))
    }

    /// Source 2, the disk: this rank's file of `info`'s step into `target`.
    #[allow(unsafe_code)]
    fn read_disk(
        &self,
        info: &CheckpointInfo,
        target: &mut Target<'_>,
    ) -> Result<Option<Checkpoint>> {
        let rank = self.shared.cfg.rank;
        match target {
            Target::Owned => restore::load_owned_pooled(
                &info.dir,
                rank,
                &self.read_options(),
                Some(&self.load_buffers),
            )
            .map(Some),
            Target::Host(dest) => {
                restore::load_into(&info.dir, rank, dest, &self.read_options()).map(|_| None)
            }
            Target::Device(dest) => {
                let (_, entry) = restore::rank_file(&info.dir, rank)?;
                let ordered = device_in_file_order(&entry, dest)?;
                // O_DIRECT reads into a small ring of registered buffers of their own
                // (`EngineConfig::with_device_read`), each copied to the device as soon as
                // it is read and checksummed (the staging arena is not used: it may hold a
                // kept image, and its chunks are sized for writes).
                let ring = self.device_ring()?;
                // SAFETY: as in `read_memory`: the ranges of a `Target::Device` are valid
                // for writes and used by nobody else during the load.
                unsafe {
                    ring.read_to_device(
                        &info.dir.join(&entry.file),
                        &entry,
                        ordered,
                        &self.read_options(),
                        None,
                    )
                }
                .map(|_| None)
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
        let latest = self.disk_latest()?;
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

    /// Manifest of a committed checkpoint, or of a memory-only step of this engine
    /// (`EngineConfig::with_disk_cadence`; this rank's file alone, checksums 0): the step
    /// a load of `which` reads from memory or the disk.
    pub fn manifest(&self, which: impl Into<StepSel>) -> Result<Manifest> {
        let which = which.into();
        if let Some((m, _)) = self.memory_resolved(which)? {
            return Ok(m);
        }
        Manifest::read(&self.resolve(which)?.dir)
    }

    /// The memory tier's manifest and header metadata when `which` resolves to its step.
    fn memory_resolved(&self, which: StepSel) -> Result<Option<(Manifest, manifest::Metadata)>> {
        match self.resolve_with(which, Tiers::Local, true) {
            Ok(Resolved::Memory(step)) => Ok(self.memory_manifest(step)),
            _ => Ok(None),
        }
    }

    /// The `__metadata__` of this rank's file of a committed checkpoint, read from the
    /// file's header after the header is checked against the manifest (its tensors, and
    /// its CRC-32C where the manifest records one): each rank's own metadata, which the
    /// manifest (the committing rank's) does not hold for the other ranks.
    pub fn file_metadata(&self, which: impl Into<StepSel>) -> Result<manifest::Metadata> {
        let which = which.into();
        if let Some((_, meta)) = self.memory_resolved(which)? {
            return Ok(meta);
        }
        let dir = self.resolve(which)?.dir;
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
            Err(e) if self.bucket_replaces(&CheckpointInfo { step: m.step, dir }, &e) => {
                bucket_or(m.step, e, self.tier_file_metadata(StepSel::Step(m.step)))
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

impl Loaded {
    /// A load that memory or the disk served.
    fn local(report: LoadReport, checkpoint: Option<Checkpoint>) -> Self {
        Loaded {
            report,
            checkpoint,
            remote: None,
        }
    }
}

/// The caller's host buffers reordered into `entry`'s file order (each tensor exactly one
/// destination of exactly its size, else [`Error::Destination`]).
fn host_in_file_order<'b>(
    entry: &manifest::FileEntry,
    dest: &'b mut [(&str, &mut [u8])],
) -> Result<Vec<&'b mut [u8]>> {
    let named: Vec<(&str, u64)> = dest.iter().map(|(n, b)| (*n, b.len() as u64)).collect();
    let order = restore::match_destinations(entry, &named)?;
    let mut slots: Vec<Option<&mut [u8]>> = dest.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
    Ok(order
        .iter()
        .map(|&i| slots[i].take().expect("each destination used once"))
        .collect())
}

/// The caller's device ranges in `entry`'s file order, as [`host_in_file_order`].
fn device_in_file_order<'d>(
    entry: &manifest::FileEntry,
    dest: &[(&str, DeviceSlice<'d>)],
) -> Result<Vec<Option<DeviceSlice<'d>>>> {
    let named: Vec<(&str, u64)> = dest.iter().map(|(n, d)| (*n, d.len() as u64)).collect();
    let order = restore::match_destinations(entry, &named)?;
    Ok(order.iter().map(|&i| Some(dest[i].1)).collect())
}
