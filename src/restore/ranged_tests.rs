//! Tests of the ranged reads (`ranged.rs`): coalescing, exact bytes and byte counts,
//! per-tensor CRC failures, missing tensors and destination checks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::restore::extents::align_extents;
use crate::staging::{Arena, ArenaSpec};
use crate::{Dtype, Engine, EngineConfig, Metadata, Tensor};

/// Sizes of the saved u8 tensors `t0..t7`: small ones with small gaps between them, one
/// larger than a 1 MiB staging buffer, odd sizes so that nothing is page-aligned.
const SIZES: [usize; 8] = [1000, 3, 70_001, 5000, 1_500_000, 17, 200_000, 4097];

fn bytes_of(k: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8 ^ (k as u8).wrapping_mul(37))
        .collect()
}

/// A committed checkpoint of `t0..t7`: its step directory, rank 0's file path and entry,
/// each tensor's bytes by index.
fn saved() -> (tempfile::TempDir, PathBuf, PathBuf, FileEntry, Vec<Vec<u8>>) {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<Vec<u8>> = SIZES
        .iter()
        .enumerate()
        .map(|(k, &n)| bytes_of(k, n))
        .collect();
    let names: Vec<String> = (0..SIZES.len()).map(|k| format!("t{k}")).collect();
    let engine = Engine::open(
        EngineConfig::new(dir.path())
            .with_staging_capacity(8 << 20)
            .with_chunk_size(1 << 20),
    )
    .unwrap();
    let tensors: Vec<Tensor<'_>> = data
        .iter()
        .zip(&names)
        .map(|(d, n)| Tensor::host(n.as_str(), Dtype::U8, vec![d.len()], d))
        .collect();
    engine
        .save(1, &tensors, &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    drop(engine);
    let step = dir.path().join(crate::manifest::step_dir_name(1));
    let (_, entry) = super::super::rank_file(&step, 0).unwrap();
    let path = step.join(&entry.file);
    // The file is written in the order the tensors were given (all u8).
    for (k, t) in entry.tensors.iter().enumerate() {
        assert_eq!(t.name, format!("t{k}"));
    }
    (dir, step, path, entry, data)
}

fn buffered(gap: u64) -> RangedOptions {
    RangedOptions {
        read: ReadOptions {
            direct_io: false,
            ..ReadOptions::default()
        },
        gap,
    }
}

fn span(entry: &FileEntry, k: usize) -> (u64, u64) {
    let [b, e] = entry.tensors[k].data_offsets;
    (b, e)
}

#[test]
fn coalesce_merges_neighbours_within_the_gap_only() {
    let r = [
        (100, 200),
        (0, 10),
        (10, 20),
        (250, 300),
        (300, 300),
        (290, 400),
    ];
    // Touching ranges always merge; an empty one is dropped; overlaps merge.
    assert_eq!(coalesce(r, 0), vec![(0, 20), (100, 200), (250, 400)]);
    // A gap of 50 bytes (200..250) merges at 50, not at 49; 80 (20..100) at 80.
    assert_eq!(coalesce(r, 49), vec![(0, 20), (100, 200), (250, 400)]);
    assert_eq!(coalesce(r, 50), vec![(0, 20), (100, 400)]);
    assert_eq!(coalesce(r, 80), vec![(0, 400)]);
    assert_eq!(coalesce([], 80), Vec::<(u64, u64)>::new());
    // No overflow near the top of the range.
    assert_eq!(
        coalesce([(u64::MAX - 10, u64::MAX), (0, 1)], u64::MAX),
        vec![(0, u64::MAX)]
    );
}

#[test]
fn aligned_extents_are_whole_pages_that_never_share_one() {
    // Two extents in one page become one; the end never passes the file's.
    assert_eq!(
        align_extents(&[(5000, 5100), (6000, 9000), (20_000, 20_001)], 20_400),
        vec![(4096, 12_288), (16_384, 20_400)]
    );
    assert_eq!(align_extents(&[(0, 1)], 1 << 20), vec![(0, 4096)]);
}

/// Some tensors, sub-ranges, one tensor asked for twice, owned and caller buffers: every
/// byte exact, and with buffered reads and no gap exactly the requested tensors' bytes
/// are read, in one read per run of adjacent tensors.
#[test]
fn only_the_requested_tensors_are_read_byte_exact() {
    let (_d, step, path, entry, data) = saved();
    let mut b1 = vec![0u8; SIZES[1]];
    let mut b4 = vec![0u8; 1000];
    let mut b4b = vec![0u8; SIZES[4]];
    let mut reqs = vec![
        RangeRequest::host("t1", &mut b1),
        RangeRequest::owned("t2"),
        RangeRequest {
            name: "t4",
            range: Some((700_000, 701_000)),
            dest: RangeDest::Host(&mut b4),
        },
        RangeRequest::host("t4", &mut b4b),
        RangeRequest {
            name: "t6",
            range: Some((5, 9)),
            dest: RangeDest::Owned,
        },
        RangeRequest::owned("t5"),
    ];
    let (owned, stats) = read_ranges(&path, &entry, &mut reqs, &buffered(0)).unwrap();
    drop(reqs);
    assert_eq!(b1, data[1]);
    assert_eq!(owned[1].as_ref().unwrap().as_bytes(), &data[2][..]);
    assert_eq!(b4, data[4][700_000..701_000]);
    assert_eq!(b4b, data[4]);
    assert_eq!(owned[4].as_ref().unwrap().as_bytes(), &data[6][5..9]);
    assert_eq!(owned[5].as_ref().unwrap().as_bytes(), &data[5][..]);
    assert!(owned[0].is_none() && owned[2].is_none() && owned[3].is_none());
    // t1, t2 adjacent: one extent; t4, t5, t6 adjacent: one more. t6 is read whole for
    // its 4 bytes (its CRC covers all of it).
    let want: u64 = [1, 2, 4, 5, 6].iter().map(|&k| SIZES[k] as u64).sum();
    assert_eq!(
        stats,
        RangedStats {
            bytes: want,
            // t1..t2: one read; t4..t6 (1 700 017 bytes, less than the private 4 MiB
            // buffers): one read.
            reads: 2,
            tensors: 5,
            direct_io: false,
        }
    );
    // The same through the directory (manifest read, rank 0).
    let mut reqs = vec![RangeRequest::owned("t7")];
    let loaded = load_ranges(&step, 0, &mut reqs, &buffered(0)).unwrap();
    assert_eq!(loaded.owned[0].as_ref().unwrap().as_bytes(), &data[7][..]);
    assert_eq!(loaded.entry, entry);
    assert_eq!(loaded.stats.bytes, SIZES[7] as u64);
}

/// The gap decides what is merged: t0 and t3 are 70 004 bytes apart.
#[test]
fn the_gap_threshold_merges_reads_and_counts_the_gap() {
    let (_d, _step, path, entry, data) = saved();
    let gap = span(&entry, 3).0 - span(&entry, 0).1;
    assert_eq!(gap, 70_004);
    for (g, bytes, reads) in [
        (gap - 1, (SIZES[0] + SIZES[3]) as u64, 2),
        (gap, span(&entry, 3).1 - span(&entry, 0).0, 1),
    ] {
        let mut reqs = vec![RangeRequest::owned("t3"), RangeRequest::owned("t0")];
        let (owned, stats) = read_ranges(&path, &entry, &mut reqs, &buffered(g)).unwrap();
        assert_eq!(owned[0].as_ref().unwrap().as_bytes(), &data[3][..]);
        assert_eq!(owned[1].as_ref().unwrap().as_bytes(), &data[0][..]);
        assert_eq!((stats.bytes, stats.reads, stats.tensors), (bytes, reads, 2));
    }
}

fn arena(chunks: u64) -> Arc<Arena> {
    Arena::create(&ArenaSpec {
        name: None,
        capacity: chunks << 20,
        chunk_size: 1 << 20,
        slots: 1,
        rank: 0,
        world_size: 1,
        root: PathBuf::new(),
    })
    .unwrap()
}

/// O_DIRECT where the filesystem allows it (whole pages read then), through a small shared
/// arena whose 1 MiB buffers split t4: the bytes are exact, the count is the pages.
#[test]
fn direct_reads_through_small_buffers_are_exact() {
    let (_d, _step, path, entry, data) = saved();
    let mut out = vec![0u8; SIZES[4]];
    let mut reqs = vec![
        RangeRequest::owned("t6"),
        RangeRequest::host("t4", &mut out),
        RangeRequest::owned("t0"),
    ];
    let opts = RangedOptions {
        read: ReadOptions {
            arena: Some(arena(2)),
            queue_depth: 4,
            ..ReadOptions::default()
        },
        gap: 0,
    };
    let (owned, stats) = read_ranges(&path, &entry, &mut reqs, &opts).unwrap();
    drop(reqs);
    assert_eq!(out, data[4]);
    assert_eq!(owned[0].as_ref().unwrap().as_bytes(), &data[6][..]);
    assert_eq!(owned[2].as_ref().unwrap().as_bytes(), &data[0][..]);
    let file = |k: usize| {
        let (b, e) = span(&entry, k);
        (entry.data_start + b, entry.data_start + e)
    };
    let ext = coalesce([file(0), file(4), file(6)], 0);
    let ext = if stats.direct_io {
        align_extents(&ext, entry.bytes)
    } else {
        ext
    };
    let bytes: u64 = ext.iter().map(|(b, e)| e - b).sum();
    let reads: u64 = ext.iter().map(|(b, e)| (e - b).div_ceil(1 << 20)).sum();
    assert_eq!((stats.bytes, stats.reads, stats.tensors), (bytes, reads, 3));
}

fn flip(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let mut perm = std::fs::metadata(path).unwrap().permissions();
    #[allow(clippy::permissions_set_readonly_false)]
    perm.set_readonly(false);
    std::fs::set_permissions(path, perm).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], offset).unwrap();
}

/// One damaged byte in t5: a read that asks for t5 fails naming it, with the CRCs; a
/// read that does not ask for t5 succeeds, even when the gap makes it read that byte.
#[test]
fn a_damaged_requested_tensor_fails_naming_it() {
    let (_d, _step, path, entry, data) = saved();
    let (b, _) = span(&entry, 5);
    flip(&path, entry.data_start + b + 7);
    let mut reqs = vec![RangeRequest::owned("t4"), RangeRequest::owned("t5")];
    let err = read_ranges(&path, &entry, &mut reqs, &buffered(0)).unwrap_err();
    match err {
        Error::Checksum {
            path: p,
            tensor,
            expected,
            actual,
        } => {
            assert_eq!((p, tensor.as_str()), (path.clone(), "t5"));
            assert_eq!(expected, entry.tensors[5].crc32c);
            let mut bad = data[5].clone();
            bad[7] ^= 0x40;
            assert_eq!(actual, crc32c::crc32c(&bad));
        }
        e => panic!("expected a checksum error, got {e:?}"),
    }
    let mut reqs = vec![RangeRequest::owned("t4"), RangeRequest::owned("t6")];
    let (owned, stats) = read_ranges(&path, &entry, &mut reqs, &buffered(1 << 20)).unwrap();
    assert_eq!(owned[0].as_ref().unwrap().as_bytes(), &data[4][..]);
    assert_eq!(owned[1].as_ref().unwrap().as_bytes(), &data[6][..]);
    // One read over t4, t5 (damaged, not checked) and t6.
    assert_eq!(
        (stats.bytes, stats.reads),
        (span(&entry, 6).1 - span(&entry, 4).0, 1)
    );
}

fn destination_error(r: Result<impl std::fmt::Debug>) -> (String, String) {
    match r {
        Err(Error::Destination { name, reason }) => (name, reason),
        other => panic!("expected a destination error, got {other:?}"),
    }
}

/// Requests checked before anything is read: a tensor the file does not hold, a range
/// outside the tensor, a buffer of the wrong size.
#[test]
fn bad_requests_are_typed_errors_naming_the_tensor() {
    let (_d, step, path, entry, _data) = saved();
    let opts = RangedOptions::default();
    let mut reqs = vec![RangeRequest::owned("t1"), RangeRequest::owned("nope")];
    let (name, reason) = destination_error(read_ranges(&path, &entry, &mut reqs, &opts));
    assert_eq!(name, "nope");
    assert_eq!(reason, format!("not in the rank file {}", entry.file));
    let mut reqs = vec![RangeRequest::owned("nope")];
    let (name, _) = destination_error(load_ranges(&step, 0, &mut reqs, &opts));
    assert_eq!(name, "nope");

    for (range, reason) in [
        ((0, 4), "byte range [0, 4) is outside the tensor's 3 bytes"),
        ((2, 1), "byte range [2, 1) is outside the tensor's 3 bytes"),
        (
            (u64::MAX, u64::MAX),
            "byte range [18446744073709551615, 18446744073709551615) is outside the tensor's 3 bytes",
        ),
    ] {
        let mut reqs = vec![RangeRequest {
            name: "t1",
            range: Some(range),
            dest: RangeDest::Owned,
        }];
        let got = destination_error(read_ranges(&path, &entry, &mut reqs, &opts));
        assert_eq!(got, ("t1".to_owned(), reason.to_owned()));
    }

    let mut small = vec![0u8; SIZES[0] - 1];
    let mut reqs = vec![RangeRequest::host("t0", &mut small)];
    let got = destination_error(read_ranges(&path, &entry, &mut reqs, &opts));
    assert_eq!(
        got,
        (
            "t0".to_owned(),
            "buffer holds 999 bytes, the range has 1000".to_owned()
        )
    );
    let mut four = vec![0u8; 4];
    let mut reqs = vec![RangeRequest {
        name: "t0",
        range: Some((10, 13)),
        dest: RangeDest::Host(&mut four),
    }];
    let got = destination_error(read_ranges(&path, &entry, &mut reqs, &opts));
    assert_eq!(
        got,
        (
            "t0".to_owned(),
            "buffer holds 4 bytes, the range has 3".to_owned()
        )
    );
    drop(reqs);
    assert_eq!(four, [0; 4], "nothing was written");
}

/// The file entry is untrusted too: one that disagrees with the file (a tensor's offsets
/// moved) is refused before anything is written, and a rank the manifest lacks is an error.
#[test]
fn an_entry_that_disagrees_with_the_file_is_refused() {
    let (_d, step, path, entry, _data) = saved();
    let mut lying = entry.clone();
    lying.tensors[1].data_offsets[1] -= 1;
    lying.tensors[2].data_offsets[0] -= 1;
    let mut out = vec![7u8; SIZES[1] - 1];
    let mut reqs = vec![RangeRequest::host("t1", &mut out)];
    match read_ranges(&path, &lying, &mut reqs, &RangedOptions::default()) {
        Err(Error::Corrupt { tensor, .. }) => assert_eq!(tensor.as_deref(), Some("t1")),
        other => panic!("expected corrupt, got {other:?}"),
    }
    drop(reqs);
    assert_eq!(out, vec![7u8; SIZES[1] - 1]);
    let mut reqs = vec![RangeRequest::owned("t1")];
    assert!(matches!(
        load_ranges(&step, 3, &mut reqs, &RangedOptions::default()),
        Err(Error::Corrupt { .. })
    ));
}
