//! The tier plug-in interface driven by a tier of the test's own (no object_store: these
//! run in every build, `s3` or not): the engine tells it of each save it takes, in order,
//! and asks it as a restore source; with `replaces_disk` the engine writes no file.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::*;
use crate::engine::{Engine, LoadInto, LoadRequest, LoadSource, Sources, StepSel, Tiers};
use crate::tensor::{AlignedBytes, LoadedTensor};
use crate::util::lock;
use crate::{Dtype, EngineConfig, Tensor};

/// What the test's tier holds and saw.
#[derive(Debug, Default)]
struct Store {
    /// Committed steps: this rank's entry and file bytes.
    steps: BTreeMap<u64, (FileEntry, Vec<u8>)>,
    /// What the engine told it, in order.
    events: Vec<String>,
}

#[derive(Debug, Clone)]
struct FakeSpec {
    store: Arc<Mutex<Store>>,
    replaces_disk: bool,
}

impl TierSpec for FakeSpec {
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    fn replaces_disk(&self) -> bool {
        self.replaces_disk
    }
    fn open(&self, ctx: &TierContext) -> Result<Option<Arc<dyn RemoteTier>>> {
        lock(&self.store)
            .events
            .push(format!("open world_size={}", ctx.world_size));
        Ok(Some(Arc::new(FakeTier {
            store: Arc::clone(&self.store),
            replaces_disk: self.replaces_disk,
        })))
    }
    fn clone_box(&self) -> Box<dyn TierSpec> {
        Box::new(self.clone())
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[derive(Debug)]
struct FakeTier {
    store: Arc<Mutex<Store>>,
    replaces_disk: bool,
}

impl RemoteTier for FakeTier {
    fn replaces_disk(&self) -> bool {
        self.replaces_disk
    }
    fn begin_save(&self, step: u64, n_chunks: u64, chunk_size: u64) -> Arc<dyn TierSave> {
        lock(&self.store)
            .events
            .push(format!("begin {step} chunks={n_chunks}"));
        Arc::new(FakeSave {
            store: Arc::clone(&self.store),
            step,
            chunk_size,
            chunks: Mutex::default(),
        })
    }
    fn reclaim(&self) {}
    fn close(&self) {
        lock(&self.store).events.push("close".into());
    }
    fn url(&self) -> &str {
        "fake://tier"
    }
    fn list(&self) -> Result<Vec<u64>> {
        Ok(lock(&self.store).steps.keys().copied().collect())
    }
    fn latest(&self) -> Result<Option<u64>> {
        Ok(lock(&self.store).steps.keys().next_back().copied())
    }
    fn manifest(&self, step: u64) -> Result<Manifest> {
        Err(Error::NotFound {
            what: format!("step {step} (the test's tier keeps no manifest)"),
            step: Some(step),
            root: self.url().into(),
        })
    }
    fn file_metadata(&self, _step: u64, _rank: u32) -> Result<Metadata> {
        Err(Error::Config("the test's tier keeps no metadata".into()))
    }
    fn read(
        &self,
        step: u64,
        _rank: u32,
        target: &mut Target<'_>,
        _ring: &dyn Fn() -> Result<Arc<DeviceRing>>,
    ) -> Result<(Option<Checkpoint>, RemoteLoad)> {
        let g = lock(&self.store);
        let (entry, file) = g.steps.get(&step).ok_or_else(|| Error::NotFound {
            what: format!("step {step}"),
            step: Some(step),
            root: self.url().into(),
        })?;
        if !matches!(target, Target::Owned) {
            return Err(Error::Config(
                "the test's tier loads into owned buffers".into(),
            ));
        }
        let tensors = entry
            .tensors
            .iter()
            .map(|t| {
                let [a, b] = t.data_offsets.map(|o| (entry.data_start + o) as usize);
                let mut data = AlignedBytes::zeroed(b - a);
                data.as_bytes_mut().copy_from_slice(&file[a..b]);
                LoadedTensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data,
                }
            })
            .collect();
        let ck = Checkpoint {
            step,
            dir: self.url().into(),
            metadata: Metadata::new(),
            tensors,
        };
        let load = RemoteLoad {
            step,
            bytes: file.len() as u64,
            elapsed: Duration::ZERO,
            staged: 0,
            staging: 0,
        };
        Ok((Some(ck), load))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct FakeSave {
    store: Arc<Mutex<Store>>,
    step: u64,
    chunk_size: u64,
    /// The offered chunks' bytes, by file chunk.
    chunks: Mutex<BTreeMap<u64, Vec<u8>>>,
}

impl TierSave for FakeSave {
    fn start(&self, _metadata: &Metadata, rank: u32, file_name: &str, file_len: u64) {
        lock(&self.store).events.push(format!(
            "start {} rank={rank} {file_name} {file_len}",
            self.step
        ));
    }
    fn offer(&self, chunk: u64, lease: ChunkLease, len: usize) {
        lock(&self.chunks).insert(chunk, lease.as_slice()[..len].to_vec());
    }
    fn local_outcome(&self, outcome: LocalOutcome) {
        let step = self.step;
        let mut g = lock(&self.store);
        match outcome {
            LocalOutcome::Committed { entry, file } => {
                let (bytes, from) = match file {
                    // Every byte from the offered chunks (no local file).
                    None => {
                        let mut bytes = vec![0u8; entry.bytes as usize];
                        for (k, c) in lock(&self.chunks).iter() {
                            let at = (k * self.chunk_size) as usize;
                            let n = c.len().min(bytes.len() - at);
                            bytes[at..at + n].copy_from_slice(&c[..n]);
                        }
                        (bytes, "chunks")
                    }
                    Some([first, then]) => (
                        std::fs::read(&first)
                            .or_else(|_| std::fs::read(&then))
                            .unwrap(),
                        "file",
                    ),
                };
                g.events.push(format!("committed {step} from {from}"));
                g.steps.insert(step, (entry, bytes));
            }
            LocalOutcome::Failed(e) => g.events.push(format!("failed {step}: {e}")),
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An engine on `root` with the test's tier (`replaces_disk`: remote only).
fn engine(root: &std::path::Path, store: &Arc<Mutex<Store>>, replaces_disk: bool) -> Engine {
    let mut cfg = EngineConfig::new(root)
        .with_staging_capacity(8 << 20)
        .with_chunk_size(1 << 20)
        .with_writer_threads(1)
        .with_direct_io(false)
        .with_backend(crate::BackendKind::Pwrite);
    cfg.remote = Some(Box::new(FakeSpec {
        store: Arc::clone(store),
        replaces_disk,
    }));
    cfg.build().unwrap()
}

/// One 2.5 MiB tensor (three 1 MiB chunks) whose bytes depend on `step`.
fn data(step: u64) -> Vec<u8> {
    (0..(640u32 << 10))
        .flat_map(|i| (i.wrapping_mul(2_654_435_761) ^ step as u32).to_le_bytes())
        .collect()
}

fn load_from_tier(e: &Engine, step: u64) -> (Vec<u8>, LoadSource) {
    let req = LoadRequest::new(step).with_sources(Sources::BUCKET);
    let got = e.load_with(&req, LoadInto::owned()).unwrap();
    let ck = got.checkpoint.unwrap();
    assert_eq!(ck.tensors.len(), 1);
    (ck.tensors[0].data.as_bytes().to_vec(), got.report.source)
}

/// With a disk: each save is committed on the disk, then handed to the tier with its
/// committed file; the tier's copy is the disk's file byte for byte, and a load from the
/// tier alone reads it back.
#[test]
fn a_tier_is_told_of_each_save_and_serves_loads() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Mutex::new(Store::default()));
    let e = engine(dir.path(), &store, false);
    let d = data(1);
    let t = [Tensor::host("w", Dtype::U8, vec![d.len()], &d)];
    let rep = e.save(1, &t, &Metadata::new()).unwrap().wait().unwrap();
    assert!(rep.dir.is_some());
    e.flush().unwrap();
    let disk = std::fs::read(&rep.file).unwrap();
    let file_name = crate::manifest::rank_file_name(0, 1);
    {
        let g = lock(&store);
        assert_eq!(g.steps[&1].1, disk);
        assert_eq!(g.steps[&1].0.bytes, disk.len() as u64);
        assert_eq!(
            g.events,
            vec![
                "open world_size=1".to_string(),
                "begin 1 chunks=3".into(),
                format!("start 1 rank=0 {file_name} {}", disk.len()),
                "committed 1 from file".into(),
            ]
        );
    }
    assert_eq!(e.latest_in(Tiers::Remote).unwrap(), Some(1));
    assert_eq!(load_from_tier(&e, 1), (d, LoadSource::Remote));
    e.close();
    assert_eq!(lock(&store).events.last().unwrap(), "close");
}

/// `replaces_disk`: the engine opens no file (the root holds only its lock), the tier gets
/// every byte from the offered chunks, and loads of "latest" fall back to it.
#[test]
fn a_tier_that_replaces_the_disk_gets_every_chunk_and_no_file_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Mutex::new(Store::default()));
    let e = engine(dir.path(), &store, true);
    let d = data(2);
    let t = [Tensor::host("w", Dtype::U8, vec![d.len()], &d)];
    let rep = e.save(2, &t, &Metadata::new()).unwrap().wait().unwrap();
    assert_eq!(rep.dir, None);
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec![".shmckpt-rank-0.lock"]);
    assert_eq!(
        lock(&store).events.last().unwrap(),
        "committed 2 from chunks"
    );
    assert!(e.list().unwrap().is_empty());
    assert_eq!(e.latest_in(Tiers::All).unwrap(), Some(2));
    assert_eq!(load_from_tier(&e, 2), (d.clone(), LoadSource::Remote));
    let got = e
        .load_with(&LoadRequest::new(StepSel::Latest), LoadInto::owned())
        .unwrap();
    assert_eq!(got.report.source, LoadSource::Remote);
    assert_eq!(got.checkpoint.unwrap().tensors[0].data.as_bytes(), &d[..]);
    // A disk cadence has no disk to decide for.
    let mut cfg = EngineConfig::new(dir.path()).with_disk_cadence(crate::DiskCadence::Every(2));
    cfg.remote = Some(Box::new(FakeSpec {
        store: Arc::clone(&store),
        replaces_disk: true,
    }));
    assert!(matches!(cfg.validate(), Err(Error::Config(m)) if m.contains("no disk")));
    e.close();
}
