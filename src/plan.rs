//! From a tensor list to the exact image of the safetensors file: pure, no I/O.
//!
//! File layout (the safetensors format):
//!
//! ```text
//! [u64 LE: n][n bytes: JSON header, padded with spaces][tensor bytes, no holes, no tail]
//! ```
//!
//! `8 + n` is a multiple of [`DATA_ALIGN`], so the data section starts on a 4096-byte
//! boundary. Tensors are ordered by decreasing element alignment (8, 4, 2, 1 bytes), keeping
//! the caller's order within a class, so every tensor starts at a multiple of its element
//! size (each tensor's length is a multiple of its own element size, and all that precede it
//! are multiples of a larger power of two).

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// The data section starts at a multiple of this (the O_DIRECT alignment we use).
pub const DATA_ALIGN: u64 = 4096;
/// Largest header the safetensors reader accepts.
pub const MAX_HEADER_LEN: u64 = 100_000_000;
/// Longest tensor name accepted (bytes of UTF-8).
pub const MAX_NAME_LEN: usize = 65_536;
/// Prefix of the metadata keys shmckpt writes itself; user keys may not use it.
pub const RESERVED_PREFIX: &str = "shmckpt.";
/// Metadata key holding the step.
pub const META_STEP: &str = "shmckpt.step";
/// Metadata key holding the rank.
pub const META_RANK: &str = "shmckpt.rank";
/// Metadata key holding the world size.
pub const META_WORLD: &str = "shmckpt.world_size";
/// Metadata key holding the writer's session ([`crate::manifest::FileEntry::session`]),
/// when it has one: a recovery commits the file under the session that saved it.
pub const META_SESSION: &str = "shmckpt.session";

/// What the planner needs to know about one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes the caller provides.
    pub len: u64,
}

/// One tensor's place in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Index of the tensor in the list given to the planner.
    pub input: usize,
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Entry {
    /// Offsets relative to the data section, as the safetensors header writes them.
    pub fn data_offsets(&self, data_start: u64) -> [u64; 2] {
        let b = self.offset - data_start;
        [b, b + self.len]
    }
}

/// Where the bytes of a piece of a chunk come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceSource {
    /// `len` bytes of the header, from this offset in [`Plan::header`].
    Header {
        /// Offset in the header bytes.
        at: u64,
    },
    /// `len` bytes of tensor `entry` (index into [`Plan::entries`]) from this offset in it.
    Tensor {
        /// Index into `Plan::entries`.
        entry: usize,
        /// Offset inside the tensor.
        at: u64,
    },
}

/// A contiguous run of bytes of one chunk that come from one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Source of the bytes.
    pub source: PieceSource,
    /// Offset inside the chunk.
    pub dst: usize,
    /// Length.
    pub len: usize,
}

/// The complete image of one safetensors file.
#[derive(Debug, Clone)]
pub struct Plan {
    header: Vec<u8>,
    /// Shared with the next plan of the same tensors ([`PlanCache`]) when its data section
    /// starts at the same offset.
    entries: Arc<[Entry]>,
    file_len: u64,
}

/// One tensor as the planner sees it, borrowed from the caller ([`PlanCache::plan`]).
#[derive(Debug, Clone, Copy)]
pub struct SpecRef<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [usize],
    /// Bytes the caller provides.
    pub len: u64,
}

impl SpecRef<'_> {
    fn is(&self, t: &TensorSpec) -> bool {
        self.name == t.name && self.dtype == t.dtype && self.shape == t.shape && self.len == t.len
    }

    fn to_spec(self) -> TensorSpec {
        TensorSpec {
            name: self.name.to_owned(),
            dtype: self.dtype,
            shape: self.shape.to_vec(),
            len: self.len,
        }
    }
}

/// What a plan is made of apart from the keys shmckpt adds (`system`, which change at
/// every save): the tensors' layout and JSON and the caller's metadata's JSON, made once
/// per distinct list of tensors and metadata ([`PlanCache`]).
#[derive(Debug)]
struct Layout {
    /// `,"key":"value"` per pair of the caller's metadata.
    metadata_json: String,
    /// `}` (closing `__metadata__`), then `,"name":{...}` per tensor in file order, then
    /// `}`.
    tensors_json: String,
    /// The tensors in file order, `offset` relative to the data section.
    entries: Vec<Entry>,
    /// Bytes of the data section.
    data_len: u64,
}

impl Layout {
    /// Validate `tensors` and lay them out: the layout (what [`PlanCache`] keeps) and the
    /// plan with `system`'s keys ([`Plan::new`]).
    fn with_plan(
        tensors: &[TensorSpec],
        system: &BTreeMap<String, String>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(Layout, Plan)> {
        validate(tensors, metadata)?;
        let layout = Layout::of(tensors, metadata)?;
        let header = layout.header(system)?;
        let entries = layout.placed(header.len() as u64);
        let plan = layout.plan(header, entries)?;
        Ok((layout, plan))
    }

    /// Lay out `tensors` (validated) and render their JSON and `metadata`'s.
    fn of(tensors: &[TensorSpec], metadata: &BTreeMap<String, String>) -> Result<Layout> {
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(tensors[i].dtype.alignment()));

        // Data-relative offsets first: the JSON holds them.
        let mut entries = Vec::with_capacity(tensors.len());
        let mut at = 0u64;
        for &i in &order {
            let t = &tensors[i];
            entries.push(Entry {
                input: i,
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                offset: at,
                len: t.len,
            });
            at = at.checked_add(t.len).ok_or(Error::SizeOverflow {
                what: "the total size of the tensors",
            })?;
        }

        let mut metadata_json = String::with_capacity(
            metadata
                .iter()
                .map(|(k, v)| k.len() + v.len() + 8)
                .fold(0, usize::saturating_add),
        );
        push_pairs(&mut metadata_json, metadata);
        // Room for every piece without growing: names, shapes and offsets (at most 20
        // digits and a comma each).
        let text: usize = tensors
            .iter()
            .map(|t| t.name.len() + 21 * t.shape.len() + 96)
            .fold(8, usize::saturating_add);
        let mut json = String::with_capacity(text);
        json.push('}');
        for e in &entries {
            json.push(',');
            push_json_str(&mut json, &e.name);
            json.push_str(":{\"dtype\":\"");
            json.push_str(e.dtype.as_str());
            json.push_str("\",\"shape\":[");
            for (d, dim) in e.shape.iter().enumerate() {
                if d > 0 {
                    json.push(',');
                }
                push_u64(&mut json, *dim as u64);
            }
            json.push_str("],\"data_offsets\":[");
            push_u64(&mut json, e.offset);
            json.push(',');
            push_u64(&mut json, e.offset + e.len);
            json.push_str("]}");
        }
        json.push('}');
        Ok(Layout {
            metadata_json,
            tensors_json: json,
            entries,
            data_len: at,
        })
    }

    /// The header with `system`'s keys first in `__metadata__`, padded so that the data
    /// section starts at a multiple of [`DATA_ALIGN`].
    fn header(&self, system: &BTreeMap<String, String>) -> Result<Vec<u8>> {
        let mut json = String::with_capacity(
            system
                .iter()
                .map(|(k, v)| k.len() + v.len() + 8)
                .fold(32, usize::saturating_add)
                .saturating_add(self.metadata_json.len())
                .saturating_add(self.tensors_json.len()),
        );
        json.push_str("{\"__metadata__\":");
        let pairs = json.len();
        push_pairs(&mut json, system);
        json.push_str(&self.metadata_json);
        // Every pair starts with a comma: the first one's opens the object instead.
        if json.len() == pairs {
            json.push('{');
        } else {
            json.replace_range(pairs..pairs + 1, "{");
        }
        json.push_str(&self.tensors_json);

        let unpadded = 8 + json.len() as u64;
        let data_start = unpadded.div_ceil(DATA_ALIGN) * DATA_ALIGN;
        let n = data_start - 8;
        if n > MAX_HEADER_LEN {
            return Err(Error::HeaderTooLarge {
                len: n,
                max: MAX_HEADER_LEN,
            });
        }
        let mut header = Vec::with_capacity(data_start as usize);
        header.extend_from_slice(&n.to_le_bytes());
        header.extend_from_slice(json.as_bytes());
        header.resize(data_start as usize, b' ');
        Ok(header)
    }

    /// The entries with the data section at `data_start`.
    fn placed(&self, data_start: u64) -> Arc<[Entry]> {
        self.entries
            .iter()
            .map(|e| Entry {
                offset: data_start + e.offset,
                ..e.clone()
            })
            .collect()
    }

    /// The plan with `header` ([`Layout::header`]) and the entries placed after it.
    fn plan(&self, header: Vec<u8>, entries: Arc<[Entry]>) -> Result<Plan> {
        let file_len =
            (header.len() as u64)
                .checked_add(self.data_len)
                .ok_or(Error::SizeOverflow {
                    what: "the checkpoint file size",
                })?;
        Ok(Plan {
            header,
            entries,
            file_len,
        })
    }
}

/// The last layout an engine made, reused by its next save of the same tensors (the same
/// names, dtypes, shapes and lengths in the same order) with the same metadata: only the
/// keys shmckpt adds (the step, ...) are rendered again, and the entries are shared while
/// the data section starts at the same offset. A plan made through it is the plan
/// [`Plan::new`] makes, byte for byte (test `a_cached_layout_makes_the_plan_plan_new_makes`).
#[derive(Debug, Default)]
pub struct PlanCache {
    last: Option<Cached>,
}

#[derive(Debug)]
struct Cached {
    /// What the layout was made for (validated).
    specs: Vec<TensorSpec>,
    metadata: BTreeMap<String, String>,
    layout: Layout,
    /// The entries of the last plan, and where its data section started.
    placed: (u64, Arc<[Entry]>),
}

impl PlanCache {
    /// [`Plan::new`] of `tensors`, reusing the last layout when `tensors` and `metadata`
    /// are those it was made for. A list that fails validation leaves the cache as it was.
    pub fn plan<'a, I>(
        &mut self,
        tensors: I,
        system: &BTreeMap<String, String>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Plan>
    where
        I: ExactSizeIterator<Item = SpecRef<'a>> + Clone,
    {
        if let Some(c) = &mut self.last {
            let same = c.specs.len() == tensors.len()
                && tensors.clone().zip(&c.specs).all(|(r, t)| r.is(t))
                && c.metadata == *metadata;
            if same {
                let header = c.layout.header(system)?;
                let data_start = header.len() as u64;
                if c.placed.0 != data_start {
                    c.placed = (data_start, c.layout.placed(data_start));
                }
                return c.layout.plan(header, Arc::clone(&c.placed.1));
            }
        }
        let specs: Vec<TensorSpec> = tensors.map(SpecRef::to_spec).collect();
        let (layout, plan) = Layout::with_plan(&specs, system, metadata)?;
        self.last = Some(Cached {
            specs,
            metadata: metadata.clone(),
            layout,
            placed: (plan.data_start(), Arc::clone(&plan.entries)),
        });
        Ok(plan)
    }
}

impl Plan {
    /// Validate `tensors` and lay them out. `metadata` goes into `__metadata__` after the
    /// keys shmckpt adds (`shmckpt.step`, ...), which are passed in `system`.
    pub fn new(
        tensors: &[TensorSpec],
        system: &BTreeMap<String, String>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Plan> {
        Layout::with_plan(tensors, system, metadata).map(|(_, plan)| plan)
    }

    /// The plan of a file already laid out: its `header` (the length prefix, the JSON and
    /// its padding, as staged) and its tensors in file order (name, dtype, shape and
    /// `data_offsets` relative to the data section, which ends at `file_len`). Used to take over a memory-only save
    /// that a dead engine staged (`crate::recover`): nothing in it is trusted, so the
    /// layout is checked: the data section aligned, every tensor's length its dtype and
    /// shape's, the tensors in order without overlap, inside the file.
    /// [`Error::Internal`] names what is wrong.
    pub fn from_layout<'a>(
        header: Vec<u8>,
        tensors: impl IntoIterator<Item = (&'a str, Dtype, &'a [usize], [u64; 2])>,
        file_len: u64,
    ) -> Result<Plan> {
        let bad = |why: String| Err(Error::Internal(format!("staged layout: {why}")));
        let data_start = header.len() as u64;
        if data_start < 8 || !data_start.is_multiple_of(DATA_ALIGN) || data_start > file_len {
            return bad(format!(
                "a header of {data_start} bytes in a file of {file_len}"
            ));
        }
        let mut entries = Vec::new();
        let mut end = data_start;
        for (i, (name, dtype, shape, [b, e])) in tensors.into_iter().enumerate() {
            let (Some(ab), Some(ae)) = (data_start.checked_add(b), data_start.checked_add(e))
            else {
                return bad(format!("tensor {name:?} lies past the address space"));
            };
            if b > e || ab < end || ae > file_len {
                return bad(format!(
                    "tensor {name:?} at [{b}, {e}) overlaps another or lies outside the data section"
                ));
            }
            if dtype.byte_len(shape) != Some(e - b) {
                return bad(format!(
                    "tensor {name:?} holds {} bytes, not its dtype and shape's",
                    e - b
                ));
            }
            end = ae;
            entries.push(Entry {
                input: i,
                name: name.to_owned(),
                dtype,
                shape: shape.to_vec(),
                offset: ab,
                len: e - b,
            });
        }
        Ok(Plan {
            header,
            entries: entries.into(),
            file_len,
        })
    }

    /// Header bytes: the 8-byte length, the JSON and its padding. Its length is the offset
    /// of the data section.
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// Offset of the data section (a multiple of [`DATA_ALIGN`]).
    pub fn data_start(&self) -> u64 {
        self.header.len() as u64
    }

    /// Tensors in file order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Exact file length.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Number of chunks of `chunk_size` bytes the file image spans.
    pub fn chunk_count(&self, chunk_size: u64) -> u64 {
        self.file_len.div_ceil(chunk_size)
    }

    /// File range of chunk `index`.
    pub fn chunk_range(&self, index: u64, chunk_size: u64) -> Range<u64> {
        let start = index * chunk_size;
        start..(start + chunk_size).min(self.file_len)
    }

    /// The pieces that make up file range `range`, in file order. Zero-length tensors
    /// produce no piece.
    pub fn pieces(&self, range: Range<u64>) -> Vec<Piece> {
        let mut out = Vec::new();
        let base = range.start;
        let hdr_end = self.data_start();
        if range.start < hdr_end {
            let end = range.end.min(hdr_end);
            out.push(Piece {
                source: PieceSource::Header { at: range.start },
                dst: 0,
                len: (end - range.start) as usize,
            });
        }
        // First entry whose end lies past range.start.
        let first = self
            .entries
            .partition_point(|e| e.offset + e.len <= range.start);
        for (idx, e) in self.entries.iter().enumerate().skip(first) {
            if e.offset >= range.end {
                break;
            }
            if e.len == 0 {
                continue;
            }
            let s = e.offset.max(range.start);
            let t = (e.offset + e.len).min(range.end);
            out.push(Piece {
                source: PieceSource::Tensor {
                    entry: idx,
                    at: s - e.offset,
                },
                dst: (s - base) as usize,
                len: (t - s) as usize,
            });
        }
        out
    }
}

fn validate(tensors: &[TensorSpec], metadata: &BTreeMap<String, String>) -> Result<()> {
    let mut seen = HashSet::with_capacity(tensors.len());
    for (index, t) in tensors.iter().enumerate() {
        if t.name.is_empty() {
            return Err(Error::EmptyName { index });
        }
        if t.name.len() > MAX_NAME_LEN {
            return Err(Error::InvalidName {
                name: truncate(&t.name),
                reason: format!("{} bytes long, the limit is {MAX_NAME_LEN}", t.name.len()),
            });
        }
        if t.name == "__metadata__" {
            return Err(Error::InvalidName {
                name: t.name.clone(),
                reason: "reserved by the safetensors format".to_owned(),
            });
        }
        if !seen.insert(t.name.as_str()) {
            return Err(Error::DuplicateName {
                name: t.name.clone(),
            });
        }
        let expected = t.dtype.byte_len(&t.shape);
        if expected.is_none() && t.dtype.bits() % 8 == 0 {
            return Err(Error::ShapeOverflow {
                name: t.name.clone(),
                shape: t.shape.clone(),
            });
        }
        if expected != Some(t.len) {
            return Err(Error::SizeMismatch {
                name: t.name.clone(),
                dtype: t.dtype.as_str(),
                shape: t.shape.clone(),
                expected,
                actual: t.len,
            });
        }
    }
    for key in metadata.keys() {
        if key.starts_with(RESERVED_PREFIX) {
            return Err(Error::InvalidMetadata {
                key: key.clone(),
                reason: format!("keys starting with {RESERVED_PREFIX:?} are reserved"),
            });
        }
    }
    Ok(())
}

fn truncate(s: &str) -> String {
    let mut end = s.len().min(80);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// `s` as a JSON string: quoted as it is when nothing in it needs an escape (no quote,
/// backslash or control character), else escaped by serde_json (exactly as JSON requires).
fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
        return;
    }
    // A String never fails to serialize.
    out.push_str(&serde_json::to_string(s).expect("string serialization is infallible"));
}

/// `,"key":"value"` for each pair of `pairs`, in order.
fn push_pairs(out: &mut String, pairs: &BTreeMap<String, String>) {
    for (k, v) in pairs {
        out.push(',');
        push_json_str(out, k);
        out.push(':');
        push_json_str(out, v);
    }
}

/// `n` in decimal, without allocating.
fn push_u64(out: &mut String, mut n: u64) {
    let mut buf = [0u8; 20]; // u64::MAX has 20 digits
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &buf[at..] {
        out.push(char::from(d));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(name: &str, dtype: Dtype, shape: &[usize]) -> TensorSpec {
        TensorSpec {
            name: name.to_owned(),
            dtype,
            shape: shape.to_vec(),
            len: dtype.byte_len(shape).unwrap(),
        }
    }

    /// A plan rebuilt from its own header and file-order layout equals it (entries, file
    /// length, header, pieces); layouts that overlap, leave the file, disagree with their
    /// dtype and shape, or start the data unaligned are refused.
    #[test]
    fn from_layout_rebuilds_a_plan_and_refuses_bad_layouts() {
        let tensors = [
            spec("a", Dtype::F32, &[3, 5]),
            spec("b", Dtype::BF16, &[7]),
            spec("c", Dtype::I64, &[2]),
        ];
        let p = Plan::new(&tensors, &BTreeMap::new(), &BTreeMap::new()).unwrap();
        let ds = p.data_start();
        let layout: Vec<(String, Dtype, Vec<usize>, [u64; 2])> = p
            .entries()
            .iter()
            .map(|e| (e.name.clone(), e.dtype, e.shape.clone(), e.data_offsets(ds)))
            .collect();
        let of = |l: &[(String, Dtype, Vec<usize>, [u64; 2])], header: Vec<u8>, len: u64| {
            Plan::from_layout(
                header,
                l.iter()
                    .map(|(n, d, s, o)| (n.as_str(), *d, s.as_slice(), *o)),
                len,
            )
        };
        let q = of(&layout, p.header().to_vec(), p.file_len()).unwrap();
        assert_eq!(q.header(), p.header());
        assert_eq!(q.file_len(), p.file_len());
        let strip = |x: &Plan| {
            x.entries()
                .iter()
                .map(|e| (e.name.clone(), e.offset, e.len))
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(&q), strip(&p));
        for k in 0..p.chunk_count(64) {
            assert_eq!(
                q.pieces(q.chunk_range(k, 64)),
                p.pieces(p.chunk_range(k, 64))
            );
        }
        // Overlap: the second tensor starts inside the first.
        let mut bad = layout.clone();
        bad[1].3 = [
            bad[0].3[1] - 4,
            bad[0].3[1] - 4 + (bad[1].3[1] - bad[1].3[0]),
        ];
        assert!(of(&bad, p.header().to_vec(), p.file_len()).is_err());
        // Past the file's end.
        assert!(of(&layout, p.header().to_vec(), p.file_len() - 1).is_err());
        // A length that is not the dtype and shape's.
        let mut bad = layout.clone();
        bad[2].2 = vec![3];
        assert!(of(&bad, p.header().to_vec(), p.file_len()).is_err());
        // A header whose end is not aligned.
        let mut short = p.header().to_vec();
        short.pop();
        assert!(of(&layout, short, p.file_len()).is_err());
    }

    fn no_meta() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    fn refs(ts: &[TensorSpec]) -> impl ExactSizeIterator<Item = SpecRef<'_>> + Clone {
        ts.iter().map(|t| SpecRef {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            len: t.len,
        })
    }

    type Meta = BTreeMap<String, String>;

    fn meta(pairs: &[(&str, &str)]) -> Meta {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Through the cache, every plan is `Plan::new`'s, byte for byte, whether its layout is
    /// reused (same tensors and metadata, another step, a step long enough to move the
    /// data section) or made anew (a shape, a name, a dtype or the metadata changed), with
    /// or without system keys; a list that fails validation fails as `Plan::new` fails and
    /// leaves the cache to the last valid list.
    #[test]
    fn a_cached_layout_makes_the_plan_plan_new_makes() {
        let base = vec![
            spec("a", Dtype::BF16, &[3, 5]),
            spec("b\"q", Dtype::F32, &[7]),
            spec("c", Dtype::I64, &[2]),
            spec("e", Dtype::U8, &[0]),
        ];
        // A value sized so that a longer step pushes the JSON past 4096 - 8 bytes.
        let step = |n: &str| meta(&[("shmckpt.step", n), ("shmckpt.rank", "0")]);
        let probe = Plan::new(&base, &step("1"), &meta(&[("m", "")])).unwrap();
        let json_len = u64::from_le_bytes(probe.header()[..8].try_into().unwrap()) as usize;
        let trimmed = probe.header()[8..8 + json_len]
            .iter()
            .rposition(|&b| b != b' ')
            .unwrap()
            + 1;
        let fill = "x".repeat(4096 - 8 - trimmed - 2);
        let mut shape2 = base.clone();
        shape2[0] = spec("a", Dtype::BF16, &[5, 3]);
        let mut renamed = base.clone();
        renamed[2] = spec("d", Dtype::I64, &[2]);
        let mut retyped = base.clone();
        retyped[1] = spec("b\"q", Dtype::I32, &[7]);
        let dup = vec![spec("a", Dtype::F32, &[1]), spec("a", Dtype::F32, &[1])];
        let cases: Vec<(&[TensorSpec], Meta, Meta)> = vec![
            (&base, step("1"), meta(&[("m", &fill)])),
            (&base, step("2"), meta(&[("m", &fill)])),
            (&base, step("100000"), meta(&[("m", &fill)])), // the data section moves
            (&base, step("3"), meta(&[("m", &fill)])),      // and back
            (&shape2, step("4"), meta(&[("m", &fill)])),
            (&shape2, step("5"), meta(&[("m", "other \"value\"\n")])),
            (&renamed, step("6"), meta(&[("m", "other \"value\"\n")])),
            (&retyped, step("7"), no_meta()),
            (&retyped, no_meta(), meta(&[("k", "v"), ("l", "w")])),
            (&retyped, no_meta(), no_meta()),
            (&dup, step("8"), no_meta()),
            (&retyped, step("9"), no_meta()),
            (&retyped, step("10"), meta(&[("shmckpt.x", "reserved")])),
            (&retyped, step("11"), no_meta()),
        ];
        let mut cache = PlanCache::default();
        let mut starts = Vec::new();
        for (i, (ts, system, metadata)) in cases.iter().enumerate() {
            let want = Plan::new(ts, system, metadata);
            let got = cache.plan(refs(ts), system, metadata);
            match (want, got) {
                (Ok(w), Ok(g)) => {
                    assert_eq!(g.header(), w.header(), "case {i}");
                    assert_eq!(g.entries(), w.entries(), "case {i}");
                    assert_eq!(g.file_len(), w.file_len(), "case {i}");
                    starts.push(w.data_start());
                }
                (Err(w), Err(g)) => assert_eq!(g.to_string(), w.to_string(), "case {i}"),
                (w, g) => panic!("case {i}: Plan::new {w:?}, cached {g:?}"),
            }
        }
        assert_eq!(
            starts[..4],
            [4096, 4096, 8192, 4096],
            "the data section moves and back"
        );
    }

    #[test]
    fn header_pads_to_4096_and_validates_with_safetensors() {
        let ts = vec![
            spec("a", Dtype::U8, &[3]),
            spec("b", Dtype::F64, &[2]),
            spec("c", Dtype::BF16, &[5]),
            spec("z", Dtype::F32, &[]),
        ];
        let p = Plan::new(&ts, &no_meta(), &no_meta()).unwrap();
        assert_eq!(p.data_start() % DATA_ALIGN, 0);
        let order: Vec<&str> = p.entries().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(order, ["b", "z", "c", "a"]);
        let mut file = p.header().to_vec();
        file.resize(p.file_len() as usize, 0);
        let (n, meta) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        assert_eq!(8 + n as u64, p.data_start());
        assert_eq!(meta.offset_keys(), ["b", "z", "c", "a"]);
    }

    #[test]
    fn rejects_bad_input() {
        let m = no_meta();
        let dup = [spec("x", Dtype::U8, &[1]), spec("x", Dtype::U8, &[1])];
        assert!(matches!(
            Plan::new(&dup, &m, &m),
            Err(Error::DuplicateName { .. })
        ));
        let empty = [spec("", Dtype::U8, &[1])];
        assert!(matches!(
            Plan::new(&empty, &m, &m),
            Err(Error::EmptyName { index: 0 })
        ));
        let mut bad = spec("x", Dtype::F32, &[3]);
        bad.len = 11;
        assert!(matches!(
            Plan::new(&[bad], &m, &m),
            Err(Error::SizeMismatch {
                expected: Some(12),
                actual: 11,
                ..
            })
        ));
        let over = TensorSpec {
            name: "o".into(),
            dtype: Dtype::F64,
            shape: vec![usize::MAX, 4],
            len: 8,
        };
        assert!(matches!(
            Plan::new(&[over], &m, &m),
            Err(Error::ShapeOverflow { .. })
        ));
        // Each tensor fits in 64 bits, their total does not: an overflow, not a config error.
        let parts: Vec<TensorSpec> = (0..16)
            .map(|i| spec(&format!("p{i}"), Dtype::U8, &[1usize << 60]))
            .collect();
        assert!(matches!(
            Plan::new(&parts, &m, &m),
            Err(Error::SizeOverflow { .. })
        ));
        let long = spec(&"n".repeat(MAX_NAME_LEN + 1), Dtype::U8, &[1]);
        assert!(matches!(
            Plan::new(&[long], &m, &m),
            Err(Error::InvalidName { .. })
        ));
        let reserved = spec("__metadata__", Dtype::U8, &[1]);
        assert!(matches!(
            Plan::new(&[reserved], &m, &m),
            Err(Error::InvalidName { .. })
        ));
        let meta: BTreeMap<_, _> = [("shmckpt.step".to_owned(), "1".to_owned())].into();
        assert!(matches!(
            Plan::new(&[], &m, &meta),
            Err(Error::InvalidMetadata { .. })
        ));
    }

    #[test]
    fn empty_list_is_a_valid_file() {
        let p = Plan::new(&[], &no_meta(), &no_meta()).unwrap();
        assert_eq!(p.file_len(), DATA_ALIGN);
        let st = safetensors::SafeTensors::deserialize(p.header()).unwrap();
        assert_eq!(st.len(), 0);
    }

    fn arb_dtype() -> impl Strategy<Value = Dtype> {
        proptest::sample::select(Dtype::ALL.to_vec())
    }

    #[test]
    fn numbers_are_written_in_decimal() {
        for n in [
            0,
            1,
            9,
            10,
            99,
            100,
            4096,
            u64::from(u32::MAX),
            u64::MAX - 1,
            u64::MAX,
        ] {
            let mut out = String::from("x");
            push_u64(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// The unescaped fast path writes what serde_json writes, for any string (quotes,
        /// backslashes, control characters, non-ASCII) and any number.
        #[test]
        fn json_strings_and_numbers_match_serde_json(s in r#"([a-z"\\\x00-\x1f\x7fé]|(?s:.)){0,40}"#, n in any::<u64>()) {
            let mut out = String::new();
            push_json_str(&mut out, &s);
            prop_assert_eq!(&out, &serde_json::to_string(&s).unwrap());
            push_u64(&mut out, n);
            prop_assert_eq!(out, format!("{}{n}", serde_json::to_string(&s).unwrap()));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The layout obeys the safetensors rules, every tensor is aligned to its element
        /// size, and chunk pieces tile the file exactly.
        #[test]
        fn layout_rules_hold(
            dims in proptest::collection::vec(
                (arb_dtype(), proptest::collection::vec(0usize..40, 0..3)), 0..40),
            chunk_pages in 1u64..6,
            meta in proptest::collection::btree_map("[a-z\"\\\\é]{1,8}", ".{0,12}", 0..4),
        ) {
            let ts: Vec<TensorSpec> = dims.iter().enumerate().filter_map(|(i, (d, s))| {
                let mut shape = s.clone();
                if d.bits() < 8 { shape.push(8); } // whole bytes for sub-byte types
                d.byte_len(&shape).map(|len| TensorSpec {
                    name: format!("t{i}.\"q\""), dtype: *d, shape, len })
            }).collect();
            let p = Plan::new(&ts, &no_meta(), &meta).unwrap();
            prop_assert_eq!(p.data_start() % DATA_ALIGN, 0);
            let mut at = p.data_start();
            for e in p.entries() {
                prop_assert_eq!(e.offset, at, "no holes");
                prop_assert_eq!(e.offset % e.dtype.alignment(), 0, "aligned");
                at += e.len;
            }
            prop_assert_eq!(at, p.file_len(), "no trailing bytes");

            // Build the file from pieces and compare with a naive image.
            let mut naive = p.header().to_vec();
            for e in p.entries() {
                let t = e.input as u8;
                naive.extend((0..e.len).map(|k| t.wrapping_mul(31).wrapping_add(k as u8)));
            }
            let chunk = chunk_pages * DATA_ALIGN / 2;
            let mut built = vec![0xAAu8; p.file_len() as usize];
            for c in 0..p.chunk_count(chunk) {
                let r = p.chunk_range(c, chunk);
                let mut covered = 0usize;
                for piece in p.pieces(r.clone()) {
                    prop_assert_eq!(piece.dst, covered, "pieces are contiguous");
                    covered += piece.len;
                    let dst = r.start as usize + piece.dst;
                    for k in 0..piece.len {
                        built[dst + k] = match piece.source {
                            PieceSource::Header { at } => p.header()[at as usize + k],
                            PieceSource::Tensor { entry, at } => {
                                let t = p.entries()[entry].input as u8;
                                t.wrapping_mul(31).wrapping_add((at as usize + k) as u8)
                            }
                        };
                    }
                }
                prop_assert_eq!(covered as u64, r.end - r.start);
            }
            prop_assert_eq!(&built, &naive);
            let st = safetensors::SafeTensors::deserialize(&built).unwrap();
            prop_assert_eq!(st.len(), ts.len());
            for t in &ts {
                let v = st.tensor(&t.name).unwrap();
                prop_assert_eq!(v.shape(), &t.shape[..]);
                prop_assert_eq!(v.data().len() as u64, t.len);
            }
            let (_, header) = safetensors::SafeTensors::read_metadata(&built).unwrap();
            let got = header.metadata().clone().unwrap_or_default();
            for (k, v) in &meta {
                prop_assert_eq!(got.get(k), Some(v));
            }
        }
    }
}
