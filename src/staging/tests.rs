//! Unit tests of the staging arena.

use super::*;

fn spec(name: Option<String>, capacity: u64) -> ArenaSpec {
    ArenaSpec {
        name,
        capacity,
        chunk_size: 65536,
        slots: 2,
        rank: 0,
        world_size: 1,
        root: "/tmp/x".into(),
    }
}

#[test]
fn leases_are_distinct_and_return_to_the_pool() {
    let a = Arena::create(&spec(None, 4 * 65536)).unwrap();
    assert_eq!(a.chunk_count(), 4);
    let leases: Vec<_> = (0..4).map(|_| a.acquire().0).collect();
    let mut idx: Vec<u32> = leases.iter().map(|l| l.index()).collect();
    idx.sort();
    assert_eq!(idx, [0, 1, 2, 3]);
    assert_eq!(a.free_chunks(), 0);
    let a2 = Arc::clone(&a);
    let waiter = std::thread::spawn(move || a2.acquire().0.index());
    std::thread::sleep(Duration::from_millis(50));
    drop(leases);
    let got = waiter.join().unwrap();
    assert!(got < 4);
    assert_eq!(a.free_chunks(), 4);
    assert!(a.waited() > Duration::ZERO);
}

fn shm_exists(name: &str) -> bool {
    std::path::Path::new(shm::SHM_MOUNT).join(name).exists()
}

#[test]
fn a_prefaulting_arena_hands_out_chunks_as_they_are_allocated() {
    let name = format!("{NAME_PREFIX}unit-prefault.{}", std::process::id());
    // 1 MiB chunks: 64 per batch, 4 batches; each background batch waits 100 ms.
    let mut sp = spec(Some(name.clone()), 256 << 20);
    sp.chunk_size = 1 << 20;
    let (a, mut pf) = Arena::create_prefaulting(&sp, 2, Duration::from_millis(100)).unwrap();
    assert_eq!(a.chunk_count(), 256);
    // The first batch is allocated by the constructor, the rest not yet.
    assert!(!a.is_filled());
    assert!(!a.fill_finished());
    assert_eq!(a.free_chunks(), 64);
    // A save takes what it needs and waits for the rest: all 256 chunks, distinct,
    // writable; the last ones only once the background threads allocated them.
    let mut leases: Vec<ChunkLease> = (0..256).map(|_| a.acquire().0).collect();
    assert!(a.is_filled());
    for (i, l) in leases.iter_mut().enumerate() {
        l.as_mut_slice().fill(i as u8);
    }
    let mut idx: Vec<u32> = leases.iter().map(|l| l.index()).collect();
    idx.sort_unstable();
    assert_eq!(idx, (0..256).collect::<Vec<u32>>());
    for (i, l) in leases.iter().enumerate() {
        assert!(l.as_slice().iter().all(|&b| b == i as u8));
    }
    a.wait_filled().unwrap();
    assert!(a.fill_error().is_none());
    drop(leases);
    assert_eq!(a.free_chunks(), 256);
    // Every page is allocated: the segment has no hole left.
    let (_, size, blocks) = shm::open_existing(&name, false, false).unwrap();
    assert!(blocks >= size, "{blocks} bytes allocated of {size}");
    pf.stop();
    a.close();
    assert!(!shm_exists(&name));
}

#[test]
fn stopping_a_prefault_ends_its_threads_and_leaves_the_rest_unused() {
    let name = format!("{NAME_PREFIX}unit-prefault-stop.{}", std::process::id());
    let mut sp = spec(Some(name.clone()), 64 << 20);
    sp.chunk_size = 1 << 20;
    // 1 MiB chunks, 64 per batch: one batch only, nothing in the background.
    let (a, _pf) = Arena::create_prefaulting(&sp, 2, Duration::from_secs(3600)).unwrap();
    assert!(a.is_filled());
    a.close();
    drop(a);
    assert!(!shm_exists(&name));

    // 16 batches, each background one paused 200 ms: stopped at once, the threads end
    // after the batch they are in, long before the 3 s the rest would take.
    let mut sp = spec(Some(name.clone()), 1 << 30);
    sp.chunk_size = 1 << 20;
    let (a, mut pf) = Arena::create_prefaulting(&sp, 2, Duration::from_millis(200)).unwrap();
    assert_eq!(a.free_chunks(), 64);
    let waiter = {
        let a = Arc::clone(&a);
        std::thread::spawn(move || a.wait_filled())
    };
    pf.stop();
    // Stopped: the waiter is told (no hang), the chunks allocated stay usable, the
    // others never enter the pool.
    let r = waiter.join().unwrap();
    assert!(matches!(r, Err(Error::Shutdown(_))), "{r:?}");
    assert!(a.fill_finished());
    assert!(!a.is_filled());
    assert!(a.fill_error().is_none());
    let n = a.free_chunks();
    assert!((64..1024).contains(&n), "{n} chunks in the pool");
    // Only the prefault threads' references are gone: ours is the last one.
    assert_eq!(Arc::strong_count(&a), 1);
    a.close();
    assert!(!shm_exists(&name));
}

/// Regression: taking over a segment that a live arena of this process maps gave two
/// arenas over one mapping (two `&mut` of chunk 0). Refused now; allowed once the
/// first arena is gone.
#[test]
fn a_segment_mapped_here_cannot_be_taken_over_twice() {
    let name = format!("{NAME_PREFIX}unit-twice.{}", std::process::id());
    let sp = spec(Some(name.clone()), 2 * 65536);
    let geo = Arena::geometry(&sp).unwrap();
    let first = Arena::create(&sp).unwrap();
    first.enable_keep(); // closing leaves the segment in /dev/shm
    let (file, _, _) = shm::open_existing(&name, true, false).unwrap();
    let err = Arena::take_over(&sp, geo, file).unwrap_err();
    assert!(
        matches!(&err, Error::Shm { op: "map", source, .. }
            if source.kind() == std::io::ErrorKind::AlreadyExists),
        "{err}"
    );
    {
        let mut l = first.take_chunk(0).unwrap();
        l.as_mut_slice()[..4].copy_from_slice(b"kept");
    }
    drop(first);
    let (file, _, _) = shm::open_existing(&name, true, false).unwrap();
    let second = Arena::take_over(&sp, geo, file).unwrap();
    assert_eq!(second.name(), Some(name.as_str()));
    let mut l = second.take_chunk(0).unwrap();
    assert_eq!(&l.as_mut_slice()[..4], b"kept");
    drop(l);
    second.close(); // not kept: unlinks the name
    assert!(shm::open_existing(&name, false, false).is_err());
}

#[test]
fn named_arena_is_attachable_and_unlinked_on_close() {
    let name = format!("{NAME_PREFIX}unit.{}", std::process::id());
    let a = Arena::create(&spec(Some(name.clone()), 2 * 65536)).unwrap();
    let (mut l, _) = a.acquire();
    l.as_mut_slice()[..5].copy_from_slice(b"hello");
    a.descriptor().begin(
        1,
        &descriptor::SaveRecord {
            step: 42,
            file_len: 100,
            data_start: 4096,
            n_file_chunks: 1,
            partial_dir: "step-42.partial",
            file_name: "f",
        },
    );
    a.descriptor().chunk_staged(1, 0, l.index());
    let other = AttachedArena::open(&name).unwrap();
    let v = other.slot(1);
    assert_eq!(
        (v.state, v.step, v.partial_dir.as_str()),
        (1, 42, "step-42.partial")
    );
    assert_eq!(v.chunks, [(descriptor::chunk_state::STAGED, l.index())]);
    let mut seen = [0u8; 5];
    other.read_chunk(l.index(), 0, &mut seen).unwrap();
    assert_eq!(&seen, b"hello");
    assert_eq!(other.header().owner_pid, std::process::id());
    assert_eq!(other.header().root, std::path::Path::new("/tmp/x"));
    drop(l);
    a.close();
    assert!(AttachedArena::open(&name).is_err());
    assert!(a.descriptor().header_view().closed);
}

#[test]
fn an_adopted_image_is_recorded_kept_until_the_next_save_begins() {
    let name = format!("{NAME_PREFIX}unit-adopt.{}", std::process::id());
    let rec = descriptor::SaveRecord {
        step: 7,
        file_len: 65536 + 100,
        data_start: 4096,
        n_file_chunks: 2,
        partial_dir: "step-7.partial",
        file_name: "f",
    };
    let a = Arena::create(&spec(Some(name.clone()), 4 * 65536)).unwrap();
    let other = Arena::create(&spec(None, 4 * 65536)).unwrap();
    let leases: Vec<_> = (0..2).map(|_| a.try_acquire().unwrap()).collect();
    // Keeping off: nothing recorded.
    assert_eq!(a.adopt_kept(&rec, &leases), None);
    a.enable_keep();
    // Leases of another arena, too few leases, or a record that does not match them.
    let foreign: Vec<_> = (0..2).map(|_| other.try_acquire().unwrap()).collect();
    assert_eq!(a.adopt_kept(&rec, &foreign), None);
    assert_eq!(a.adopt_kept(&rec, &leases[..1]), None);
    let wrong = descriptor::SaveRecord {
        file_len: 3 * 65536,
        ..rec
    };
    assert_eq!(a.adopt_kept(&wrong, &leases), None);
    let slot = a.adopt_kept(&rec, &leases).unwrap();
    // Only once.
    assert_eq!(a.adopt_kept(&rec, &leases), None);
    let att = AttachedArena::open(&name).unwrap();
    let v = att.slot(slot);
    assert_eq!(
        (v.state, v.step, v.file_len, v.data_start),
        (descriptor::slot_state::KEPT, 7, 65536 + 100, 4096)
    );
    assert_eq!(
        (v.partial_dir.as_str(), v.file_name.as_str()),
        ("step-7.partial", "f")
    );
    let want: Vec<_> = leases
        .iter()
        .map(|l| (descriptor::chunk_state::WRITTEN, l.index()))
        .collect();
    assert_eq!(v.chunks, want);
    // The next save gives it up (slot freed in the descriptor, back in the pool).
    a.begin_save();
    assert_eq!(att.slot(slot).state, descriptor::slot_state::FREE);
    drop(leases);
    assert_eq!(a.free_chunks(), 4);
    // Keeping survives close: remove the name by hand.
    a.close();
    drop(att);
    let _ = std::fs::remove_file(std::path::Path::new(shm::SHM_MOUNT).join(&name));
}
