//! Named links to committed checkpoints: `ROOT/NAME -> step-N`, for trainers that address
//! checkpoints by their own names (Lightning's `epoch=3-step=120.ckpt`, `last.ckpt`).
//!
//! A link is published only for a committed step, atomically (made under a temporary
//! name, renamed over `NAME`, root `fsync`ed), so a name always leads to a complete
//! checkpoint, before and after a crash. Links are read, never followed: a name counts as
//! naming step N only when its target is the bare `step-N` or, as Lightning's
//! `save_last="link"` makes, the name of another link in the root that leads to one (at
//! most [`MAX_HOPS`] hops).

use std::collections::BTreeSet;
use std::path::Path;

use crate::error::{Error, Result};
use crate::io::file::fsync_dir;
use crate::manifest::{self, parse_step_dir, step_dir_name};

/// The longest chain of links between names that [`linked_step`] follows.
pub const MAX_HOPS: usize = 8;

/// `name` may name a link in a root: one path component, not shmckpt's own names.
fn check_name(root: &Path, name: &str) -> Result<()> {
    let bad = if name.is_empty()
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\0')
    {
        Some("a link name must be one path component")
    } else if name.starts_with("step-") || name.starts_with(".shmckpt") {
        Some("names starting with 'step-' or '.shmckpt' are shmckpt's own")
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

/// The step `root/name` names (see the module documentation), `None` when it is missing or
/// is not such a link (a regular file, a directory, a link elsewhere).
pub fn linked_step(root: &Path, name: &str) -> Result<Option<u64>> {
    check_name(root, name)?;
    let mut name = name.to_owned();
    for _ in 0..MAX_HOPS {
        let path = root.join(&name);
        let target = match std::fs::read_link(&path) {
            Ok(t) => t,
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    || e.kind() == std::io::ErrorKind::InvalidInput =>
            {
                return Ok(None); // missing, or not a link
            }
            Err(e) => return Err(Error::io("readlink", &path, e)),
        };
        let Some(t) = target.to_str() else {
            return Ok(None);
        };
        if let Some(step) = parse_step_dir(t) {
            return Ok(Some(step));
        }
        if check_name(root, t).is_err() {
            return Ok(None);
        }
        name = t.to_owned();
    }
    Ok(None)
}

/// Every step that some link of `root` names.
pub fn linked_steps(root: &Path) -> Result<BTreeSet<u64>> {
    let mut out = BTreeSet::new();
    let rd = std::fs::read_dir(root).map_err(|e| Error::io("read_dir", root, e))?;
    for entry in rd {
        let entry = entry.map_err(|e| Error::io("read_dir", root, e))?;
        let is_link = entry.file_type().is_ok_and(|t| t.is_symlink());
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !is_link || check_name(root, &name).is_err() {
            continue;
        }
        if let Some(s) = linked_step(root, &name)? {
            out.insert(s);
        }
    }
    Ok(out)
}

/// Publish `root/name` as a link to committed checkpoint `step`, replacing what was there
/// (a link or a regular file; a directory is refused with [`Error::UnsafePath`]). Returns
/// the step the name linked to before, if any. [`Error::NotFound`] when `step` is not
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
        // No temporary name is left behind.
        assert!(
            std::fs::read_dir(root)
                .unwrap()
                .flatten()
                .all(|e| !e.file_name().to_string_lossy().starts_with(".shmckpt-link"))
        );
    }
}
