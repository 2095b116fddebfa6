//! The remote tier against a real S3-protocol server: moto's, started here
//! (`$SHMCKPT_MOTO_PYTHON -m moto.server`, else `python3`). Without moto each test prints
//! `SKIPPED` and returns; `SHMCKPT_REQUIRE_S3=1` (CI) makes that a failure. Endpoint and
//! credentials are given through `RemoteOptions::config` (the tests never change the
//! process environment).

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shmckpt::remote::{Remote, RemoteOptions};
use shmckpt::{BackendKind, EngineConfig, Error, LoadSource, Metadata, StepSel};

use crate::common::{
    State, every_dtype, load_with_report, real_dir, save_committed, small_config, step_state,
};

struct Moto {
    child: Child,
    port: u16,
    python: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn python() -> String {
    std::env::var("SHMCKPT_MOTO_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A moto server on a free port, or `None` (printed as SKIPPED; a failure with
/// `SHMCKPT_REQUIRE_S3=1`) when moto cannot be imported.
fn moto(test: &str) -> Option<Moto> {
    let py = python();
    let has = Command::new(&py)
        .args(["-c", "import moto.server, boto3"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        assert!(
            std::env::var("SHMCKPT_REQUIRE_S3").as_deref() != Ok("1"),
            "SHMCKPT_REQUIRE_S3=1 but {py} cannot import moto.server (pip install 'moto[server]')"
        );
        println!("SKIPPED {test}: {py} has no moto[server] (set SHMCKPT_REQUIRE_S3=1 to fail)");
        return None;
    }
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let child = Command::new(&py)
        .args([
            "-m",
            "moto.server",
            "-H",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let m = Moto {
        child,
        port,
        python: py,
    };
    let t = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t.elapsed() < Duration::from_secs(60), "moto did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    Some(m)
}

impl Moto {
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn create_bucket(&self, name: &str) {
        let code = format!(
            "import boto3; boto3.client('s3', endpoint_url='{}', region_name='us-east-1', \
             aws_access_key_id='t', aws_secret_access_key='t').create_bucket(Bucket='{name}')",
            self.endpoint()
        );
        let st = Command::new(&self.python)
            .args(["-c", &code])
            .status()
            .unwrap();
        assert!(st.success());
    }

    fn options(&self) -> RemoteOptions {
        RemoteOptions {
            part_size: 5 << 20,
            concurrency: 4,
            retries: 1,
            config: vec![
                ("aws_endpoint".into(), self.endpoint()),
                ("aws_access_key_id".into(), "testing".into()),
                ("aws_secret_access_key".into(), "testing".into()),
                ("aws_region".into(), "us-east-1".into()),
                ("aws_allow_http".into(), "true".into()),
            ],
            ..RemoteOptions::default()
        }
    }
}

fn config(m: &Moto, root: &std::path::Path, url: &str) -> EngineConfig {
    small_config(root, BackendKind::Pwrite)
        .with_remote(url)
        .with_remote_options(m.options())
}

#[test]
fn save_commits_in_the_bucket_and_loads_back_from_it() {
    let Some(m) = moto("save_commits_in_the_bucket_and_loads_back_from_it") else {
        return;
    };
    m.create_bucket("rt-bucket");
    let dir = real_dir("remote-rt");
    let s = State::new(every_dtype(), 11);
    let engine = config(&m, dir.path(), "s3://rt-bucket/a/b")
        .with_remote_keep_last(Some(1))
        .build()
        .unwrap();
    for step in [4, 8] {
        let h = engine.save(step, &s.tensors(), &Metadata::new()).unwrap();
        let local = h.wait_remote_after_local();
        assert_eq!(local.0.bytes, local.1.bytes);
        assert_eq!(local.1.retired, if step == 8 { vec![4] } else { vec![] });
    }
    assert_eq!(engine.list_remote().unwrap(), vec![8]);
    std::fs::remove_dir_all(dir.path().join("step-8")).unwrap();
    std::fs::remove_dir_all(dir.path().join("step-4")).unwrap();
    let (ck, rep) = load_with_report(&engine, StepSel::Latest).unwrap();
    assert_eq!(rep.source, LoadSource::Remote);
    assert_eq!(ck.step, 8);
    assert_same(&ck, &s);
    let r = engine.remote().unwrap();
    assert_eq!(r.verify(8).unwrap(), s_file_len(r, 8));
    engine.close();
}

/// Every tensor of `s` is in `ck` with its exact bytes (the file orders them by its plan).
fn assert_same(ck: &shmckpt::Checkpoint, s: &State) {
    assert_eq!(ck.tensors.len(), s.layout.len());
    for (e, d) in s.layout.iter().zip(&s.data) {
        let t = ck
            .get(&e.name)
            .unwrap_or_else(|| panic!("{} missing", e.name));
        assert_eq!(t.data.as_bytes(), &d[..], "{}", e.name);
        assert_eq!((t.dtype, &t.shape), (e.dtype, &e.shape), "{}", e.name);
    }
}

fn s_file_len(r: &Remote, step: u64) -> u64 {
    r.manifest(step).unwrap().total_bytes
}

trait WaitBoth {
    fn wait_remote_after_local(self) -> (shmckpt::SaveReport, shmckpt::remote::RemoteReport);
}

impl WaitBoth for shmckpt::SaveHandle {
    fn wait_remote_after_local(self) -> (shmckpt::SaveReport, shmckpt::remote::RemoteReport) {
        let p = self.remote().unwrap();
        let local = self.wait().unwrap();
        (local, p.wait().unwrap())
    }
}

/// Two ranks on two machines: each has its own local root (no shared filesystem), so the
/// local tier cannot commit the step (each root lacks the other rank's part), but the
/// bucket does, once both objects are there, exactly once.
#[test]
fn ranks_without_a_shared_disk_commit_once_in_the_bucket() {
    let Some(m) = moto("ranks_without_a_shared_disk_commit_once_in_the_bucket") else {
        return;
    };
    m.create_bucket("mr-bucket");
    let dirs = [real_dir("remote-r0"), real_dir("remote-r1")];
    let states = [State::new(every_dtype(), 1), State::new(every_dtype(), 2)];
    let engines: Vec<_> = (0..2u32)
        .map(|r| {
            config(&m, dirs[r as usize].path(), "s3://mr-bucket/job")
                .with_rank(r, 2)
                .build()
                .unwrap()
        })
        .collect();
    let reports: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = engines
            .iter()
            .zip(&states)
            .map(|(e, s)| {
                sc.spawn(move || {
                    e.save(3, &s.tensors(), &Metadata::new())
                        .unwrap()
                        .wait_remote_after_local()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Not committed on either disk, committed once in the bucket.
    assert!(reports.iter().all(|(l, _)| l.dir.is_none()));
    assert_eq!(
        reports.iter().filter(|(_, r)| r.committed_here).count(),
        1,
        "{reports:?}"
    );
    for (r, (e, s)) in engines.iter().zip(&states).enumerate() {
        assert_eq!(e.list_remote().unwrap(), vec![3]);
        let (ck, rep) = load_with_report(e, 3).unwrap();
        assert_eq!(rep.source, LoadSource::Remote, "rank {r}");
        assert_same(&ck, s);
    }
    let man = engines[0].remote().unwrap().manifest(3).unwrap();
    assert_eq!(man.world_size, 2);
    assert_eq!(
        man.files.iter().map(|f| f.rank).collect::<Vec<_>>(),
        vec![0, 1]
    );
}

#[test]
fn a_missing_bucket_fails_the_open_with_a_clear_error() {
    let Some(m) = moto("a_missing_bucket_fails_the_open_with_a_clear_error") else {
        return;
    };
    let dir = real_dir("remote-nob");
    match config(&m, dir.path(), "s3://no-such-bucket/x").build() {
        Err(Error::Remote { url, op, reason }) => {
            assert_eq!((url.as_str(), op), ("s3://no-such-bucket/x", "list"));
            assert!(reason.starts_with("the bucket does not exist"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

/// `push`, `inspect`, `verify` and `gc` of a bucket with `--json`: one document each, exact
/// fields, the same size of the step everywhere (issue 39, item 6).
#[test]
fn cli_bucket_commands_speak_json() {
    let Some(m) = moto("cli_bucket_commands_speak_json") else {
        return;
    };
    m.create_bucket("clij");
    let dir = real_dir("remote-cli-json");
    let root = dir.path();
    let e = shmckpt::Engine::open(small_config(root, BackendKind::Pwrite)).unwrap();
    for s in [1, 2] {
        save_committed(&e, s, &step_state(s));
    }
    e.close();
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_shmckpt"))
            .args(args)
            .env("AWS_ENDPOINT_URL", m.endpoint())
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ALLOW_HTTP", "true")
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&o.stderr), "", "{args:?}");
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let url = "s3://clij/p";
    let mut sizes = Vec::new();
    for s in [1u64, 2] {
        let step = root.join(format!("step-{s}"));
        let total = shmckpt::Manifest::read(&step).unwrap().total_bytes;
        sizes.push(total);
        let j = run(&["push", "--json", step.to_str().unwrap(), url]);
        assert_eq!(j["dir"], step.to_str().unwrap());
        assert_eq!(j["at"], format!("{url}/step-{s}").as_str());
        assert_eq!(
            (&j["step"], &j["bytes"]),
            (&serde_json::json!(s), &serde_json::json!(total))
        );
        assert!(j["seconds"].as_f64().unwrap() >= 0.0);
    }
    let j = run(&["inspect", "--json", url]);
    assert_eq!(j["root"], url);
    assert_eq!(j["open_uploads"], serde_json::json!([]));
    let rows = j["checkpoints"].as_array().unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| (r["step"].as_u64().unwrap(), r["bytes"].as_u64().unwrap()))
            .collect::<Vec<_>>(),
        [(1, sizes[0]), (2, sizes[1])]
    );
    let j = run(&["verify", "--json", "--all", url]);
    assert_eq!(j["failed"], 0);
    let v = j["checkpoints"].as_array().unwrap();
    assert_eq!(
        v.iter()
            .map(|r| (
                r["at"].as_str().unwrap().to_owned(),
                r["ok"].as_bool().unwrap(),
                r["bytes"].as_u64().unwrap()
            ))
            .collect::<Vec<_>>(),
        [
            (format!("{url}/step-1"), true, sizes[0]),
            (format!("{url}/step-2"), true, sizes[1])
        ],
        "verify reports the size inspect shows"
    );
    let j = run(&["gc", "--json", url, "--keep", "1"]);
    assert_eq!(
        j,
        serde_json::json!({
            "root": url,
            "removed_uncommitted_steps": [],
            "removed_objects": 0,
            "removed_bytes": 0,
            "aborted_uploads": 0,
            "min_age_seconds": 3600,
            "removed_steps": [1],
            "kept": 1,
        })
    );
}

/// `shmckpt export s3://bucket/prefix` (its latest committed step) and
/// `s3://bucket/prefix/step-N` give byte for byte the shards the export of the same local
/// step gives, fetching only the exported tensors' bytes (the optimizer's are left in the
/// bucket); a flipped byte of an exported tensor in the bucket is a checksum error, with
/// nothing visible at the destination.
#[test]
fn export_from_a_bucket_equals_the_local_export() {
    let Some(m) = moto("export_from_a_bucket_equals_the_local_export") else {
        return;
    };
    m.create_bucket("exb");
    let dir = real_dir("remote-export");
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let e = shmckpt::Engine::open(small_config(&root, BackendKind::Pwrite)).unwrap();
    for s in [1, 2] {
        save_committed(&e, s, &step_state(s));
    }
    e.close();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_shmckpt"))
            .args(args)
            .env("AWS_ENDPOINT_URL", m.endpoint())
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ALLOW_HTTP", "true")
            .output()
            .unwrap()
    };
    let ok = |args: &[&str]| {
        let o = run(args);
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap_or_default()
    };
    let url = "s3://exb/p";
    for s in [1, 2] {
        let step = root.join(format!("step-{s}"));
        ok(&["push", "--json", step.to_str().unwrap(), url]);
    }
    let files = |d: &std::path::Path| -> std::collections::BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().into_string().unwrap();
                (name, std::fs::read(e.path()).unwrap())
            })
            .collect()
    };
    let out = |name: &str| dir.path().join(name);
    let s = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let shard = ["--max-shard-size", "100000", "--json"];
    for (src_b, src_l, step) in [
        (url.to_owned(), s(&root), 2u64),
        (format!("{url}/step-1"), s(&root.join("step-1")), 1),
    ] {
        let (ob, ol) = (out(&format!("b{step}")), out(&format!("l{step}")));
        let jb = ok(&[&["export", &src_b, &s(&ob)][..], &shard[..]].concat());
        let jl = ok(&[&["export", &src_l, &s(&ol)][..], &shard[..]].concat());
        assert_eq!(jb["step"], step);
        assert_eq!(jb["source"], format!("{url}/step-{step}").as_str());
        assert_eq!((&jb["files"], &jb["bytes"]), (&jl["files"], &jl["bytes"]));
        assert!(jb["files"].as_array().unwrap().len() > 2, "{jb}");
        let (fb, fl) = (files(&ob), files(&ol));
        assert_eq!(fb.keys().collect::<Vec<_>>(), fl.keys().collect::<Vec<_>>());
        for (k, v) in &fb {
            assert!(v == &fl[k], "{k} differs");
        }
        // Only the exported tensors' ranges (and the header) were fetched.
        let entry = &shmckpt::Manifest::read(&root.join(format!("step-{step}")))
            .unwrap()
            .files[0]
            .clone();
        let opt = entry
            .tensors
            .iter()
            .find(|t| t.name == "optimizer.step")
            .unwrap();
        assert_eq!(jb["bytes_read"], entry.bytes - opt.len());
    }

    // A flipped byte of an exported tensor in the bucket's object of step 2.
    let r = Remote::open(url, m.options()).unwrap();
    let man = r.manifest(2).unwrap();
    let entry = &man.files[0];
    let t = entry
        .tensors
        .iter()
        .find(|t| t.name == "layer.0.weight")
        .unwrap();
    let at = entry.data_start + t.data_offsets[0] + 3;
    let key = format!("p/step-2/{}", entry.object_name());
    let code = format!(
        "import boto3; c = boto3.client('s3', endpoint_url='{}', region_name='us-east-1', \
         aws_access_key_id='t', aws_secret_access_key='t'); \
         b = bytearray(c.get_object(Bucket='exb', Key='{key}')['Body'].read()); \
         b[{at}] ^= 0x20; c.put_object(Bucket='exb', Key='{key}', Body=bytes(b))",
        m.endpoint()
    );
    let st = Command::new(&m.python)
        .args(["-c", &code])
        .status()
        .unwrap();
    assert!(st.success());
    let bad = out("bad");
    let o = run(&["export", url, &s(&bad)]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("layer.0.weight") && err.to_lowercase().contains("checksum"),
        "{err}"
    );
    assert!(!bad.exists());
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["b1", "b2", "l1", "l2", "root"]);
}
