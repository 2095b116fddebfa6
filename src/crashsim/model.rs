//! The filesystem as a crash leaves it: a tree of directories and file contents, keyed by
//! [`Id`], that recorded operations are replayed onto.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::Path;

use super::{Id, Op};

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

    /// The relative paths of every reachable file and directory, with a digest of the
    /// reachable state (two states with the same digest look the same to a reader).
    pub fn digest(&self) -> u64 {
        let mut h = Fnv::default();
        self.walk(&mut |path, node| {
            h.write(path.as_bytes());
            match node {
                Node::Dir => h.write(b"/"),
                Node::File(d) => {
                    h.write(&(d.len() as u64).to_le_bytes());
                    h.write(d);
                }
            }
        });
        h.0
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
                f(&path, Node::File(d));
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
                Node::File(d) => std::fs::write(&p, d),
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
            Node::File(d) => out.push(format!("{path} ({} B)", d.len())),
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
    File(&'a [u8]),
}

/// FNV-1a, for digests of states (no dependency, stable across runs).
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}
