//! The filesystem as a crash leaves it: a tree of directories and file contents, keyed by
//! [`Id`], that recorded operations are replayed onto.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::Path;

use super::ops::{Id, Op};

/// A filesystem state. Directory entries and file contents are separate, as on disk: a
/// file's bytes can be durable while the entry naming it is not (the file is then
/// unreachable).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Model {
    /// The recorded root.
    pub root: Id,
    /// Directories: name to id.
    pub dirs: BTreeMap<Id, BTreeMap<String, Id>>,
    /// Regular files: contents (the length is the file size).
    pub files: BTreeMap<Id, Vec<u8>>,
    /// How a file's contents were made from the log, where the crash-state generator made
    /// them (equal origins, equal contents): [`Model::digest`] hashes this instead of the
    /// bytes.
    pub origin: BTreeMap<Id, u64>,
}

impl Model {
    /// Apply one directory operation; an operation that does not fit the state (its
    /// source is missing because an earlier operation was lost) is skipped. Returns
    /// whether it applied.
    pub fn apply_dir_op(&mut self, op: &Op) -> bool {
        match op {
            Op::Mkdir { parent, name, id } | Op::Create { parent, name, id } => {
                let is_dir = matches!(op, Op::Mkdir { .. });
                let Some(d) = self.dirs.get_mut(parent) else {
                    return false;
                };
                if d.contains_key(name) {
                    return false;
                }
                d.insert(name.clone(), *id);
                if is_dir {
                    self.dirs.entry(*id).or_default();
                } else {
                    self.files.entry(*id).or_default();
                }
                true
            }
            Op::Rename {
                from_parent,
                from,
                to_parent,
                to,
                id,
            } => {
                if !self.dirs.contains_key(to_parent)
                    || self.dirs.get(from_parent).and_then(|d| d.get(from)) != Some(id)
                {
                    return false;
                }
                if let Some(d) = self.dirs.get_mut(from_parent) {
                    d.remove(from);
                }
                if let Some(d) = self.dirs.get_mut(to_parent) {
                    d.insert(to.clone(), *id);
                }
                true
            }
            Op::Unlink { parent, name, id } | Op::Rmdir { parent, name, id } => {
                match self.dirs.get_mut(parent) {
                    Some(d) if d.get(name) == Some(id) => {
                        d.remove(name);
                        true
                    }
                    _ => false,
                }
            }
            _ => false,
        }
    }

    /// A digest of the reachable tree: names, kinds and contents (a file's origin, where
    /// known, stands for its bytes). States with equal digests look the same to a reader;
    /// states with different digests may still be the same.
    pub fn digest(&self) -> u64 {
        let mut h = Digest::default();
        self.walk(&mut |path, node| {
            h.write(path.as_bytes());
            match node {
                Node::Dir => h.write(b"/"),
                Node::File(id, d) => match self.origin.get(&id) {
                    Some(&o) => {
                        h.word(1);
                        h.word(u64::from(id));
                        h.word(o);
                    }
                    None => {
                        h.word(0);
                        h.write(d);
                    }
                },
            }
        });
        h.finish()
    }

    fn walk(&self, f: &mut dyn FnMut(&str, Node<'_>)) {
        let mut seen = BTreeSet::new();
        self.walk_dir(self.root, "", &mut seen, f);
    }

    fn walk_dir(
        &self,
        dir: Id,
        prefix: &str,
        seen: &mut BTreeSet<Id>,
        f: &mut dyn FnMut(&str, Node<'_>),
    ) {
        if !seen.insert(dir) {
            return;
        }
        let Some(entries) = self.dirs.get(&dir) else {
            return;
        };
        for (name, id) in entries {
            let path = format!("{prefix}{name}");
            if self.dirs.contains_key(id) {
                f(&path, Node::Dir);
                self.walk_dir(*id, &format!("{path}/"), seen, f);
            } else if let Some(d) = self.files.get(id) {
                f(&path, Node::File(*id, d));
            }
        }
    }

    /// Write the reachable tree into the empty directory `dir`.
    pub fn materialize(&self, dir: &Path) -> io::Result<()> {
        let mut err = None;
        self.walk(&mut |path, node| {
            if err.is_some() {
                return;
            }
            let p = dir.join(path);
            let r = match node {
                Node::Dir => std::fs::create_dir(&p),
                Node::File(_, d) => std::fs::write(&p, d),
            };
            if let Err(e) = r {
                err = Some(e);
            }
        });
        err.map_or(Ok(()), Err)
    }

    /// Reachable paths, for messages: `name` for files (with their size), `name/` for
    /// directories.
    pub fn listing(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.walk(&mut |path, node| match node {
            Node::Dir => out.push(format!("{path}/")),
            Node::File(_, d) => out.push(format!("{path} ({} B)", d.len())),
        });
        out
    }

    /// Build a model of the tree under `root` (links and other kinds are not recorded:
    /// the engine makes none), giving ids with `id_of`.
    pub(crate) fn scan(
        root: &Path,
        id_of: &mut dyn FnMut(&std::fs::Metadata) -> Id,
    ) -> io::Result<Model> {
        let meta = std::fs::metadata(root)?;
        let mut m = Model {
            root: id_of(&meta),
            ..Model::default()
        };
        let mut stack = vec![(root.to_owned(), m.root)];
        m.dirs.insert(m.root, BTreeMap::new());
        while let Some((path, id)) = stack.pop() {
            let mut entries = HashMap::new();
            for e in std::fs::read_dir(&path)? {
                let e = e?;
                let Some(name) = e.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                let md = std::fs::symlink_metadata(e.path())?;
                let cid = id_of(&md);
                if md.is_dir() {
                    m.dirs.insert(cid, BTreeMap::new());
                    stack.push((e.path(), cid));
                } else if md.is_file() {
                    m.files.insert(cid, std::fs::read(e.path())?);
                } else {
                    continue;
                }
                entries.insert(name, cid);
            }
            m.dirs.insert(id, entries.into_iter().collect());
        }
        Ok(m)
    }
}

enum Node<'a> {
    Dir,
    File(Id, &'a [u8]),
}

/// The digest of states: a 64-bit multiply-xorshift over 8-byte words (fast in a debug
/// build, where std's SipHash checks every copy; the same in every run). Digests only
/// decide which states are the same: a collision would skip one state's check.
pub(crate) struct Digest(u64);

impl Default for Digest {
    fn default() -> Self {
        Digest(0x243f_6a88_85a3_08d3)
    }
}

impl Digest {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;

    pub(crate) fn word(&mut self, w: u64) {
        self.0 = (self.0 ^ w).wrapping_mul(Self::K);
        self.0 ^= self.0 >> 29;
    }

    fn write(&mut self, bytes: &[u8]) {
        self.word(bytes.len() as u64);
        let words = bytes.chunks_exact(8);
        let tail = words.remainder();
        for w in words {
            self.word(u64::from_le_bytes([
                w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
            ]));
        }
        let mut last = [0u8; 8];
        last[..tail.len()].copy_from_slice(tail);
        self.word(u64::from_le_bytes(last));
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

/// A recorded run: the root as it was when recording started (taken as durable), and
/// every operation since, in issue order.
#[derive(Debug, Clone)]
pub struct Log {
    /// The state at the start.
    pub base: Model,
    /// The operations.
    pub ops: Vec<Op>,
}

impl Log {
    /// Steps reported committed by operations before `point`.
    pub fn committed_before(&self, point: usize) -> std::collections::BTreeSet<u64> {
        self.ops[..point]
            .iter()
            .filter_map(|o| match o {
                Op::Committed { step } => Some(*step),
                _ => None,
            })
            .collect()
    }

    /// How many operations of each kind the log holds, for reports.
    pub fn summary(&self) -> String {
        let mut counts = std::collections::BTreeMap::<&str, usize>::new();
        for o in &self.ops {
            let k = match o {
                Op::Mkdir { .. } => "mkdir",
                Op::Create { .. } => "create",
                Op::Write { .. } => "write",
                Op::Truncate { .. } => "ftruncate",
                Op::Fallocate { .. } => "fallocate",
                Op::Rename { .. } => "rename",
                Op::Unlink { .. } => "unlink",
                Op::Rmdir { .. } => "rmdir",
                Op::Fsync { .. } => "fsync",
                Op::Fdatasync { .. } => "fdatasync",
                Op::Committed { .. } => "committed",
            };
            *counts.entry(k).or_default() += 1;
        }
        format!("{} ops {counts:?}", self.ops.len())
    }
}
