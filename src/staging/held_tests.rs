//! Unit tests of committed images held for replication (`held.rs`).

use super::held::{HeldImages, HeldPiece};
use super::*;

const CS: u64 = 65536;

fn arena(chunks: u64) -> Arc<Arena> {
    Arena::create(&ArenaSpec {
        name: None,
        capacity: chunks * CS,
        chunk_size: CS,
        slots: 2,
        rank: 0,
        world_size: 1,
        root: "/tmp/x".into(),
    })
    .unwrap()
}

/// The bytes of a "file" of `len` bytes (no two chunks alike).
fn file_bytes(len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ (i / CS) as u8)
        .collect()
}

/// A save of `file` staged as the descriptor records it: file chunk `k` in arena chunk
/// `order[k]` (taken from the pool; the other chunks taken meanwhile go back), every
/// chunk written and its lease dropped. Returns `(slot, seq)`.
fn stage(a: &Arc<Arena>, file: &[u8], order: &[u32]) -> (u32, u64) {
    let seq = a.begin_save();
    let slot = a.acquire_slot();
    let n = (file.len() as u64).div_ceil(CS);
    assert_eq!(order.len() as u64, n);
    a.descriptor().begin(
        slot,
        &descriptor::SaveRecord {
            step: 7,
            file_len: file.len() as u64,
            data_start: 8,
            n_file_chunks: n,
            partial_dir: "step-7.partial",
            file_name: "rank0.safetensors",
        },
    );
    let mut all: Vec<ChunkLease> = std::iter::from_fn(|| a.try_acquire()).collect();
    for (k, &want) in order.iter().enumerate() {
        let l = all.iter_mut().find(|l| l.index() == want).unwrap();
        let part = &file[k * CS as usize..((k + 1) * CS as usize).min(file.len())];
        l.as_mut_slice()[..part.len()].copy_from_slice(part);
        a.descriptor().chunk_staged(slot, k as u64, want);
        a.descriptor().chunk_written(slot, k as u64);
    }
    drop(all);
    (slot, seq)
}

fn staged(p: HeldPiece) -> held::HeldView {
    match p {
        HeldPiece::Staged(v) => v,
        other => panic!("expected a zero-copy piece, got {other:?}"),
    }
}

#[test]
fn a_held_image_is_out_of_the_pool_and_gives_the_files_bytes() {
    let a = arena(6);
    let reg = HeldImages::default();
    let len = 3 * CS - 100;
    let file = file_bytes(len);
    // File chunks 0, 1, 2 in arena chunks 0, 1, 4: [0, 2 CS) consecutive, then a gap.
    let (slot, seq) = stage(&a, &file, &[0, 1, 4]);
    assert_eq!(a.free_chunks(), 6);
    let image = a
        .finish_slot_holding(slot, seq, true, Some((&reg, len)))
        .expect("a whole committed image is held");
    assert_eq!(
        (image.len(), image.chunk_size(), image.held_chunks()),
        (len, CS, 3)
    );
    // Its chunks are out of the pool: a save gets only the others.
    assert_eq!(a.free_chunks(), 3);
    let others: Vec<ChunkLease> = std::iter::from_fn(|| a.try_acquire()).collect();
    let mut idx: Vec<u32> = others.iter().map(ChunkLease::index).collect();
    idx.sort_unstable();
    assert_eq!(idx, [2, 3, 5]);
    drop(others);
    // Consecutive chunks: one zero-copy view of exactly the file's bytes.
    let v = staged(image.take(0, 2 * CS).unwrap());
    assert_eq!(v.chunks(), [0, 1]);
    assert_eq!(v.as_slice(), &file[..2 * CS as usize]);
    // A piece is taken once; a piece straddling a chunk is refused.
    assert!(matches!(image.take(0, CS).unwrap(), HeldPiece::File));
    assert!(image.take(CS / 2, CS).is_err());
    assert!(image.take(2 * CS, len + 1).is_err());
    // The last piece alone (one chunk): zero-copy, exactly the file's tail.
    let tail = staged(image.take(2 * CS, len).unwrap());
    assert_eq!(tail.as_slice(), &file[2 * CS as usize..]);
    assert_eq!(image.held_chunks(), 0);
    // Taken pieces stay pinned until dropped, even after the image is closed.
    drop(image);
    assert_eq!(a.free_chunks(), 3);
    drop(v);
    assert_eq!(a.free_chunks(), 5);
    drop(tail);
    assert_eq!(a.free_chunks(), 6);
}

#[test]
fn chunks_not_consecutive_are_copied_and_given_back() {
    let a = arena(6);
    let reg = HeldImages::default();
    let len = 3 * CS - 100;
    let file = file_bytes(len);
    let (slot, seq) = stage(&a, &file, &[3, 1, 4]);
    let image = a
        .finish_slot_holding(slot, seq, true, Some((&reg, len)))
        .unwrap();
    assert_eq!(a.free_chunks(), 3);
    // Chunks 3 and 1: not consecutive, so copied; their leases go back at once.
    match image.take(0, 2 * CS).unwrap() {
        HeldPiece::Copied(b) => assert_eq!(b.as_bytes(), &file[..2 * CS as usize]),
        other => panic!("expected a copy, got {other:?}"),
    }
    assert_eq!(a.free_chunks(), 5);
    // Chunk 4 after nothing: zero-copy.
    let v = staged(image.take(2 * CS, len).unwrap());
    assert_eq!(v.as_slice(), &file[2 * CS as usize..]);
    assert_eq!(v.chunks(), [4]);
}

#[test]
fn pressure_gives_back_what_is_not_taken_without_waiting() {
    let a = arena(4);
    let reg = Arc::new(HeldImages::default());
    let weak = Arc::downgrade(&reg);
    a.set_reclaim(Reclaim(Box::new(move |_| {
        if let Some(r) = weak.upgrade() {
            r.spill_all();
        }
    })));
    let len = 3 * CS;
    let file = file_bytes(len);
    let (slot, seq) = stage(&a, &file, &[0, 1, 2]);
    let image = a
        .finish_slot_holding(slot, seq, true, Some((&*reg, len)))
        .unwrap();
    // A piece in flight: chunk 0.
    let v = staged(image.take(0, CS).unwrap());
    // The next save takes the one free chunk, then finds the pool empty: the reclaim
    // hook gives back chunks 1 and 2 and the acquire returns without waiting.
    let (free, w0) = a.acquire();
    assert_eq!((free.index(), w0), (3, Duration::ZERO));
    let (l1, w1) = a.acquire();
    assert_eq!(w1, Duration::ZERO);
    assert!([1, 2].contains(&l1.index()));
    assert_eq!((image.held_chunks(), image.spilled_chunks()), (0, 2));
    // Those pieces now come from the file.
    assert!(matches!(image.take(CS, 2 * CS).unwrap(), HeldPiece::File));
    assert!(matches!(image.take(2 * CS, len).unwrap(), HeldPiece::File));
    // The piece in flight stays pinned: the pool never hands chunk 0 out while it lives.
    let rest: Vec<ChunkLease> = std::iter::from_fn(|| a.try_acquire()).collect();
    assert_eq!(rest.len(), 1);
    assert_ne!(rest[0].index(), 0);
    assert_eq!(v.as_slice(), &file[..CS as usize]);
    drop(v);
    assert_eq!(a.try_acquire().map(|l| l.index()), Some(0));
}

#[test]
fn an_image_not_whole_in_the_arena_is_not_held() {
    let a = arena(4);
    let reg = HeldImages::default();
    let len = 2 * CS;
    let file = file_bytes(len);
    // Not committed.
    let (slot, seq) = stage(&a, &file, &[0, 1]);
    assert!(
        a.finish_slot_holding(slot, seq, false, Some((&reg, len)))
            .is_none()
    );
    // A later save began: its chunks may be reused already.
    let (slot, seq) = stage(&a, &file, &[0, 1]);
    let later = a.begin_save();
    assert!(
        a.finish_slot_holding(slot, seq, true, Some((&reg, len)))
            .is_none()
    );
    // A save larger than the arena reuses chunks: file chunks in one arena chunk.
    let (slot, seq) = stage(&a, &file, &[2, 2]);
    assert!(seq > later);
    assert!(
        a.finish_slot_holding(slot, seq, true, Some((&reg, len)))
            .is_none()
    );
    // A length that is not the recorded file's.
    let (slot, seq) = stage(&a, &file, &[0, 1]);
    assert!(
        a.finish_slot_holding(slot, seq, true, Some((&reg, len + 1)))
            .is_none()
    );
    // Nothing held: every chunk free, every slot free again.
    assert_eq!(a.free_chunks(), 4);
    let (slot, seq) = stage(&a, &file, &[0, 1]);
    let image = a
        .finish_slot_holding(slot, seq, true, Some((&reg, len)))
        .unwrap();
    assert_eq!(a.free_chunks(), 2);
    image.close();
    assert_eq!(a.free_chunks(), 4);
    assert!(matches!(image.take(0, CS).unwrap(), HeldPiece::File));
}

#[test]
fn taking_the_oldest_first_hands_out_consecutive_chunks() {
    // Batches allocated before and after the switch (64 chunks of 1 MiB each, in the
    // order the prefault threads finish them): each handed out whole, in ascending order;
    // given back in that order, handed out so again.
    let sp = ArenaSpec {
        name: Some(format!("{NAME_PREFIX}unit-oldest.{}", std::process::id())),
        capacity: 256 << 20,
        chunk_size: 1 << 20,
        slots: 2,
        rank: 0,
        world_size: 1,
        root: "/tmp/x".into(),
    };
    let (a, _pf) = Arena::create_prefaulting(&sp, 2, Duration::from_millis(100)).unwrap();
    assert!(!a.is_filled());
    a.take_oldest_first();
    let all: Vec<ChunkLease> = (0..256).map(|_| a.acquire().0).collect();
    let idx: Vec<u32> = all.iter().map(ChunkLease::index).collect();
    assert_eq!(&idx[..64], (0..64).collect::<Vec<u32>>());
    let mut firsts: Vec<u32> = idx
        .chunks(64)
        .map(|run| {
            assert!(run.windows(2).all(|w| w[1] == w[0] + 1), "{run:?}");
            run[0]
        })
        .collect();
    firsts.sort_unstable();
    assert_eq!(firsts, [0, 64, 128, 192]);
    drop(all);
    let again: Vec<u32> = (0..256).map(|_| a.acquire().0.index()).collect();
    assert_eq!(again, idx);
}

#[test]
fn a_save_takes_back_held_chunks_before_reusing_its_own() {
    // Taking the oldest first: a save whose only free chunks are its own asks the reclaim
    // hook first (reusing one would break its image), then takes a chunk it gave back.
    let a = arena(4);
    a.take_oldest_first();
    let reg = Arc::new(HeldImages::default());
    let weak = Arc::downgrade(&reg);
    a.set_reclaim(Reclaim(Box::new(move |empty| {
        assert!(!empty);
        if let Some(r) = weak.upgrade() {
            r.spill_all();
        }
    })));
    let len = 2 * CS;
    let (slot, seq) = stage(&a, &file_bytes(len), &[0, 1]);
    let image = a
        .finish_slot_holding(slot, seq, true, Some((&*reg, len)))
        .unwrap();
    // The next save takes chunks 2 and 3, written and given back at once.
    a.begin_save();
    for want in [2, 3] {
        let (l, _) = a.acquire();
        assert_eq!(l.index(), want);
    }
    assert_eq!(a.free_chunks(), 2);
    assert_eq!(image.held_chunks(), 2);
    // Only its own chunks are free: the held ones come back, and it takes one of them.
    assert!(a.try_acquire().is_none());
    let (l, waited) = a.acquire();
    assert_eq!((l.index(), waited), (0, Duration::ZERO));
    assert_eq!((image.held_chunks(), image.spilled_chunks()), (0, 2));
    assert_eq!(a.try_acquire().map(|l| l.index()), Some(1));
}
