//! Hostile and careless input (issue 9): one regression test per item.
//!
//! The tests that plant files in `/dev/shm` run in a child process in a private mount
//! namespace with its own tmpfs on `/dev/shm` (as `small_shm.rs` does), so nothing they
//! create can reach the host's shared memory. Each such test is its own parent: run on its
//! own (or in the full suite) it re-executes itself in the namespace and fails unless the
//! child exits successfully *and* prints its completion marker. Without root or `unshare`
//! it prints `SKIPPED` (and fails when `SHMCKPT_REQUIRE_NS=1`, which `.ci/run` sets).
//!
//! Arenas are crafted byte by byte here, from the documented descriptor layout, like the
//! issue's Python reproductions: nothing of the crate's staging internals is used.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use shmckpt::recover;
use shmckpt::{BackendKind, Engine, Error};

const BIN: &str = env!("CARGO_BIN_EXE_shmckpt");
const NOBODY: u32 = 65534;

// ---------------------------------------------------------------------------------------
// Harness

/// Run `body` in a child in a private mount namespace with a fresh 64 MiB tmpfs on
/// `/dev/shm`. `test` must be the name of the calling `#[test]` function.
pub(crate) fn in_private_shm(test: &str, body: fn()) {
    if is_child(test) {
        run_tool(
            "mount",
            &["-t", "tmpfs", "-o", "size=64m", "tmpfs", "/dev/shm"],
        )
        .expect("mount a private tmpfs on /dev/shm");
        assert!(shm_names().is_empty(), "a fresh /dev/shm");
        body();
        println!("HOSTILE-PASSED {test}");
        return;
    }
    let Some(mut cmd) = child_command_in_mount_ns(test) else {
        return;
    };
    let out = cmd.output().unwrap();
    let text = output_text(&out);
    assert!(
        out.status.success(),
        "child of {test} failed ({:?}):\n{text}",
        out.status
    );
    assert!(
        text.lines().any(|l| l == format!("HOSTILE-PASSED {test}")),
        "the child of {test} did not run to completion:\n{text}"
    );
    relay_markers(&text, &["ITEM", "HOSTILE-PASSED"]);
}

pub(crate) fn shm_names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

pub(crate) fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Run the CLI, with a time limit (a hang is a failure, not a stuck test run).
pub(crate) fn cli(args: &[&str]) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "`shmckpt {}` hung for 60 s:\n{}",
                args.join(" "),
                output_text(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The CLI exited normally (no signal: no SIGSEGV, SIGBUS or abort).
pub(crate) fn assert_no_signal(out: &Output, what: &str) {
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        None,
        "{what} died by a signal:\n{}",
        output_text(out)
    );
    assert!(
        out.status.code().is_some_and(|c| c <= 3), // the documented statuses (`shmckpt --help`)
        "{what} exited with {:?}:\n{}",
        out.status,
        output_text(out)
    );
}

// ---------------------------------------------------------------------------------------
// Crafting arenas from the documented layout (see src/staging/layout.rs)

const PAGE: usize = 4096;
const CS: usize = 65536;
const N_CHUNKS: usize = 2;
pub(crate) const RANK_FILE: &str = "rank-00000-of-00001.safetensors";

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A safetensors file of step `step` (rank 0 of 1) holding one 16-byte tensor `w`, with its
/// data at 4096 as the engine writes it.
fn file_image(step: u64) -> Vec<u8> {
    let mut json = format!(
        r#"{{"__metadata__":{{"shmckpt.step":"{step}","shmckpt.rank":"0","shmckpt.world_size":"1"}},"w":{{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}}}"#
    )
    .into_bytes();
    json.resize(PAGE - 8, b' ');
    let mut f = (json.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(&json);
    f.extend((0..16u8).map(|i| i.wrapping_mul(37).wrapping_add(step as u8)));
    f
}

/// A complete arena of a dead engine (owner pid u32::MAX cannot exist) for `root`, whose
/// slot 0 holds step `step` fully staged in arena chunk 0. Returns the arena and the file
/// that recovery must commit.
fn craft_arena(root: &Path, step: u64) -> (Vec<u8>, Vec<u8>) {
    use std::os::unix::ffi::OsStrExt;
    let root = root.as_os_str().as_bytes();
    let image = file_image(step);
    let root_bytes = if root.len() <= 3072 {
        0
    } else {
        root.len().div_ceil(PAGE) * PAGE
    };
    let slot_bytes = (PAGE + 4 * N_CHUNKS).div_ceil(PAGE) * PAGE;
    let slots_offset = PAGE + root_bytes;
    let data_offset = slots_offset + slot_bytes;
    let mut a = vec![0u8; data_offset + N_CHUNKS * CS];
    // Header page: the struct of the issue's repro ("<8sIIQQQQIIII"), then created and
    // closed, then the inline root at 80.
    a[..8].copy_from_slice(b"SHMCKPT1");
    put32(&mut a, 8, 1); // version
    put32(&mut a, 12, 1); // slots
    put64(&mut a, 16, data_offset as u64);
    put64(&mut a, 24, CS as u64);
    put64(&mut a, 32, N_CHUNKS as u64);
    put64(&mut a, 40, slot_bytes as u64);
    put32(&mut a, 48, u32::MAX); // owner pid
    put32(&mut a, 52, 0); // rank
    put32(&mut a, 56, 1); // world size
    put32(&mut a, 60, root.len() as u32);
    put64(&mut a, 64, 1); // created
    if root_bytes == 0 {
        a[80..80 + root.len()].copy_from_slice(root);
    } else {
        a[PAGE..PAGE + root.len()].copy_from_slice(root);
    }
    // Slot 0: STAGED, one file chunk.
    let s = slots_offset;
    let partial = format!("step-{step}.partial");
    put32(&mut a, s, 2);
    put32(&mut a, s + 4, 1);
    put64(&mut a, s + 8, step);
    put64(&mut a, s + 16, image.len() as u64);
    put64(&mut a, s + 24, PAGE as u64);
    put64(&mut a, s + 32, 1);
    put32(&mut a, s + 40, partial.len() as u32);
    put32(&mut a, s + 44, RANK_FILE.len() as u32);
    a[s + 48..s + 48 + partial.len()].copy_from_slice(partial.as_bytes());
    a[s + 1072..s + 1072 + RANK_FILE.len()].copy_from_slice(RANK_FILE.as_bytes());
    // Chunk map entry 0: STAGED in arena chunk 0.
    put32(&mut a, s + PAGE, 1 << 30);
    a[data_offset..data_offset + image.len()].copy_from_slice(&image);
    (a, image)
}

pub(crate) fn plant(name: &str, bytes: &[u8]) -> PathBuf {
    let p = Path::new("/dev/shm").join(name);
    std::fs::write(&p, bytes).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

fn committed_file(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step}")).join(RANK_FILE)
}

// ---------------------------------------------------------------------------------------
// Item 1: crafted arenas crash nothing

fn item1_body() {
    let dir = real_dir("hostile1");
    let root = dir.path();
    // The issue's repro: n_chunks = 2^62 wrapped the geometry.
    let mut evil = vec![0u8; 8192];
    evil[..8].copy_from_slice(b"SHMCKPT1");
    for (at, v) in [(8, 1u64), (12, 1)] {
        put32(&mut evil, at, v as u32);
    }
    put64(&mut evil, 16, 8192);
    put64(&mut evil, 24, 4096);
    put64(&mut evil, 32, 1 << 62);
    put64(&mut evil, 40, 4096);
    put32(&mut evil, 48, 32700);
    put32(&mut evil, 56, 1);
    put32(&mut evil, 4096 + 4, 100_000);
    let evil_path = plant("shmckpt.evil", &evil);
    // n_chunks = 2^32 (a 34 GB allocation before).
    let mut big = evil.clone();
    put64(&mut big, 32, 1 << 32);
    plant("shmckpt.big", &big);
    // A consistent header over a huge sparse file (2^30-1 chunks: 4 TiB): on a full tmpfs a
    // mapped read of it was a SIGBUS.
    let n: u64 = (1 << 30) - 1;
    let slot_bytes = (4096 + 4 * n).div_ceil(4096) * 4096;
    let mut sparse = vec![0u8; 4096];
    sparse[..8].copy_from_slice(b"SHMCKPT1");
    put32(&mut sparse, 8, 1);
    put32(&mut sparse, 12, 1);
    put64(&mut sparse, 16, 4096 + slot_bytes);
    put64(&mut sparse, 24, 4096);
    put64(&mut sparse, 32, n);
    put64(&mut sparse, 40, slot_bytes);
    put32(&mut sparse, 56, 1);
    let sp = plant("shmckpt.sparse", &sparse);
    let f = std::fs::OpenOptions::new().write(true).open(&sp).unwrap();
    f.set_len(4096 + slot_bytes + n * 4096).unwrap();
    drop(f);
    // Truncated and empty segments.
    plant("shmckpt.short", &evil[..100]);
    plant("shmckpt.empty", &[]);
    // A crafted arena of another user.
    let (foreign, _) = craft_arena(root, 3);
    let fp = plant("shmckpt.nobody", &foreign);
    std::os::unix::fs::chown(&fp, Some(NOBODY), Some(NOBODY)).unwrap();

    let out = cli(&["recover", "--list"]);
    assert_no_signal(&out, "recover --list");
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    for (name, why) in [
        ("shmckpt.evil", "inconsistent"),
        ("shmckpt.big", "inconsistent"),
        ("shmckpt.sparse", "sparse segment"),
        ("shmckpt.short", "smaller than a header"),
        ("shmckpt.empty", "smaller than a header"),
        ("shmckpt.nobody", "FOREIGN"),
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} not listed:\n{text}"));
        assert!(line.contains(why), "{name}: {line}");
    }
    // Library listing: the same, every error naming its arena.
    let all = recover::list_arenas();
    assert_eq!(all.len(), 6);
    for a in &all {
        let why = a.details.as_ref().unwrap_err();
        assert!(why.contains(&a.name), "{}: {why}", a.name);
    }
    // Recovery of an unrelated root and of each crafted arena: errors, no crash.
    let out = cli(&["recover", root.to_str().unwrap()]);
    assert_no_signal(&out, "recover DIR");
    assert!(output_text(&out).contains("no staging arenas recorded"));
    for name in [
        "shmckpt.evil",
        "shmckpt.big",
        "shmckpt.sparse",
        "shmckpt.nobody",
    ] {
        let out = cli(&["recover", "--shm", name, root.to_str().unwrap()]);
        assert_no_signal(&out, "recover --shm");
        assert!(!out.status.success());
        assert!(output_text(&out).contains(name), "{}", output_text(&out));
    }
    // An engine that recovers on open ignores them all.
    let engine =
        Engine::open(small_config(root, BackendKind::Auto).with_recover_on_open(true)).unwrap();
    drop(engine);
    assert!(committed(root).is_empty());
    // Nothing was written.
    assert_eq!(std::fs::read(&evil_path).unwrap(), evil);
    assert_eq!(std::fs::read(&fp).unwrap(), foreign);
    println!("ITEM1: {} crafted arenas listed and refused", all.len());
}

#[test]
fn item1_crafted_arenas_never_crash_listing_or_recovery() {
    in_private_shm(
        "item1_crafted_arenas_never_crash_listing_or_recovery",
        item1_body,
    );
}

// ---------------------------------------------------------------------------------------
// Item 2: recovery never writes through links

fn item2_body() {
    let dir = real_dir("hostile2");
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let victim = dir.path().join("victim.txt");
    std::fs::write(&victim, b"precious").unwrap();
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let partial = root.join("step-2.partial");
    let (arena, image) = craft_arena(&root, 2);

    // (a) The rank file is a link out of the root. Nothing is written through it, and the
    // arena is kept: a planted link must not cost the user the staged save.
    std::fs::create_dir(&partial).unwrap();
    std::os::unix::fs::symlink("../../victim.txt", partial.join(RANK_FILE)).unwrap();
    let seg = plant("shmckpt.r2", &arena);
    let rep = recover::recover_arena("shmckpt.r2", None).unwrap();
    match &rep.slots[0].outcome {
        recover::SlotOutcome::Failed { error } => {
            assert!(matches!(error, Error::UnsafePath { .. }), "{error:?}");
            let msg = error.to_string();
            assert!(msg.contains("symbolic link"), "{msg}");
            assert!(
                msg.contains(&partial.join(RANK_FILE).display().to_string()),
                "{msg}"
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(!rep.removed && rep.kept.is_some() && seg.exists());
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(!root.join("step-2").exists());
    std::fs::remove_dir_all(&partial).unwrap();

    // (b) The partial directory is a link out of the root.
    std::os::unix::fs::symlink(&elsewhere, &partial).unwrap();
    let out = cli(&["recover", root.to_str().unwrap()]);
    let text = output_text(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("FAILED") && text.contains("kept arena"),
        "{text}"
    );
    assert!(
        text.contains("step-2.partial: is not a directory"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "{text}");
    assert!(!root.join("step-2").exists());
    assert!(seg.exists());

    // (c) A link where the committed directory belongs.
    std::fs::remove_file(&partial).unwrap();
    std::os::unix::fs::symlink(&elsewhere, root.join("step-2")).unwrap();
    let rep = recover::recover_arena("shmckpt.r2", None).unwrap();
    assert!(
        matches!(&rep.slots[0].outcome, recover::SlotOutcome::Failed { error: Error::UnsafePath { path, .. } } if path == &root.join("step-2")),
        "{:?}",
        rep.slots[0].outcome
    );
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    std::fs::remove_file(root.join("step-2")).unwrap();

    // The links removed, the kept arena is recovered, byte-exact.
    let rep = recover::recover_arena("shmckpt.r2", None).unwrap();
    assert_eq!(rep.committed_steps(), [2], "{rep:?}");
    assert!(rep.removed && !seg.exists());
    assert_eq!(std::fs::read(committed_file(&root, 2)).unwrap(), image);
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(cli(&["verify", root.to_str().unwrap()]).status.success());
    println!("ITEM2: links refused, control recovered");
}

#[test]
fn item2_recovery_never_writes_through_links() {
    in_private_shm("item2_recovery_never_writes_through_links", item2_body);
}

// ---------------------------------------------------------------------------------------
// Item 3: opening an engine follows no link in the root

#[test]
fn item3_engine_open_follows_no_link_in_the_root() {
    let dir = real_dir("hostile3");
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    // A lock file planted as a link: refused, nothing created outside.
    let lock = root.join(".shmckpt-rank-0.lock");
    std::os::unix::fs::symlink(outside.join("created"), &lock).unwrap();
    let err = Engine::open(small_config(&root, BackendKind::Auto)).unwrap_err();
    assert!(matches!(err, Error::UnsafePath { .. }), "{err:?}");
    assert!(err.to_string().contains(".shmckpt-rank-0.lock"), "{err}");
    assert!(!outside.join("created").exists());
    std::fs::remove_file(&lock).unwrap();
    // Probe names planted as links to a file: never truncated.
    let target = outside.join("target");
    std::fs::write(&target, b"keep me").unwrap();
    std::os::unix::fs::symlink(
        &target,
        root.join(format!(".shmckpt-probe-{}", std::process::id())),
    )
    .unwrap();
    let engine = Engine::open(small_config(&root, BackendKind::Auto)).unwrap();
    let s = step_state(1);
    save_committed(&engine, 1, &s);
    assert_step_is_exact(&root, 1);
    drop(engine);
    assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
    // The lock file the engine made is a regular file inside the root.
    assert!(
        std::fs::symlink_metadata(&lock)
            .unwrap()
            .file_type()
            .is_file()
    );
}

// ---------------------------------------------------------------------------------------
// Item 4: links in /dev/shm are never followed

fn item4_body() {
    let dir = real_dir("hostile4");
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let (arena, image) = craft_arena(&root, 4);
    let outside = dir.path().join("outside.bin");
    std::fs::write(&outside, &arena).unwrap();
    std::os::unix::fs::symlink(&outside, "/dev/shm/shmckpt.link").unwrap();

    let out = cli(&["recover", "--list"]);
    assert_no_signal(&out, "recover --list");
    let text = output_text(&out);
    assert!(
        text.contains("shmckpt.link") && text.contains("symbolic link"),
        "{text}"
    );
    let out = cli(&["recover", "--shm", "shmckpt.link", root.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        output_text(&out).contains("symbolic link"),
        "{}",
        output_text(&out)
    );
    let out = cli(&["recover", root.to_str().unwrap()]);
    assert!(output_text(&out).contains("no staging arenas recorded"));
    assert!(committed(&root).is_empty());
    assert_eq!(
        std::fs::read(&outside).unwrap(),
        arena,
        "the outside file is untouched"
    );
    assert!(std::fs::symlink_metadata("/dev/shm/shmckpt.link").is_ok());
    // Control: the same bytes as a real segment are recovered.
    std::fs::remove_file("/dev/shm/shmckpt.link").unwrap();
    plant("shmckpt.real", &arena);
    let out = cli(&["recover", root.to_str().unwrap()]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(std::fs::read(committed_file(&root, 4)).unwrap(), image);
    println!("ITEM4: link refused, control recovered");
}

#[test]
fn item4_links_in_dev_shm_are_never_followed() {
    in_private_shm("item4_links_in_dev_shm_are_never_followed", item4_body);
}

// ---------------------------------------------------------------------------------------
// Item 5: another user's arena is never committed without --allow-foreign

fn item5_body() {
    let dir = real_dir("hostile5");
    let root = dir.path();
    let (arena, image) = craft_arena(root, 5);
    let p = plant("shmckpt.foreign", &arena);
    std::os::unix::fs::chown(&p, Some(NOBODY), Some(NOBODY)).unwrap();
    assert_eq!(std::fs::metadata(&p).unwrap().uid(), NOBODY);

    let info = recover::inspect_arena("shmckpt.foreign");
    assert!(info.foreign && info.uid == Some(NOBODY));
    assert!(info.details.unwrap_err().contains("foreign arena"));
    let out = cli(&["recover", root.to_str().unwrap()]);
    assert!(
        output_text(&out).contains("no staging arenas recorded"),
        "{}",
        output_text(&out)
    );
    let err = recover::recover_arena("shmckpt.foreign", Some(root)).unwrap_err();
    assert!(matches!(err, Error::UnsafePath { .. }), "{err:?}");
    assert!(err.to_string().contains("uid 65534"), "{err}");
    let e = Engine::open(small_config(root, BackendKind::Auto).with_recover_on_open(true)).unwrap();
    drop(e);
    assert!(committed(root).is_empty());
    assert_eq!(std::fs::read(&p).unwrap(), arena, "never written");

    // The explicit flag commits it.
    let out = cli(&[
        "recover",
        "--allow-foreign",
        "--shm",
        "shmckpt.foreign",
        root.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(committed(root), [5]);
    assert_eq!(std::fs::read(committed_file(root, 5)).unwrap(), image);
    println!("ITEM5: foreign arena refused, committed only with --allow-foreign");
}

#[test]
fn item5_foreign_arenas_are_never_committed_by_default() {
    in_private_shm(
        "item5_foreign_arenas_are_never_committed_by_default",
        item5_body,
    );
}

// ---------------------------------------------------------------------------------------
// Item 7: verify refuses a FIFO instead of hanging

#[test]
fn item7_verify_refuses_a_fifo_without_blocking() {
    let dir = real_dir("hostile7");
    let root = dir.path();
    let engine = Engine::open(small_config(root, BackendKind::Auto)).unwrap();
    let s = step_state(1);
    save_committed(&engine, 1, &s);
    drop(engine);
    let file = committed_file(root, 1);
    assert!(cli(&["verify", root.to_str().unwrap()]).status.success());
    std::fs::remove_file(&file).unwrap();
    run_tool("mkfifo", &[file.to_str().unwrap()]).unwrap();
    let out = cli(&["verify", root.to_str().unwrap()]);
    let text = output_text(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("FIFO") && text.contains(RANK_FILE), "{text}");
    // A FIFO manifest is refused the same way.
    let manifest = root.join("step-1").join("manifest.json");
    std::fs::remove_file(&manifest).unwrap();
    run_tool("mkfifo", &[manifest.to_str().unwrap()]).unwrap();
    let out = cli(&["verify", root.join("step-1").to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(output_text(&out).contains("manifest.json"));
}

// ---------------------------------------------------------------------------------------
// Item 8: long roots are recorded and recovered

fn long_root(base: &Path) -> PathBuf {
    let mut p = base.to_owned();
    while p.as_os_str().len() < 3500 {
        p.push("d".repeat(200));
    }
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn item8_body() {
    let dir = real_dir("hostile8");
    let root = long_root(dir.path());
    assert!(root.as_os_str().len() > 3072);
    // A live engine records the whole root; recovery finds its arena (in use).
    let engine = Engine::open(small_config(&root, BackendKind::Auto)).unwrap();
    let name = engine.shm_name().to_owned();
    let info = recover::inspect_arena(&name);
    assert_eq!(info.details.as_ref().unwrap().root, root);
    let found = recover::recover_root(&root, None);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].0, name);
    assert!(matches!(&found[0].1, Err(Error::Recovery { reason, .. }) if reason.contains("alive")));
    drop(engine);
    // A dead engine's arena with that root: `recover DIR` commits it.
    let (arena, image) = craft_arena(&root, 8);
    plant("shmckpt.long", &arena);
    let out = cli(&["recover", root.to_str().unwrap()]);
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("no staging arenas recorded"), "{text}");
    assert_eq!(std::fs::read(committed_file(&root, 8)).unwrap(), image);
    println!(
        "ITEM8: root of {} bytes recorded and recovered",
        root.as_os_str().len()
    );
}

#[test]
fn item8_long_roots_are_recorded_and_recovered() {
    in_private_shm("item8_long_roots_are_recorded_and_recovered", item8_body);
}
