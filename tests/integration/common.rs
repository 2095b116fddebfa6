//! Helpers shared by the integration tests.

use std::path::Path;

use shmckpt::{BackendKind, Dtype, EngineConfig, Tensor};
use shmckpt_bench::synthetic::{self, LayoutEntry};

/// A fresh directory on the real filesystem that holds `target/` (not tmpfs: O_DIRECT and
/// io_uring must meet a real block device). Removed on drop.
pub fn real_dir(tag: &str) -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(base).unwrap();
    let d = tempfile::Builder::new()
        .prefix(&format!("{tag}-"))
        .tempdir_in(base)
        .unwrap();
    let st = rustix::fs::statfs(d.path()).unwrap();
    assert_ne!(
        st.f_type as i64,
        0x0102_1994,
        "test directory {} is on tmpfs; the tests need a real filesystem",
        d.path().display()
    );
    d
}

/// Both write backends; every round-trip test runs on each.
pub const BACKENDS: [BackendKind; 2] = [BackendKind::IoUring, BackendKind::Pwrite];

/// A small engine config: 64 KiB chunks so that multi-chunk paths are exercised.
pub fn small_config(root: &Path, backend: BackendKind) -> EngineConfig {
    EngineConfig::new(root)
        .with_backend(backend)
        .with_staging_capacity(16 << 20)
        .with_chunk_size(64 << 10)
        .with_queue_depth(4)
        .with_writer_threads(2)
}

/// Owned bytes plus their layout.
pub struct State {
    pub layout: Vec<LayoutEntry>,
    pub data: Vec<Vec<u8>>,
}

impl State {
    pub fn new(layout: Vec<LayoutEntry>, seed: u64) -> State {
        let data = synthetic::materialize(&layout, seed, 2);
        State { layout, data }
    }

    pub fn tensors(&self) -> Vec<Tensor<'_>> {
        self.layout
            .iter()
            .zip(&self.data)
            .map(|(e, d)| Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), d))
            .collect()
    }

    pub fn bytes(&self) -> u64 {
        self.data.iter().map(|d| d.len() as u64).sum()
    }
}

/// One tensor of every dtype, with odd shapes, plus a scalar and zero-size tensors.
pub fn every_dtype() -> Vec<LayoutEntry> {
    let mut v: Vec<LayoutEntry> = Dtype::ALL
        .iter()
        .enumerate()
        .map(|(i, &d)| LayoutEntry {
            name: format!("t.{}", d.as_str().to_lowercase()),
            dtype: d,
            // Sub-byte dtypes need whole bytes: 8 elements per row.
            shape: vec![3 + i, 8],
        })
        .collect();
    v.push(LayoutEntry {
        name: "scalar.f64".into(),
        dtype: Dtype::F64,
        shape: vec![],
    });
    v.push(LayoutEntry {
        name: "scalar.bool".into(),
        dtype: Dtype::BOOL,
        shape: vec![],
    });
    v.push(LayoutEntry {
        name: "empty.f32".into(),
        dtype: Dtype::F32,
        shape: vec![0],
    });
    v.push(LayoutEntry {
        name: "empty.2d".into(),
        dtype: Dtype::BF16,
        shape: vec![5, 0],
    });
    v
}

/// Read `file` with the safetensors crate and compare every tensor with `state`.
pub fn assert_safetensors_equal(file: &Path, state: &State) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap_or_else(|e| panic!("{} does not parse: {e:?}", file.display()));
    assert_eq!(st.len(), state.layout.len());
    for (e, d) in state.layout.iter().zip(&state.data) {
        let v = st.tensor(&e.name).unwrap();
        assert_eq!(format!("{:?}", v.dtype()), e.dtype.as_str(), "{}", e.name);
        assert_eq!(v.shape(), &e.shape[..], "{}", e.name);
        assert!(v.data() == &d[..], "bytes of {} differ", e.name);
    }
    let (n, _) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        (8 + n) % 4096,
        0,
        "data section must start at a 4096 boundary"
    );
}

/// Compare a loaded checkpoint with `state`, byte for byte.
pub fn assert_loaded_equal(ck: &shmckpt::Checkpoint, state: &State) {
    assert_eq!(ck.tensors.len(), state.layout.len());
    for (e, d) in state.layout.iter().zip(&state.data) {
        let t = ck
            .get(&e.name)
            .unwrap_or_else(|| panic!("{} missing", e.name));
        assert_eq!(t.dtype, e.dtype);
        assert_eq!(t.shape, e.shape);
        assert!(t.data.as_bytes() == &d[..], "bytes of {} differ", e.name);
    }
}

// ---- Child processes, skips and shared-memory helpers (crash-recovery tests) ----

/// Environment variable naming the child role a re-executed test binary must run.
pub const CHILD_ENV: &str = "SHMCKPT_TEST_CHILD";

/// A child-process role: a plain function, never a `#[test]` (so never collected, listed
/// or counted as a test), run in a child process that [`child_command`] started.
pub type Role = (&'static str, fn());

/// Whether this process was started by [`child_command`] to run the role `name`.
#[allow(dead_code)] // used by the command line's tests only (cli/tests/integration)
pub fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == name)
}

/// The first statement of every test that starts children with [`child_command`]:
/// `if run_role(ROLES) { return; }`. In such a child (the test binary re-executed with only
/// this test, and [`CHILD_ENV`] naming a role) it runs that role, one of `roles`, and
/// returns true; in the test itself it returns false.
pub fn run_role(roles: &[Role]) -> bool {
    let Ok(want) = std::env::var(CHILD_ENV) else {
        return false;
    };
    let (_, role) = roles
        .iter()
        .find(|(n, _)| *n == want)
        .unwrap_or_else(|| panic!("{CHILD_ENV}={want:?} names no role of this test"));
    role();
    true
}

/// The libtest name of the running test (`module::name`): libtest names each test's
/// thread after it. Panics elsewhere (a thread of the test's own, `main`).
pub fn current_test() -> String {
    let t = std::thread::current();
    match t.name() {
        Some(n) if n != "main" && n.contains("::") => n.to_owned(),
        other => panic!("not on a test's own thread (thread {other:?})"),
    }
}

/// A command that re-runs this test binary with only the test `test` (see
/// [`current_test`]), in which [`run_role`] runs the role `role` instead of the test.
pub fn child_command_of(test: &str, role: &str) -> std::process::Command {
    assert!(
        std::env::var_os(CHILD_ENV).is_none(),
        "a child ({}) would start another: does {test} begin with `run_role`?",
        std::env::var(CHILD_ENV).unwrap_or_default()
    );
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args([
        "--exact",
        test,
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, role);
    c
}

/// [`child_command_of`] the running test (call it on the test's own thread).
pub fn child_command(role: &str) -> std::process::Command {
    child_command_of(&current_test(), role)
}

/// Kill this process with SIGKILL (no destructor, no clean shutdown runs).
pub fn sigkill_self() -> ! {
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL)
        .unwrap();
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// Switch that makes a missing mount namespace (root, `unshare --mount`, a tmpfs mount
/// in it) a failure. `.ci/run` sets it.
pub const REQUIRE_NS: &str = "SHMCKPT_REQUIRE_NS";
/// Switch that makes not running as root a failure. `.ci/run` sets it when it runs as root.
#[allow(dead_code)] // used by the command line's tests only (cli/tests/integration)
pub const REQUIRE_ROOT: &str = "SHMCKPT_REQUIRE_ROOT";
/// Switch that makes a missing ext4 image on a loop device (`mkfs.ext4`, `losetup`, loop
/// devices) a failure. `.ci/run` sets it.
pub const REQUIRE_LOOP: &str = "SHMCKPT_REQUIRE_LOOP";
/// Switch that makes the presence of a CUDA driver a failure for the tests of the no-GPU
/// paths. `.ci/run` sets it (CI has no GPU).
pub const REQUIRE_NO_GPU: &str = "SHMCKPT_REQUIRE_NO_GPU";

/// A capability this test needs is missing: a failure when the switch `require` is `1`
/// (CI sets it where the capability exists), else a visible `SKIPPED` line (Rust has no
/// runtime skip: the caller then returns).
#[track_caller]
pub fn skip(require: &str, reason: &str) {
    assert!(
        std::env::var(require).as_deref() != Ok("1"),
        "{require}=1 but {reason}"
    );
    eprintln!("SKIPPED: {reason} (set {require}=1 to make this a failure)");
}

/// Whether we run as root (mount, loop devices, namespaces).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Whether `/dev/shm/<name>` exists.
pub fn shm_exists(name: &str) -> bool {
    Path::new("/dev/shm").join(name).exists()
}

/// The name of the arena flash restore keeps for `root` and rank 0 (its canonical path:
/// as the engine names it); `root` as given when it cannot be resolved.
pub fn kept_arena_name(root: &Path) -> String {
    let canon = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_owned());
    shmckpt::testing::staging::kept_name(&canon, 0)
}

/// A unique arena name for a test.
pub fn test_shm_name(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{}test-{tag}.{}.{}",
        shmckpt::testing::staging::NAME_PREFIX,
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Removes a shared-memory segment on drop (test cleanup when an assertion fails).
pub struct ShmGuard(pub String);

impl Drop for ShmGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(Path::new("/dev/shm").join(&self.0));
    }
}

/// A layout of ~210 KiB: four 64 KiB chunks, the last one partial.
pub fn small_layout() -> Vec<LayoutEntry> {
    vec![
        LayoutEntry {
            name: "layer.0.weight".into(),
            dtype: Dtype::F32,
            shape: vec![100, 257],
        },
        LayoutEntry {
            name: "layer.0.bias".into(),
            dtype: Dtype::BF16,
            shape: vec![1000],
        },
        LayoutEntry {
            name: "optimizer.step".into(),
            dtype: Dtype::I64,
            shape: vec![3000],
        },
        LayoutEntry {
            name: "rng".into(),
            dtype: Dtype::U8,
            shape: vec![77777],
        },
    ]
}

/// The data every test saves as step `step`: deterministic, different for every step.
pub fn step_state(step: u64) -> State {
    State::new(small_layout(), 0x5eed_0000 + step)
}

/// Load and verify step `step` of `root` (rank 0) and compare it byte for byte with
/// [`step_state`].
/// Save `state` as `step` with no metadata and wait until it is committed.
pub fn save_committed(engine: &shmckpt::Engine, step: u64, state: &State) -> shmckpt::SaveReport {
    engine
        .save(step, &state.tensors(), &shmckpt::Metadata::new())
        .unwrap()
        .wait()
        .unwrap()
}

pub fn assert_step_is_exact(root: &Path, step: u64) {
    let dir = root.join(shmckpt::manifest::step_dir_name(step));
    let ck = shmckpt::restore::load_owned(&dir, 0, &shmckpt::restore::ReadOptions::default())
        .unwrap_or_else(|e| panic!("step {step} does not load: {e}"));
    assert_eq!(ck.step, step);
    assert_loaded_equal(&ck, &step_state(step));
    shmckpt::restore::verify_dir(&dir, &shmckpt::restore::ReadOptions::default())
        .unwrap_or_else(|e| panic!("step {step} does not verify: {e}"));
}

/// Committed steps of `root`, oldest first.
pub fn committed(root: &Path) -> Vec<u64> {
    shmckpt::manifest::list_committed(root)
        .unwrap()
        .into_iter()
        .map(|c| c.step)
        .collect()
}

/// Names in `root` ending in `.partial`.
pub fn partial_dirs(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial"))
        .collect()
}

/// The exact safetensors file image the engine writes for `state` as `step` of rank 0 of 1
/// with no user metadata: (bytes, data start).
#[allow(dead_code)] // used by the command line's tests only (cli/tests/integration)
pub fn file_image(step: u64, state: &State) -> (Vec<u8>, u64) {
    use shmckpt::testing::plan::{self, Plan, TensorSpec};
    let specs: Vec<TensorSpec> = state
        .layout
        .iter()
        .zip(&state.data)
        .map(|(e, d)| TensorSpec {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            len: d.len() as u64,
        })
        .collect();
    let system: shmckpt::Metadata = [
        (plan::META_STEP.to_owned(), step.to_string()),
        (plan::META_RANK.to_owned(), "0".to_owned()),
        (plan::META_WORLD.to_owned(), "1".to_owned()),
    ]
    .into();
    let p = Plan::new(&specs, &system, &shmckpt::Metadata::new()).unwrap();
    let mut image = p.header().to_vec();
    for e in p.entries() {
        assert_eq!(e.offset, image.len() as u64);
        image.extend_from_slice(&state.data[e.input]);
    }
    assert_eq!(image.len() as u64, p.file_len());
    (image, p.data_start())
}

/// Whether `prog` can be run (`prog --version` or `--help` exits at all).
pub fn have_tool(prog: &str) -> bool {
    std::process::Command::new(prog)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}

/// Like [`child_command`], but the child runs in a private mount namespace
/// (`unshare --mount --propagation private`): its mounts vanish with it. `None` (after
/// [`skip`] said why: a failure under [`REQUIRE_NS`]) when namespaces cannot be created
/// here.
pub fn child_command_in_mount_ns(role: &str) -> Option<std::process::Command> {
    let test = current_test();
    if !is_root() {
        skip(REQUIRE_NS, "mount namespaces need root");
        return None;
    }
    let probe = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "true"])
        .stderr(std::process::Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        skip(
            REQUIRE_NS,
            "`unshare --mount` is not available or not permitted",
        );
        return None;
    }
    let inner = child_command_of(&test, role);
    let mut c = std::process::Command::new("unshare");
    c.args(["--mount", "--propagation", "private"])
        .arg(inner.get_program())
        .args(inner.get_args())
        .env(CHILD_ENV, role);
    Some(c)
}

/// Run `prog args`; Ok(()) on success, else its output as the error.
pub fn run_tool(prog: &str, args: &[&str]) -> Result<(), String> {
    match std::process::Command::new(prog).args(args).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "{prog} {args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(format!("{prog}: {e}")),
    }
}

/// Re-print, on our stderr, every part of a child's output that starts with one of
/// `markers` (libtest may print a child's message on the line of the test name). Returns
/// whether any marker was seen.
pub fn relay_markers(text: &str, markers: &[&str]) -> bool {
    let mut seen = false;
    for line in text.lines() {
        if let Some(at) = markers.iter().filter_map(|m| line.find(m)).min() {
            eprintln!("{}", &line[at..]);
            seen = true;
        }
    }
    seen
}

/// The files under checkpoint root `dir` that this process holds a descriptor of
/// (`/proc/self/fd`), deleted ones included (the kernel marks them " (deleted)"), except
/// the engines' root locks (`.shmckpt-rank-N.lock`, held while an engine is open).
pub fn descriptors_under(dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    let mut found = Vec::new();
    for fd in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        // A descriptor closed between the listing and this read has no link any more.
        if let Ok(target) = std::fs::read_link(fd.path()) {
            let t = target.display().to_string();
            let lock = target
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".shmckpt-rank-") && n.ends_with(".lock"));
            if t.starts_with(&dir) && !lock {
                found.push(t);
            }
        }
    }
    found
}

/// `Engine::load_with` of `req` (a step, `StepSel` or `LoadRequest`) into owned buffers:
/// the checkpoint and how the load went.
pub fn load_with_report(
    engine: &shmckpt::Engine,
    req: impl Into<shmckpt::LoadRequest>,
) -> shmckpt::Result<(shmckpt::Checkpoint, shmckpt::LoadReport)> {
    let got = engine.load_with(&req.into(), shmckpt::LoadInto::owned())?;
    Ok((
        got.checkpoint.expect("an owned load has a checkpoint"),
        got.report,
    ))
}

/// `Engine::load_with` of `req` into the caller's host buffers by name: the step loaded.
pub fn load_into(
    engine: &shmckpt::Engine,
    req: impl Into<shmckpt::LoadRequest>,
    dest: &mut [(&str, &mut [u8])],
) -> shmckpt::Result<u64> {
    let got = engine.load_with(&req.into(), shmckpt::LoadInto::host(dest))?;
    Ok(got.report.step)
}

// -- Children killed by SIGKILL (the recovery and cadence tests) ----------------------------

/// The child's root directory and arena name, passed through the environment.
pub const ROOT_ENV: &str = "SHMCKPT_TEST_ROOT";
pub const SHM_ENV: &str = "SHMCKPT_TEST_SHM";

pub fn env_path(k: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var(k).unwrap())
}

pub fn assert_sigkilled(out: &std::process::Output) {
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "the child should have died by SIGKILL: {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs test role `name` with the root and arena in its environment; it must die by SIGKILL.
pub fn run_child(name: &str, root: &Path, shm: &str) {
    let out = child_command(name)
        .env(ROOT_ENV, root)
        .env(SHM_ENV, shm)
        .output()
        .unwrap();
    assert_sigkilled(&out);
}
