//! Named links to committed checkpoints: `ROOT/NAME -> step-N`, for trainers that address
//! checkpoints by their own names (Lightning's `epoch=3-step=120.ckpt`, `last.ckpt`).
//!
//! A link is published only for a committed step, atomically (made under a temporary
//! name, renamed over `NAME`, root `fsync`ed), so a name always leads to a complete
//! checkpoint, before and after a crash. Links are read, never followed: a name counts as
//! naming step N only when its target is the bare `step-N` or, as Lightning's
//! `save_last="link"` makes, the name of another link in the root that leads to one (at
//! most [`MAX_HOPS`] hops).
//!
//! A name can also be *reserved* for a save in flight ([`reserve_name`]): a small regular
//! file `shmckpt-pending step-N` under the name, made at once (so the name exists, as a
//! trainer choosing a free name checks) and replaced by the link when step N is committed
//! ([`link_step`]). A reserved name names step N for [`linked_steps`] (its step is never
//! removed because another name let go of it); [`resolve_name`] tells a reserved name
//! from a published one, so that a reader can report a save that never committed.

use std::collections::BTreeSet;
use std::path::Path;

use crate::error::{Error, Result};
use crate::io::file::fsync_dir;
use crate::manifest::{self, parse_step_dir, step_dir_name};

/// The longest chain of links between names that [`linked_step`] follows.
pub const MAX_HOPS: usize = 8;

/// The content of a reserved name (see the module documentation): this prefix, the step
/// directory's name, a newline.
pub const PENDING_PREFIX: &str = "shmckpt-pending ";

/// The longest reservation file: the prefix, `step-` and 20 digits, a newline.
const MAX_PENDING_LEN: u64 = 64;

/// Whether `name` is one shmckpt's engine makes in a root: `.shmckpt*`, and `step-<digits>`
/// alone or followed by `.partial`, `.trash` or `.aside-*`. A trainer's `step-5.ckpt` is
/// not.
fn engine_name(name: &str) -> bool {
    if name.starts_with(".shmckpt") {
        return true;
    }
    let Some(rest) = name.strip_prefix("step-") else {
        return false;
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let suffix = &rest[digits..];
    digits > 0
        && (suffix.is_empty()
            || suffix == ".partial"
            || suffix == ".trash"
            || suffix.starts_with(".aside-"))
}

/// `name` may name a link in a root: one path component, not shmckpt's own names.
fn check_name(root: &Path, name: &str) -> Result<()> {
    let bad = if name.is_empty()
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\0')
    {
        Some("a link name must be one path component")
    } else if engine_name(name) {
        Some(
            "'step-N' (alone or with .partial, .trash, .aside-*) and '.shmckpt*' are shmckpt's own names",
        )
    } else if name.len() > 255 {
        Some("a name is at most 255 bytes")
    } else {
        None
    };
    match bad {
        Some(reason) => Err(Error::UnsafePath {
            path: root.join(name),
            reason: reason.into(),
        }),
        None => Ok(()),
    }
}

/// What a name of a root leads to ([`resolve_name`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Named {
    /// A link (directly or through other names) to committed step directory `step-N`.
    Published(u64),
    /// A reservation ([`reserve_name`]) for step N, made under `name` (the name itself, or
    /// the one a chain of links ends at): its save was not published (yet).
    Reserved {
        /// The step the reservation is for.
        step: u64,
        /// The name of the reservation file.
        name: String,
    },
}

impl Named {
    /// The step named, published or reserved.
    pub fn step(&self) -> u64 {
        match self {
            Named::Published(s) | Named::Reserved { step: s, .. } => *s,
        }
    }
}

/// The step `root/name` names (see the module documentation), published or reserved;
/// `None` when it is missing or is not such a name (another file, a directory, a link
/// elsewhere).
pub fn linked_step(root: &Path, name: &str) -> Result<Option<u64>> {
    Ok(resolve_name(root, name)?.map(|n| n.step()))
}

/// What `root/name` leads to: a published step, a reservation, or `None` (see
/// [`linked_step`]). Links are read, never followed.
pub fn resolve_name(root: &Path, name: &str) -> Result<Option<Named>> {
    check_name(root, name)?;
    let mut name = name.to_owned();
    for _ in 0..MAX_HOPS {
        let path = root.join(&name);
        let target = match std::fs::read_link(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                // Not a link: a reservation, or not ours.
                return Ok(pending_step(&path)?.map(|step| Named::Reserved { step, name }));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("readlink", &path, e)),
        };
        let Some(t) = target.to_str() else {
            return Ok(None);
        };
        if let Some(step) = parse_step_dir(t) {
            return Ok(Some(Named::Published(step)));
        }
        if check_name(root, t).is_err() {
            return Ok(None);
        }
        name = t.to_owned();
    }
    Ok(None)
}

/// The step of the reservation file `path`, `None` when it is something else (a
/// directory, a larger file, other bytes: a trainer's own checkpoint file). Not followed
/// if it is a link.
fn pending_step(path: &Path) -> Result<Option<u64>> {
    use std::io::Read;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() && m.len() <= MAX_PENDING_LEN => {}
        Ok(_) => return Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("stat", path, e)),
    }
    let f = match crate::fsx::open_path(path, false) {
        Ok(f) => f,
        // Replaced meanwhile (by its link, or by something that is no regular file).
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None);
        }
        Err(Error::UnsafePath { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut text = String::new();
    if f.take(MAX_PENDING_LEN + 1)
        .read_to_string(&mut text)
        .is_err()
    {
        return Ok(None); // not UTF-8: not ours
    }
    Ok(text
        .strip_prefix(PENDING_PREFIX)
        .and_then(|t| t.strip_suffix('\n'))
        .and_then(parse_step_dir))
}

/// Reserve `root/name` for step `step`, whose save is in flight, unless the name exists
/// (a link of an earlier save stays until [`link_step`] replaces it; a reservation or a
/// file of someone else is left as it is). Returns whether the reservation was made. The
/// file appears whole (made under a temporary name, then hard-linked to `name`, which
/// never replaces what appeared there meanwhile); it is not made durable (a crash may
/// lose it, leaving the name missing, as before the save).
pub fn reserve_name(root: &Path, name: &str, step: u64) -> Result<bool> {
    use std::io::Write;
    check_name(root, name)?;
    let path = root.join(name);
    match std::fs::symlink_metadata(&path) {
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("stat", &path, e)),
    }
    let tmp = root.join(format!(".shmckpt-pending-{}-{step}", std::process::id()));
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("unlink", &tmp, e)),
    }
    let made = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::io("open", &tmp, e))?;
        f.write_all(format!("{PENDING_PREFIX}{}\n", step_dir_name(step)).as_bytes())
            .map_err(|e| Error::io("write", &tmp, e))?;
        match std::fs::hard_link(&tmp, &path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(Error::io("link", &path, e)),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    made
}

/// Every step that some name of `root` names, published or reserved.
pub fn linked_steps(root: &Path) -> Result<BTreeSet<u64>> {
    let mut out = BTreeSet::new();
    let rd = std::fs::read_dir(root).map_err(|e| Error::io("read_dir", root, e))?;
    for entry in rd {
        let entry = entry.map_err(|e| Error::io("read_dir", root, e))?;
        let candidate = entry
            .file_type()
            .is_ok_and(|t| t.is_symlink() || t.is_file());
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !candidate || check_name(root, &name).is_err() {
            continue;
        }
        if let Some(s) = linked_step(root, &name)? {
            out.insert(s);
        }
    }
    Ok(out)
}

/// Publish `root/name` as a link to committed checkpoint `step`, replacing what was there
/// (a link, a reservation or another regular file; a directory is refused with
/// [`Error::UnsafePath`]). Returns the step the name named before (published or
/// reserved), if any. [`Error::NotFound`] when `step` is not
/// committed (nothing is changed).
pub fn link_step(root: &Path, name: &str, step: u64) -> Result<Option<u64>> {
    check_name(root, name)?;
    if !manifest::list_committed(root)?
        .iter()
        .any(|c| c.step == step)
    {
        return Err(Error::NotFound {
            what: format!("step {step}"),
            step: Some(step),
            root: root.to_owned(),
        });
    }
    let path = root.join(name);
    refuse_dir(&path)?;
    let before = linked_step(root, name)?;
    let tmp = root.join(format!(".shmckpt-link-{}-{step}", std::process::id()));
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("unlink", &tmp, e)),
    }
    std::os::unix::fs::symlink(step_dir_name(step), &tmp)
        .map_err(|e| Error::io("symlink", &tmp, e))?;
    if let Err(e) = std::fs::rename(&tmp, &path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io("rename", &path, e));
    }
    fsync_dir(root)?;
    Ok(before)
}

/// Remove `root/name` (a link or a regular file; a directory is refused with
/// [`Error::UnsafePath`]), durably. Returns the step it linked to, if any; the step itself
/// is not touched ([`crate::Engine::remove`] deletes it). Missing: `Ok(None)`.
pub fn unlink_name(root: &Path, name: &str) -> Result<Option<u64>> {
    check_name(root, name)?;
    let path = root.join(name);
    refuse_dir(&path)?;
    let before = linked_step(root, name)?;
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("unlink", &path, e)),
    }
    fsync_dir(root)?;
    Ok(before)
}

fn refuse_dir(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Err(Error::UnsafePath {
            path: path.to_owned(),
            reason: "a directory where a checkpoint link belongs; left as it is".into(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed(root: &Path, step: u64) {
        let d = root.join(step_dir_name(step));
        std::fs::create_dir(&d).unwrap();
        let m = format!(
            r#"{{"format_version":1,"step":{step},"world_size":1,"created_unix_ms":0,"total_bytes":0,"files":[],"metadata":{{}}}}"#
        );
        std::fs::write(d.join(manifest::MANIFEST), m).unwrap();
    }

    #[test]
    fn links_name_committed_steps_and_are_replaced_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        committed(root, 3);
        committed(root, 5);
        if manifest::list_committed(root).unwrap().len() != 2 {
            // The manifest schema changed: this test's fixture must follow it.
            panic!("fixture manifests are not listed as committed");
        }
        assert_eq!(link_step(root, "last.ckpt", 3).unwrap(), None);
        assert_eq!(
            std::fs::read_link(root.join("last.ckpt")).unwrap(),
            Path::new("step-3")
        );
        assert_eq!(link_step(root, "last.ckpt", 5).unwrap(), Some(3));
        assert_eq!(linked_step(root, "last.ckpt").unwrap(), Some(5));
        // A link to another name (save_last="link"), and the set of linked steps.
        std::os::unix::fs::symlink("last.ckpt", root.join("alias.ckpt")).unwrap();
        assert_eq!(linked_step(root, "alias.ckpt").unwrap(), Some(5));
        assert_eq!(linked_steps(root).unwrap(), BTreeSet::from([5]));
        // Not committed: refused, nothing changed.
        assert!(matches!(
            link_step(root, "x.ckpt", 4),
            Err(Error::NotFound { .. })
        ));
        assert!(!root.join("x.ckpt").exists());
        // Links elsewhere, loops and files name nothing; shmckpt's names are refused.
        std::os::unix::fs::symlink("/etc", root.join("evil.ckpt")).unwrap();
        std::os::unix::fs::symlink("loop.ckpt", root.join("loop.ckpt")).unwrap();
        std::fs::write(root.join("file.ckpt"), b"x").unwrap();
        for n in ["evil.ckpt", "loop.ckpt", "file.ckpt", "missing.ckpt"] {
            assert_eq!(linked_step(root, n).unwrap(), None, "{n}");
        }
        for n in ["step-5", ".shmckpt-x", "a/b", "", ".."] {
            assert!(
                matches!(linked_step(root, n), Err(Error::UnsafePath { .. })),
                "{n:?}"
            );
        }
        // A directory under the name is refused, and left.
        std::fs::create_dir(root.join("d.ckpt")).unwrap();
        assert!(matches!(
            link_step(root, "d.ckpt", 5),
            Err(Error::UnsafePath { .. })
        ));
        assert!(matches!(
            unlink_name(root, "d.ckpt"),
            Err(Error::UnsafePath { .. })
        ));
        assert!(root.join("d.ckpt").is_dir());
        // Removing: the link goes, its step stays (the caller removes it).
        assert_eq!(unlink_name(root, "last.ckpt").unwrap(), Some(5));
        assert!(std::fs::symlink_metadata(root.join("last.ckpt")).is_err());
        assert!(root.join("step-5").is_dir());
        assert_eq!(unlink_name(root, "last.ckpt").unwrap(), None);
        assert_eq!(unlink_name(root, "file.ckpt").unwrap(), None);
        assert!(!root.join("file.ckpt").exists());
        // Names like the engine's but not its own are a trainer's to give.
        for n in [
            "step-5.ckpt",
            "step-5-v1.ckpt",
            "step-.ckpt",
            "steps",
            "step-x",
        ] {
            assert_eq!(linked_step(root, n).unwrap(), None, "{n}");
        }
        for n in [
            "step-05",
            "step-5.partial",
            "step-5.trash",
            "step-5.aside-17",
        ] {
            assert!(
                matches!(linked_step(root, n), Err(Error::UnsafePath { .. })),
                "{n:?}"
            );
        }
        // No temporary name is left behind.
        assert!(
            std::fs::read_dir(root)
                .unwrap()
                .flatten()
                .all(|e| !e.file_name().to_string_lossy().starts_with(".shmckpt-link"))
        );
    }

    #[test]
    fn a_reserved_name_names_its_step_until_the_link_replaces_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        committed(root, 2);
        assert!(reserve_name(root, "a.ckpt", 3).unwrap());
        let bytes = std::fs::read(root.join("a.ckpt")).unwrap();
        assert_eq!(bytes, b"shmckpt-pending step-3\n");
        assert_eq!(
            resolve_name(root, "a.ckpt").unwrap(),
            Some(Named::Reserved {
                step: 3,
                name: "a.ckpt".into()
            })
        );
        // Through a link to the name, too; and the step counts as named.
        std::os::unix::fs::symlink("a.ckpt", root.join("last.ckpt")).unwrap();
        assert_eq!(linked_step(root, "last.ckpt").unwrap(), Some(3));
        assert_eq!(linked_steps(root).unwrap(), BTreeSet::from([3]));
        // An existing name is left as it is.
        assert!(!reserve_name(root, "a.ckpt", 4).unwrap());
        assert!(!reserve_name(root, "last.ckpt", 4).unwrap());
        assert_eq!(linked_step(root, "a.ckpt").unwrap(), Some(3));
        // Committed: the link replaces the reservation.
        committed(root, 3);
        assert_eq!(link_step(root, "a.ckpt", 3).unwrap(), Some(3));
        assert_eq!(
            resolve_name(root, "last.ckpt").unwrap(),
            Some(Named::Published(3))
        );
        // Files that are not reservations name nothing.
        for (n, b) in [
            ("x.ckpt", &b"shmckpt-pending step-3"[..]),
            ("y.ckpt", b"shmckpt-pending step-03\n"),
            ("z.ckpt", b"PK\x03\x04 a zip"),
        ] {
            std::fs::write(root.join(n), b).unwrap();
            assert_eq!(resolve_name(root, n).unwrap(), None, "{n}");
        }
        assert_eq!(linked_steps(root).unwrap(), BTreeSet::from([3]));
        assert!(
            std::fs::read_dir(root)
                .unwrap()
                .flatten()
                .all(|e| !e.file_name().to_string_lossy().starts_with(".shmckpt"))
        );
    }
}
