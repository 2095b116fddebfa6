//! What the benchmark and the demo check before touching the machine: they never delete
//! checkpoints they did not create, never allocate more memory than there is, and name
//! the path in every I/O error.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use shmckpt_bench::synthetic::LayoutEntry;

/// Largest `--layout` file read (a layout of a million tensors is far below this).
pub const MAX_LAYOUT_FILE: u64 = 64 << 20;

/// Marker file the demo writes into a directory it created; only a directory holding it is
/// reused (and its earlier demo output replaced).
pub const DEMO_MARKER: &str = ".shmckpt-demo";

/// Error type of these checks: a message.
pub type GuardResult<T> = Result<T, Box<dyn std::error::Error>>;

/// An I/O error with the operation and the path.
pub fn io_err(op: &str, path: &Path, e: std::io::Error) -> Box<dyn std::error::Error> {
    format!("{op} {}: {e}", path.display()).into()
}

/// Create `dir` and its parents, naming `dir` on failure.
pub fn create_dir_all(dir: &Path) -> GuardResult<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_err("create directory", dir, e))
}

/// A new, empty directory inside `parent` (created if missing) that belongs to this run
/// alone: the benchmark writes only there, so its retention and clean-up can only ever
/// see its own checkpoints.
pub fn fresh_subdir(parent: &Path, tag: &str) -> GuardResult<PathBuf> {
    create_dir_all(parent)?;
    let pid = std::process::id();
    for n in 0..1000u32 {
        let dir = parent.join(format!("{tag}-{pid}-{n}"));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_err("create directory", &dir, e)),
        }
    }
    Err(format!("{}: no free name for a run directory", parent.display()).into())
}

/// Make `dir` the demo's own: a new or empty directory gets the marker; a directory with
/// the marker has its earlier demo output removed; anything else is refused untouched.
pub fn claim_demo_dir(dir: &Path) -> GuardResult<()> {
    create_dir_all(dir)?;
    let marker = dir.join(DEMO_MARKER);
    let meta = std::fs::symlink_metadata(&marker);
    let entries: Vec<std::fs::DirEntry> = std::fs::read_dir(dir)
        .map_err(|e| io_err("read directory", dir, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| io_err("read directory", dir, e))?;
    match meta {
        Ok(m) if m.file_type().is_file() => {
            // Ours: remove what an earlier demo wrote (checkpoints, partial directories,
            // lock and probe files), nothing else.
            for e in entries {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name == DEMO_MARKER {
                    continue;
                }
                if !is_demo_output(&name) {
                    return Err(format!(
                        "{} holds {name:?}, which shmckpt demo did not write; \
                         remove it or pick another --dir",
                        dir.display()
                    )
                    .into());
                }
            }
            for e in std::fs::read_dir(dir).map_err(|e| io_err("read directory", dir, e))? {
                let e = e.map_err(|e| io_err("read directory", dir, e))?;
                let name = e.file_name();
                if name.to_string_lossy() == DEMO_MARKER {
                    continue;
                }
                let p = e.path();
                let ft = e.file_type().map_err(|err| io_err("stat", &p, err))?;
                if ft.is_dir() {
                    std::fs::remove_dir_all(&p).map_err(|err| io_err("remove", &p, err))?;
                } else {
                    std::fs::remove_file(&p).map_err(|err| io_err("remove", &p, err))?;
                }
            }
            Ok(())
        }
        Ok(_) => Err(format!(
            "{} is not a regular file; refusing to use {}",
            marker.display(),
            dir.display()
        )
        .into()),
        Err(_) if entries.is_empty() => {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&marker)
                .and_then(|mut f| std::io::Write::write_all(&mut f, b"written by shmckpt demo\n"))
                .map_err(|e| io_err("create", &marker, e))?;
            Ok(())
        }
        Err(_) => Err(format!(
            "{} is not empty and was not created by shmckpt demo (no {DEMO_MARKER} marker); \
             the demo keeps only its last checkpoints and would delete the others: \
             pick a new or empty --dir",
            dir.display()
        )
        .into()),
    }
}

/// Names the demo's engine creates in its root.
fn is_demo_output(name: &str) -> bool {
    let step = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if let Some(rest) = name.strip_prefix("step-") {
        let rest = rest.strip_suffix(".partial").unwrap_or(rest);
        return step(rest);
    }
    name.starts_with(".shmckpt-") || name == ".trash" || name.starts_with(".trash-")
}

/// Bytes of a layout's tensors, checked: every shape valid for its dtype, no overflow.
pub fn layout_bytes(layout: &[LayoutEntry]) -> GuardResult<u64> {
    let mut total = 0u64;
    for e in layout {
        let n = e.dtype.byte_len(&e.shape).ok_or_else(|| {
            format!(
                "tensor {:?}: shape {:?} is not a whole number of bytes of {} or overflows",
                e.name, e.shape, e.dtype
            )
        })?;
        total = total
            .checked_add(n)
            .ok_or("the layout's total size overflows 64 bits")?;
    }
    Ok(total)
}

/// Read a `--layout` file: a regular file of at most [`MAX_LAYOUT_FILE`] bytes (a FIFO or
/// a device is refused without blocking).
pub fn read_layout_file(path: &Path) -> GuardResult<Vec<LayoutEntry>> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io_err("open", path, e))?;
    let meta = f.metadata().map_err(|e| io_err("stat", path, e))?;
    if !meta.file_type().is_file() {
        return Err(format!("{}: not a regular file", path.display()).into());
    }
    if meta.len() > MAX_LAYOUT_FILE {
        return Err(format!(
            "{}: {} bytes is larger than the {MAX_LAYOUT_FILE}-byte limit of a layout file",
            path.display(),
            meta.len()
        )
        .into());
    }
    let mut bytes = Vec::new();
    f.take(MAX_LAYOUT_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_err("read", path, e))?;
    if bytes.len() as u64 > MAX_LAYOUT_FILE {
        return Err(format!("{}: grew past the layout size limit", path.display()).into());
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| format!("{}: not a layout: {e}", path.display()).into())
}

/// Refuse a run that needs more host memory (`host` bytes of tensors plus `shm` bytes of
/// staging, which tmpfs also takes from RAM) than the machine has available, or more
/// staging than /dev/shm can hold.
pub fn check_memory(host: u64, shm: u64) -> GuardResult<()> {
    let available = mem_available()?;
    let need = host
        .checked_add(shm)
        .ok_or("the requested sizes overflow 64 bits")?;
    if need > available {
        return Err(format!(
            "not enough memory: {host} bytes of tensors + {shm} bytes of staging = {need} \
             bytes, but only {available} bytes are available (MemAvailable)"
        )
        .into());
    }
    let shm_dir = Path::new("/dev/shm");
    let st = rustix::fs::statvfs(shm_dir).map_err(|e| io_err("statvfs", shm_dir, e.into()))?;
    let shm_free = st.f_bavail.saturating_mul(st.f_frsize);
    if shm > shm_free {
        return Err(format!(
            "/dev/shm too small: staging needs {shm} bytes, {shm_free} bytes are free"
        )
        .into());
    }
    Ok(())
}

/// `MemAvailable` of /proc/meminfo, bytes.
fn mem_available() -> GuardResult<u64> {
    let p = Path::new("/proc/meminfo");
    let s = std::fs::read_to_string(p).map_err(|e| io_err("read", p, e))?;
    proc_kib(&s, "MemAvailable:")
        .ok_or_else(|| format!("{}: no MemAvailable line", p.display()).into())
}

/// The value of a `Key:   123 kB` line of a /proc file, in bytes.
pub fn proc_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .and_then(|kb| kb.checked_mul(1024))
}

/// Peak resident set size of this process (VmHWM), bytes (0 if unknown).
pub fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| proc_kib(&s, "VmHWM:"))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_values_parse_in_bytes() {
        let t = "MemTotal:       24000000 kB\nMemAvailable:    1000 kB\nVmHWM:\t  12 kB\n";
        assert_eq!(proc_kib(t, "MemAvailable:"), Some(1_024_000));
        assert_eq!(proc_kib(t, "VmHWM:"), Some(12 * 1024));
        assert_eq!(proc_kib(t, "Nope:"), None);
    }

    #[test]
    fn demo_output_names() {
        for n in [
            "step-1",
            "step-12.partial",
            ".shmckpt-rank-0.lock",
            ".trash",
        ] {
            assert!(is_demo_output(n), "{n}");
        }
        for n in ["step-", "step-x", "notes.txt", "step-1.bak"] {
            assert!(!is_demo_output(n), "{n}");
        }
    }
}
