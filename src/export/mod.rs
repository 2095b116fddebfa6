//! Export a checkpoint to the Hugging Face layout: `model-0000k-of-0000n.safetensors`
//! shards and `model.safetensors.index.json` (docs/export.md).
//!
//! * **Sources**: a checkpoint root (its latest committed step), one `step-N` directory,
//!   or a DCP checkpoint written through `shmckpt.dcp.ShmckptWriter` (any directory
//!   name); `s3://bucket/prefix` (its latest committed step by the bucket's listing rule)
//!   or `s3://bucket/prefix/step-N` (with the `s3` feature); `memory:ROOT`, the images
//!   flash restore keeps in `/dev/shm` for ROOT's latest committed step (one per rank),
//!   readable while their engine runs. The engine reads every source through one
//!   abstraction (`rank_files::RankFiles`); every rank file is checked like every read
//!   (size, header against the manifest, CRC-32C of each tensor read).
//! * **Tensors**: the rank files' tensors grouped by name. A DCP rank file records each
//!   tensor's offsets in the global tensor (`DCP_SHARDING_INFO` in its header); the global
//!   shape is the end of the farthest piece, and the pieces must tile it exactly (no
//!   overlap, every element once). A tensor of a plain checkpoint held by several ranks
//!   (DDP replicas) must be the same on each (dtype, shape, CRC-32C); the lowest rank's is
//!   read.
//! * **Selection** ([`default_names`]): with `include_optimizer` off, when some tensor is
//!   named `model.*` only those are exported, without the `model.` prefix; else every
//!   tensor but those under a top-level optimizer key ([`OPTIMIZER_KEYS`]). Then the
//!   [`Rename`] rules, or an explicit name list.
//! * **Streaming**: every piece is read with ranged reads of the rank file through the
//!   restore path's staging buffers (a few 4 MiB buffers, reads in flight ahead of the one
//!   processed, whatever the tensor sizes), its CRC-32C verified as the bytes pass, and
//!   handed (cast on request) to the shard writer's thread (`writer`: a fixed pool of
//!   buffers), which writes it at its place in the output shard and starts the shards'
//!   write-back as it goes, so the disk writes while the rank files are read.
//! * **Atomic**: the shards and the index are written into `OUT.tmp-<pid>`, synced, and
//!   renamed to `OUT` (exchanged with it when `overwrite` replaces a directory); on any
//!   error the temporary directory is removed and `OUT` is untouched.

mod cast;
mod kept;
mod layout;
mod rank_files;
mod source;
mod writer;

pub use rank_files::MEMORY_PREFIX;
use rank_files::RankFiles;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::manifest::{FileEntry, MANIFEST, Manifest};
use crate::plan::{Plan, TensorSpec};
use crate::restore::{ReadOptions, ReadSink};

use cast::Cast;
use layout::Block;
use writer::ShardWriter;

/// Top-level keys whose tensors are optimizer state, left out unless
/// [`ExportOptions::include_optimizer`].
pub const OPTIMIZER_KEYS: [&str; 6] = [
    "optim",
    "optimizer",
    "optimizers",
    "optim_state",
    "optimizer_state",
    "opt_state",
];

/// The header key of a DCP rank file that gives each tensor's offsets in its global tensor.
const DCP_SHARDING_KEY: &str = "DCP_SHARDING_INFO";

/// Name of the index file.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// Parse a shard size as Hugging Face does: a number of bytes, or a number with a unit,
/// `KB`/`MB`/`GB` (powers of 10) or `KiB`/`MiB`/`GiB` (powers of 2), case-insensitive.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let bad = || {
        Error::Config(format!(
            "invalid size {s:?}: expected e.g. 5GB, 500MB, 5GiB or a byte count"
        ))
    };
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        "TIB" => 1 << 40,
        _ => return Err(bad()),
    };
    let v = if let Ok(n) = num.parse::<u64>() {
        n.checked_mul(mult).ok_or_else(bad)?
    } else {
        let f: f64 = num.parse().map_err(|_| bad())?;
        let v = f * mult as f64;
        if !v.is_finite() || v >= u64::MAX as f64 {
            return Err(bad());
        }
        v as u64
    };
    if v == 0 {
        return Err(bad());
    }
    Ok(v)
}

/// The dtype a cast names: `bf16`/`bfloat16`, `fp16`/`float16`/`half`,
/// `fp32`/`float32`/`float`, or a safetensors name (`BF16`, `F16`, `F32`), case-insensitive.
pub fn parse_dtype(s: &str) -> Result<Dtype> {
    let up = s.trim().to_ascii_uppercase();
    let name = match up.as_str() {
        "BFLOAT16" => "BF16",
        "FP16" | "HALF" | "FLOAT16" => "F16",
        "FP32" | "FLOAT" | "FLOAT32" => "F32",
        other => other,
    };
    name.parse::<Dtype>()
        .map_err(|_| Error::Config(format!("unknown dtype {s:?} (bf16, fp16, fp32)")))
}

/// A renaming rule, applied to each exported name after the default selection, in the
/// order given, each at most once per name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rename {
    /// A name starting with the prefix loses it.
    StripPrefix(String),
    /// A name starting with `from` has that prefix replaced by `to`.
    Prefix {
        /// The prefix replaced.
        from: String,
        /// Its replacement.
        to: String,
    },
}

impl Rename {
    fn apply(&self, name: &str) -> String {
        match self {
            Rename::StripPrefix(p) => name.strip_prefix(p.as_str()).unwrap_or(name).to_owned(),
            Rename::Prefix { from, to } => match name.strip_prefix(from.as_str()) {
                Some(rest) => format!("{to}{rest}"),
                None => name.to_owned(),
            },
        }
    }
}

/// What to export and how.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Largest shard, in bytes (a tensor larger than this gets a shard of its own).
    pub max_shard_size: u64,
    /// Renaming rules, after the default selection.
    pub rename: Vec<Rename>,
    /// An explicit selection instead of `rename`: (name as [`default_names`] lists it,
    /// exported name). Only these tensors are exported.
    pub names: Option<Vec<(String, String)>>,
    /// Cast floating tensors to this dtype (F32 to BF16 or F16, BF16 to F32).
    pub dtype: Option<Dtype>,
    /// Export optimizer state too (and every tensor under its full name).
    pub include_optimizer: bool,
    /// Replace an existing non-empty `out`.
    pub overwrite: bool,
    /// How to read the rank files. The default reads through the page cache
    /// (`direct_io: false`), as `cp` does: the rank files of a checkpoint just written are
    /// usually still there, and O_DIRECT would read them from the disk again while `cp`
    /// (the copy the export's speed is measured against) copies them from memory.
    pub read: ReadOptions,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            max_shard_size: 5_000_000_000,
            rename: Vec::new(),
            names: None,
            dtype: None,
            include_optimizer: false,
            overwrite: false,
            read: ReadOptions {
                direct_io: false,
                ..ReadOptions::default()
            },
        }
    }
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportReport {
    /// The checkpoint directory read.
    pub source: PathBuf,
    /// Its step.
    pub step: u64,
    /// The shard files, in order (names inside `out`), then the index.
    pub files: Vec<String>,
    /// Tensors exported.
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
    /// Bytes read from the rank files.
    pub bytes_read: u64,
    /// Wall time.
    pub seconds: f64,
}

/// A tensor as the export sees it: its name (after the default selection, before renaming)
/// and global dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportTensor {
    /// Name.
    pub name: String,
    /// Dtype.
    pub dtype: Dtype,
    /// Global shape.
    pub shape: Vec<u64>,
}

/// One saved piece of a tensor: tensor `tensor` of rank file `file` (indices into the
/// manifest), a block of the global tensor.
#[derive(Debug, Clone)]
struct Piece {
    file: usize,
    tensor: usize,
    block: Block,
}

/// A global tensor and its pieces.
#[derive(Debug, Clone)]
struct Global {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    pieces: Vec<Piece>,
}

/// Each tensor's offsets in its global tensor, from a DCP rank file's header; `None` for a
/// plain rank file.
fn sharding_of(src: &dyn RankFiles, f: &FileEntry) -> Result<Option<HashMap<String, Vec<u64>>>> {
    dcp_offsets(&src.path_of(f), &src.metadata(f)?)
}

/// Each tensor's offsets in its global tensor, from the `__metadata__` `meta` of the DCP
/// rank file `path` (its `DCP_SHARDING_INFO`); `None` for a plain rank file.
pub(crate) fn dcp_offsets(
    path: &Path,
    meta: &crate::manifest::Metadata,
) -> Result<Option<HashMap<String, Vec<u64>>>> {
    let Some(text) = meta.get(DCP_SHARDING_KEY) else {
        return Ok(None);
    };
    #[derive(serde::Deserialize)]
    struct Info {
        saved_offsets: Vec<u64>,
    }
    let info: HashMap<String, Info> = serde_json::from_str(text)
        .map_err(|e| Error::corrupt(path, None, format!("invalid {DCP_SHARDING_KEY}: {e}")))?;
    Ok(Some(
        info.into_iter()
            .map(|(k, v)| (k, v.saved_offsets))
            .collect(),
    ))
}

/// A piece as the rank files give it: (file, tensor, offsets, sizes).
type RawPiece = (usize, usize, Vec<u64>, Vec<u64>);

/// Every global tensor of the checkpoint, in the order the rank files first name them.
fn inventory(src: &dyn RankFiles, manifest: &Manifest) -> Result<Vec<Global>> {
    let sharding: Vec<Option<HashMap<String, Vec<u64>>>> = manifest
        .files
        .iter()
        .map(|f| sharding_of(src, f))
        .collect::<Result<_>>()?;
    let dcp = sharding.iter().any(Option::is_some);
    if dcp && sharding.iter().any(Option::is_none) {
        return Err(Error::corrupt(
            src.source().join(MANIFEST),
            None,
            format!("some rank files record {DCP_SHARDING_KEY}, others do not"),
        ));
    }
    // (name, dtype, global shape so far, pieces)
    let mut found: Vec<(String, Dtype, Vec<u64>, Vec<RawPiece>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (fi, f) in manifest.files.iter().enumerate() {
        let path = src.path_of(f);
        for (ti, t) in f.tensors.iter().enumerate() {
            let sizes: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
            let (name, offsets) = match &sharding[fi] {
                Some(s) => {
                    let offsets = match s.get(&t.name) {
                        Some(o) if o.len() == sizes.len() => o.clone(),
                        // DCP records a 0-d tensor with one offset 0.
                        Some(o) if sizes.is_empty() && o.iter().all(|&x| x == 0) => Vec::new(),
                        Some(o) => {
                            return Err(Error::corrupt(
                                &path,
                                Some(&t.name),
                                format!(
                                    "{} offsets for a shape of {} dimensions",
                                    o.len(),
                                    sizes.len()
                                ),
                            ));
                        }
                        None => {
                            return Err(Error::corrupt(
                                &path,
                                Some(&t.name),
                                format!("not in {DCP_SHARDING_KEY}"),
                            ));
                        }
                    };
                    // A second piece of one tensor on a rank is saved as `fqn@o1,o2,...`.
                    let suffix = format!(
                        "@{}",
                        offsets
                            .iter()
                            .map(u64::to_string)
                            .collect::<Vec<_>>()
                            .join(",")
                    );
                    let name = match t.name.strip_suffix(&suffix) {
                        Some(fqn) if !offsets.is_empty() && !fqn.is_empty() => fqn.to_owned(),
                        _ => t.name.clone(),
                    };
                    (name, offsets)
                }
                None => (t.name.clone(), vec![0; sizes.len()]),
            };
            let ends: Vec<u64> = offsets
                .iter()
                .zip(&sizes)
                .map(|(o, s)| o.checked_add(*s))
                .collect::<Option<_>>()
                .ok_or_else(|| Error::corrupt(&path, Some(&t.name), "offsets overflow"))?;
            let Some(&g) = index.get(&name) else {
                index.insert(name.clone(), found.len());
                found.push((name, t.dtype, ends, vec![(fi, ti, offsets, sizes)]));
                continue;
            };
            let (_, dtype, shape, pieces) = &mut found[g];
            if *dtype != t.dtype || shape.len() != ends.len() {
                return Err(Error::corrupt(
                    &path,
                    Some(&t.name),
                    format!(
                        "{} {:?} here, {} with {} dimensions in another rank file",
                        t.dtype,
                        t.shape,
                        dtype,
                        shape.len()
                    ),
                ));
            }
            if !dcp {
                // A replica (DDP): must be the same tensor as the one read.
                let (ff, ft, _, _) = pieces[0];
                let first = &manifest.files[ff].tensors[ft];
                if first.shape != t.shape || first.crc32c != t.crc32c {
                    return Err(Error::corrupt(
                        &path,
                        Some(&t.name),
                        format!(
                            "differs from rank {}'s tensor of that name (shape {:?} vs {:?}, \
                             CRC-32C {:08x} vs {:08x}): a sharded tensor saved without its \
                             offsets cannot be exported",
                            manifest.files[ff].rank, t.shape, first.shape, t.crc32c, first.crc32c
                        ),
                    ));
                }
                continue;
            }
            for (s, e) in shape.iter_mut().zip(&ends) {
                *s = (*s).max(*e);
            }
            pieces.push((fi, ti, offsets, sizes));
        }
    }
    // Blocks are made once every piece has been seen (the global shape is then known), and
    // must tile the tensor exactly.
    let mut globals = Vec::with_capacity(found.len());
    for (name, dtype, shape, raw) in found {
        let mut pieces = Vec::with_capacity(raw.len());
        for (file, tensor, offsets, sizes) in raw {
            let block = Block::new(&shape, &offsets, &sizes).ok_or_else(|| {
                Error::corrupt(
                    src.path_of(&manifest.files[file]),
                    Some(&name),
                    "piece outside its tensor, or a shape that overflows",
                )
            })?;
            pieces.push(Piece {
                file,
                tensor,
                block,
            });
        }
        let total = pieces[0].block.global_len();
        let covered = pieces
            .iter()
            .try_fold(0u64, |a, p| a.checked_add(p.block.len()));
        let overlap = pieces
            .iter()
            .enumerate()
            .any(|(i, a)| pieces[i + 1..].iter().any(|b| a.block.overlaps(&b.block)));
        if covered != Some(total) || overlap {
            return Err(Error::corrupt(
                src.source().join(MANIFEST),
                Some(&name),
                format!(
                    "its {} saved pieces do not tile its shape {:?} ({:?} of {total} elements{})",
                    pieces.len(),
                    shape,
                    covered,
                    if overlap { ", overlapping" } else { "" }
                ),
            ));
        }
        globals.push(Global {
            name,
            dtype,
            shape,
            pieces,
        });
    }
    Ok(globals)
}

/// The default selection: (source name, exported name) of every tensor exported, before
/// renaming. See the module documentation.
fn select(names: &[String], include_optimizer: bool) -> Vec<(usize, String)> {
    if include_optimizer {
        return names.iter().cloned().enumerate().collect();
    }
    let model: Vec<(usize, String)> = names
        .iter()
        .enumerate()
        .filter_map(|(i, n)| n.strip_prefix("model.").map(|s| (i, s.to_owned())))
        .collect();
    if !model.is_empty() {
        return model;
    }
    names
        .iter()
        .enumerate()
        .filter(|(_, n)| {
            let top = n.split('.').next().unwrap_or("");
            !OPTIMIZER_KEYS.contains(&top)
        })
        .map(|(i, n)| (i, n.clone()))
        .collect()
}

/// The tensors [`export`] would export from `src` with `include_optimizer`, named after the
/// default selection and before any renaming: what a caller renames (the Python
/// `rename=` callable).
pub fn default_names(src: &Path, include_optimizer: bool) -> Result<Vec<ExportTensor>> {
    let (files, manifest) = source::open(src, &crate::restore::ReadOptions::default())?;
    let globals = inventory(files.as_ref(), &manifest)?;
    let names: Vec<String> = globals.iter().map(|g| g.name.clone()).collect();
    Ok(select(&names, include_optimizer)
        .into_iter()
        .map(|(i, name)| ExportTensor {
            name,
            dtype: globals[i].dtype,
            shape: globals[i].shape.clone(),
        })
        .collect())
}

/// One exported tensor.
struct Out {
    global: usize,
    name: String,
    dtype: Dtype,
    cast: Cast,
    len: u64,
    shard: usize,
    /// Offset of its first byte in its shard file.
    offset: u64,
}

/// Cut `sizes` (in order) into shards of at most `max` bytes as Hugging Face does: a
/// tensor that would overflow the current shard starts a new one; a tensor larger than
/// `max` is alone in its shard. Returns each tensor's shard.
fn plan_shards(sizes: &[u64], max: u64) -> Vec<usize> {
    let mut out = Vec::with_capacity(sizes.len());
    let mut shard = 0usize;
    let mut cur = 0u64;
    let mut empty = true;
    for &s in sizes {
        if !empty && cur.saturating_add(s) > max {
            shard += 1;
            cur = 0;
        }
        cur = cur.saturating_add(s);
        empty = false;
        out.push(shard);
    }
    out
}

/// The file name of shard `k` (0-based) of `n`.
pub fn shard_name(k: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
}

/// Hands each piece's bytes, cast, to the shard writer with their place in the output
/// shards.
struct WriteSink<'a> {
    /// Per tensor of the rank file being read: (output index, its piece's block).
    targets: HashMap<usize, (usize, &'a Block)>,
    outs: &'a [Out],
    writer: &'a mut ShardWriter,
    /// Bytes of an element split between two pieces, per tensor of the rank file.
    carry: HashMap<usize, Vec<u8>>,
    in_es: HashMap<usize, u64>,
}

impl ReadSink for WriteSink<'_> {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        // At most one pool buffer's bytes per job (a bucket's ranged GETs hand larger
        // pieces): the pool bounds the memory whatever the source.
        let mut off = at;
        for part in bytes.chunks(writer::BUF_BYTES) {
            self.piece_part(tensor, off, part)?;
            off += part.len() as u64;
        }
        Ok(())
    }
}

impl WriteSink<'_> {
    fn piece_part(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let Some(&(oi, block)) = self.targets.get(&tensor) else {
            return Ok(());
        };
        let out = &self.outs[oi];
        let es = self.in_es[&tensor];
        let carry = self.carry.entry(tensor).or_default();
        // Whole elements only: a partial one waits for the next piece.
        let start = at - carry.len() as u64;
        let joined: std::borrow::Cow<[u8]> = if carry.is_empty() {
            bytes.into()
        } else {
            let mut v = std::mem::take(carry);
            v.extend_from_slice(bytes);
            v.into()
        };
        let whole = joined.len() as u64 / es * es;
        carry.extend_from_slice(&joined[whole as usize..]);
        if whole == 0 {
            return Ok(());
        }
        let mut job = self.writer.job(out.shard)?;
        if !out.dtype.bits().is_multiple_of(8) {
            // A sub-byte dtype: one whole piece, never cast; its bytes are its unit.
            job.push(out.offset + start, &joined[..whole as usize]);
            return self.writer.send(job);
        }
        let first = start / es;
        let out_es = out.dtype.bits() / 8;
        block.runs(first, whole / es, |g, e, m| {
            let src = &joined[((e - first) * es) as usize..((e - first + m) * es) as usize];
            job.push_with(out.offset + g * out_es, |buf| out.cast.apply(src, buf));
            Ok(())
        })?;
        self.writer.send(job)
    }
}

/// Export the checkpoint `src` to the Hugging Face layout in `out` (see the module
/// documentation). Nothing appears at `out` unless every tensor was read, verified and
/// written.
pub fn export(src: &Path, out: &Path, opts: &ExportOptions) -> Result<ExportReport> {
    let t0 = Instant::now();
    if opts.max_shard_size == 0 {
        return Err(Error::Config("max_shard_size must be positive".into()));
    }
    let (rank_files, manifest) = source::open(src, &opts.read)?;
    let dir = rank_files.source();
    check_out(out, rank_files.local_dir(), opts.overwrite)?;
    let globals = inventory(rank_files.as_ref(), &manifest)?;
    let names: Vec<String> = globals.iter().map(|g| g.name.clone()).collect();
    let selected = select(&names, opts.include_optimizer);
    let chosen: Vec<(usize, String)> = match &opts.names {
        Some(explicit) => {
            let by_name: HashMap<&str, usize> =
                selected.iter().map(|(i, n)| (n.as_str(), *i)).collect();
            explicit
                .iter()
                .map(|(from, to)| {
                    by_name
                        .get(from.as_str())
                        .map(|&i| (i, to.clone()))
                        .ok_or_else(|| Error::Destination {
                            name: from.clone(),
                            reason: "not a tensor of the export's default selection".into(),
                        })
                })
                .collect::<Result<_>>()?
        }
        None => selected
            .into_iter()
            .map(|(i, n)| (i, opts.rename.iter().fold(n, |n, r| r.apply(&n))))
            .collect(),
    };
    if chosen.is_empty() {
        return Err(Error::Config(format!(
            "{}: no tensor to export (include_optimizer={})",
            dir.display(),
            opts.include_optimizer
        )));
    }
    let mut outs = Vec::with_capacity(chosen.len());
    for (gi, name) in chosen {
        let g = &globals[gi];
        let (cast, dtype) = Cast::between(g.dtype, opts.dtype).ok_or_else(|| {
            Error::Config(format!(
                "{name}: cannot cast {} to {} (supported: F32 to BF16 or F16, BF16 to F32)",
                g.dtype,
                opts.dtype.map(|d| d.as_str()).unwrap_or("")
            ))
        })?;
        let shape: Vec<usize> = g
            .shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| Error::corrupt(dir.join(MANIFEST), Some(&g.name), "shape too large"))?;
        let len = dtype.byte_len(&shape).ok_or_else(|| Error::ShapeOverflow {
            name: name.clone(),
            shape: shape.clone(),
        })?;
        if !g.dtype.bits().is_multiple_of(8) && g.pieces.len() != 1 {
            return Err(Error::Config(format!(
                "{name}: a sharded tensor of the sub-byte dtype {} cannot be exported",
                g.dtype
            )));
        }
        outs.push(Out {
            global: gi,
            name,
            dtype,
            cast,
            len,
            shard: 0,
            offset: 0,
        });
    }
    let shards = plan_shards(
        &outs.iter().map(|o| o.len).collect::<Vec<_>>(),
        opts.max_shard_size,
    );
    let n = shards.last().map_or(0, |s| s + 1);
    let mut plans = Vec::with_capacity(n);
    let system: BTreeMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
    for k in 0..n {
        let members: Vec<usize> = (0..outs.len()).filter(|&i| shards[i] == k).collect();
        let specs: Vec<TensorSpec> = members
            .iter()
            .map(|&i| TensorSpec {
                name: outs[i].name.clone(),
                dtype: outs[i].dtype,
                shape: globals[outs[i].global]
                    .shape
                    .iter()
                    .map(|&d| d as usize)
                    .collect(),
                len: outs[i].len,
            })
            .collect();
        let plan = Plan::new(&specs, &system, &BTreeMap::new())?;
        for e in plan.entries() {
            let o = &mut outs[members[e.input]];
            o.shard = k;
            o.offset = e.offset;
        }
        plans.push(plan);
    }

    let tmp = tmp_path(out)?;
    crate::fsops::create_dir(&tmp).map_err(|e| Error::io("mkdir", &tmp, e))?;
    let result = (|| -> Result<(Vec<String>, u64)> {
        let mut files = Vec::with_capacity(n);
        let mut paths = Vec::with_capacity(n);
        let mut names = Vec::with_capacity(n + 1);
        for (k, plan) in plans.iter().enumerate() {
            let name = shard_name(k, n);
            let path = tmp.join(&name);
            let f =
                crate::fsops::create_new_file(&path).map_err(|e| Error::io("create", &path, e))?;
            crate::fsops::set_len(&f, plan.file_len())
                .map_err(|e| Error::io("truncate", &path, e))?;
            crate::fsops::write_all_at(&f, plan.header(), 0)
                .map_err(|e| Error::io_at("write", &path, 0, e))?;
            files.push(f);
            paths.push(path);
            names.push(name);
        }
        // The reads (and their checks) here, the writes on the writer's thread.
        let read = std::thread::scope(|scope| -> Result<u64> {
            let (mut writer, handle) = ShardWriter::start(scope, &files, &paths)?;
            let r = read_into(rank_files.as_ref(), &manifest, &globals, &outs, &mut writer);
            writer.finish(handle, r)
        })?;
        let mut weight_map = BTreeMap::new();
        for o in &outs {
            weight_map.insert(o.name.clone(), names[o.shard].clone());
        }
        for (f, p) in files.iter().zip(&paths) {
            crate::fsops::fsync_file(f).map_err(|e| Error::io("fsync", p, e))?;
        }
        let total: u64 = outs.iter().map(|o| o.len).sum();
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let text = serde_json::to_vec_pretty(&index)
            .map_err(|e| Error::Internal(format!("index JSON: {e}")))?;
        let ip = tmp.join(INDEX_NAME);
        let f = crate::fsops::create_new_file(&ip).map_err(|e| Error::io("create", &ip, e))?;
        crate::fsops::write_all_at(&f, &text, 0).map_err(|e| Error::io_at("write", &ip, 0, e))?;
        crate::fsops::fsync_file(&f).map_err(|e| Error::io("fsync", &ip, e))?;
        names.push(INDEX_NAME.to_owned());
        sync_dir(&tmp)?;
        publish(&tmp, out, opts.overwrite)?;
        Ok((names, read))
    })();
    let (files, bytes_read) = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = crate::fsops::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    Ok(ExportReport {
        source: dir,
        step: manifest.step,
        files,
        tensors: outs.len(),
        bytes: outs.iter().map(|o| o.len).sum(),
        bytes_read,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Read every piece of `outs` from the rank files, in file order, and hand it to `writer`.
/// Returns the bytes read.
fn read_into(
    rank_files: &dyn RankFiles,
    manifest: &Manifest,
    globals: &[Global],
    outs: &[Out],
    writer: &mut ShardWriter,
) -> Result<u64> {
    let mut read = 0u64;
    for (fi, f) in manifest.files.iter().enumerate() {
        let mut targets = HashMap::new();
        let mut in_es = HashMap::new();
        for (oi, o) in outs.iter().enumerate() {
            for p in globals[o.global].pieces.iter().filter(|p| p.file == fi) {
                let t = &f.tensors[p.tensor];
                // Sub-byte dtypes are whole (one piece): bytes are their unit then.
                in_es.insert(p.tensor, (t.dtype.bits() / 8).max(1));
                targets.insert(p.tensor, (oi, &p.block));
            }
        }
        if targets.is_empty() {
            continue;
        }
        let wanted: Vec<bool> = (0..f.tensors.len())
            .map(|i| targets.contains_key(&i))
            .collect();
        let mut sink = WriteSink {
            targets,
            outs,
            writer: &mut *writer,
            carry: HashMap::new(),
            in_es,
        };
        read += rank_files.read_wanted(f, &wanted, &mut sink)?;
    }
    Ok(read)
}

/// `out`'s temporary sibling `OUT.tmp-<pid>`.
fn tmp_path(out: &Path) -> Result<PathBuf> {
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Config(format!("{}: not a directory name", out.display())))?;
    Ok(out.with_file_name(format!("{name}.tmp-{}", std::process::id())))
}

/// Refuse an `out` that is a link or not a directory, that holds a checkpoint, or the
/// source itself, and a non-empty one without `overwrite`.
fn check_out(out: &Path, src_dir: Option<&Path>, overwrite: bool) -> Result<()> {
    let refuse = |reason: &str| {
        Err(Error::UnsafePath {
            path: out.to_owned(),
            reason: reason.to_owned(),
        })
    };
    // `out` itself, or (not there yet) its parent's canonical path and its name.
    let canon_out = std::fs::canonicalize(out).ok().or_else(|| {
        let name = out.file_name()?;
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        Some(std::fs::canonicalize(parent).ok()?.join(name))
    });
    let same = match (canon_out, src_dir.map(std::fs::canonicalize)) {
        (Some(a), Some(Ok(b))) => b.starts_with(&a) || a.starts_with(&b),
        _ => false,
    };
    if same {
        return refuse("the export's destination is the source or inside it; never written");
    }
    let Ok(md) = std::fs::symlink_metadata(out) else {
        return Ok(());
    };
    if !md.is_dir() {
        return refuse("the export's destination exists and is not a directory (or is a link)");
    }
    if std::fs::symlink_metadata(out.join(MANIFEST)).is_ok() {
        return refuse(
            "the export's destination holds a checkpoint (or the source); never replaced",
        );
    }
    let mut rd = std::fs::read_dir(out).map_err(|e| Error::io("read_dir", out, e))?;
    if rd.next().is_some() && !overwrite {
        return refuse("the export's destination exists and is not empty (pass overwrite)");
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    let d = File::open(dir).map_err(|e| Error::io("open", dir, e))?;
    crate::fsops::fsync(d.as_fd()).map_err(|e| Error::io("fsync", dir, e.into()))
}

/// Move the finished `tmp` to `out`: a rename when `out` is absent or empty; an atomic
/// exchange, then removal of the old contents, when `overwrite` replaces a directory.
fn publish(tmp: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    match crate::fsops::rename(tmp, out) {
        Ok(()) => {}
        Err(e)
            if overwrite
                && [rustix::io::Errno::NOTEMPTY, rustix::io::Errno::EXIST]
                    .iter()
                    .any(|x| e.raw_os_error() == Some(x.raw_os_error())) =>
        {
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                tmp,
                rustix::fs::CWD,
                out,
                rustix::fs::RenameFlags::EXCHANGE,
            )
            .map_err(|e| Error::io("rename exchange", out, e.into()))?;
            // `tmp` now holds what `out` held.
            crate::fsops::remove_dir_all(tmp).map_err(|e| Error::io("remove", tmp, e))?;
        }
        Err(e) => return Err(Error::io("rename", out, e)),
    }
    sync_dir(&parent)
}

#[cfg(test)]
mod tests;
