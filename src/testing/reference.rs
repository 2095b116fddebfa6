//! Physical limits measured in the same run as a benchmark: a raw O_DIRECT sequential write
//! of the same number of bytes to the same directory, with no staging, no checksums and no
//! commit. This is what `shmckpt bench` divides by.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::staging::{Arena, ArenaSpec};

/// Block size of the reference writer: large enough that the block layer splits each
/// `pwrite` into many device requests in flight.
pub const REFERENCE_BLOCK: u64 = 16 << 20;

/// Write `bytes` of pseudo-random data sequentially to a new file in `dir` with O_DIRECT
/// (`dd oflag=direct bs=16M` equivalent), `fdatasync` it, delete it, and return the time
/// from open to the end of `fdatasync`.
pub fn raw_direct_write(dir: &Path, bytes: u64) -> Result<Duration> {
    let arena = Arena::create(&ArenaSpec {
        name: None,
        capacity: REFERENCE_BLOCK,
        chunk_size: REFERENCE_BLOCK,
        slots: 1,
        rank: 0,
        world_size: 1,
        root: dir.to_owned(),
    })?;
    let (mut buf, _) = arena.acquire();
    crate::testing::synthetic::fill(buf.as_mut_slice(), 0xAB, 7, 0);
    let path = dir.join(format!(".shmckpt-reference-{}.bin", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let t = Instant::now();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| Error::io("open(O_DIRECT)", &path, e))?;
    let padded = crate::io::align_up(bytes);
    let mut off = 0u64;
    let res = (|| {
        while off < padded {
            let n = (padded - off).min(REFERENCE_BLOCK) as usize;
            f.write_all_at(&buf.as_slice()[..n], off)
                .map_err(|e| Error::io_at("write", &path, off, e))?;
            off += n as u64;
        }
        f.sync_data().map_err(|e| Error::io("fdatasync", &path, e))
    })();
    let elapsed = t.elapsed();
    drop(f);
    let _ = std::fs::remove_file(&path);
    res.map(|()| elapsed)
}
