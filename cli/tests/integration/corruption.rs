//! Corrupted checkpoints: `verify` and `load` report the file (and the tensor, where one is
//! concerned) and never panic. Hand-made cases, a regression corpus (`tests/corpus/`), and
//! property tests that mutate the manifest, the header and the file at random.

use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use proptest::prelude::*;
use shmckpt::manifest::{MANIFEST, Manifest};
use shmckpt::restore::{self, ReadOptions};
use shmckpt::{BackendKind, Engine, Error, Metadata};

const FILE: &str = "rank-00000-of-00001.safetensors";

/// A committed checkpoint of [`step_state`]`(1)`, in `root/step-1`.
struct Pristine {
    _dir: tempfile::TempDir,
    root: PathBuf,
    manifest: Manifest,
    manifest_bytes: Vec<u8>,
    file_bytes: Vec<u8>,
}

impl Pristine {
    fn new() -> Pristine {
        let dir = real_dir("pristine");
        let root = dir.path().to_owned();
        let e = Engine::open(small_config(&root, BackendKind::Auto).with_staging_capacity(1 << 20))
            .unwrap();
        let s = step_state(1);
        let meta: Metadata = [("k".to_owned(), "v".to_owned())].into();
        e.save(1, &s.tensors(), &meta).unwrap().wait().unwrap();
        drop(e);
        let ck = root.join("step-1");
        Pristine {
            manifest: Manifest::read(&ck).unwrap(),
            manifest_bytes: std::fs::read(ck.join(MANIFEST)).unwrap(),
            file_bytes: std::fs::read(ck.join(FILE)).unwrap(),
            _dir: dir,
            root,
        }
    }

    /// A fresh checkpoint directory holding `manifest` and `file`.
    fn variant(&self, tag: &str, manifest: &[u8], file: &[u8]) -> PathBuf {
        let d = self.root.join(tag);
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join(MANIFEST), manifest).unwrap();
        std::fs::write(d.join(FILE), file).unwrap();
        d
    }

    fn data_start(&self) -> u64 {
        self.manifest.files[0].data_start
    }

    fn tensor_offset(&self, name: &str) -> u64 {
        let t = self.manifest.files[0]
            .tensors
            .iter()
            .find(|t| t.name == name)
            .unwrap();
        self.data_start() + t.data_offsets[0]
    }

    fn with_manifest(&self, edit: impl FnOnce(&mut Manifest)) -> Vec<u8> {
        let mut m = self.manifest.clone();
        edit(&mut m);
        serde_json::to_vec_pretty(&m).unwrap()
    }

    /// The file with its JSON header replaced by `edit(header)`, padded to the same length.
    fn with_header(&self, edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
        let n = self.data_start() as usize - 8;
        let mut v: serde_json::Value = serde_json::from_slice(&self.file_bytes[8..8 + n]).unwrap();
        edit(&mut v);
        let mut json = serde_json::to_vec(&v).unwrap();
        assert!(json.len() <= n);
        json.resize(n, b' ');
        let mut f = self.file_bytes.clone();
        f[8..8 + n].copy_from_slice(&json);
        f
    }
}

fn opts() -> ReadOptions {
    ReadOptions {
        queue_depth: 2,
        ..ReadOptions::default()
    }
}

/// `verify` and `load` both fail, and `check` accepts each error.
fn assert_fails(dir: &Path, check: impl Fn(&Error)) {
    let v = restore::verify_dir(dir, &opts()).expect_err("verify must fail");
    check(&v);
    let l = restore::load_owned(dir, 0, &opts()).expect_err("load must fail");
    check(&l);
}

fn names_file(e: &Error, dir: &Path, tensor: Option<&str>) {
    let msg = e.to_string();
    assert!(
        msg.contains(&dir.join(FILE).display().to_string()),
        "error does not name the file: {msg}"
    );
    if let Some(t) = tensor {
        assert!(msg.contains(t), "error does not name tensor {t}: {msg}");
    }
}

#[test]
fn flipped_data_byte_fails_the_checksum_of_that_tensor() {
    let p = Pristine::new();
    for name in ["layer.0.weight", "layer.0.bias", "optimizer.step", "rng"] {
        let mut f = p.file_bytes.clone();
        f[p.tensor_offset(name) as usize + 5] ^= 0x01;
        let d = p.variant("flip", &p.manifest_bytes, &f);
        assert_fails(&d, |e| {
            assert!(
                matches!(e, Error::Checksum { path, tensor, .. } if path == &d.join(FILE) && tensor == name),
                "{e}"
            );
        });
    }
    // The CLI says FAIL with the file and tensor, and exits non-zero.
    let mut f = p.file_bytes.clone();
    f[p.tensor_offset("rng") as usize] ^= 0x80;
    let d = p.variant("flip-cli", &p.manifest_bytes, &f);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shmckpt"))
        .args(["verify", d.to_str().unwrap()])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        said.contains("FAIL") && said.contains("\"rng\"") && said.contains(FILE),
        "{said}"
    );
}

/// The header's `__metadata__` (user metadata, and the Python package's state skeleton)
/// is covered by the manifest's header CRC-32C: a header edited so that it still parses
/// and still lists exactly the manifest's tensors is refused by every read (before, a lost
/// or altered `__metadata__` went unnoticed), and `Engine::file_metadata` never returns it.
#[test]
fn a_header_whose_metadata_was_edited_fails_its_crc() {
    let p = Pristine::new();
    assert!(p.manifest.files[0].header_crc32c.is_some());
    for (tag, edit) in [("meta-gone", "drop"), ("meta-changed", "change")] {
        let f = p.with_header(|h| {
            let o = h.as_object_mut().unwrap();
            if edit == "drop" {
                o.remove("__metadata__");
            } else {
                o["__metadata__"]["k"] = serde_json::Value::from("w");
            }
        });
        let d = p.variant(tag, &p.manifest_bytes, &f);
        assert_fails(&d, |e| {
            names_file(e, &d, None);
            assert!(e.to_string().contains("header CRC-32C"), "{e}");
        });
        let err = restore::read_file_metadata(&d.join(FILE), &p.manifest.files[0]).unwrap_err();
        assert!(err.to_string().contains("header CRC-32C"), "{err}");
    }
    // The pristine file's metadata is read back as saved.
    let d = p.variant("pristine-meta", &p.manifest_bytes, &p.file_bytes);
    let meta = restore::read_file_metadata(&d.join(FILE), &p.manifest.files[0]).unwrap();
    assert_eq!(meta.get("k").map(String::as_str), Some("v"));
    // A manifest written before the field existed checks nothing more than before.
    let old = p.with_manifest(|m| m.files[0].header_crc32c = None);
    assert!(!String::from_utf8_lossy(&old).contains("header_crc32c"));
    let f = p.with_header(|h| {
        h["__metadata__"]["k"] = serde_json::Value::from("w");
    });
    let d = p.variant("old-manifest", &old, &f);
    restore::load_owned(&d, 0, &opts()).unwrap();
}

#[test]
fn truncated_file_is_reported_with_sizes() {
    let p = Pristine::new();
    for cut in [1, 100, p.file_bytes.len() - 8, p.file_bytes.len()] {
        let f = &p.file_bytes[..p.file_bytes.len() - cut];
        let d = p.variant("trunc", &p.manifest_bytes, f);
        assert_fails(&d, |e| match e {
            Error::Truncated {
                path,
                expected,
                actual,
            } => {
                assert_eq!(path, &d.join(FILE));
                assert_eq!(*expected, p.file_bytes.len() as u64);
                assert_eq!(*actual, (p.file_bytes.len() - cut) as u64);
            }
            other => panic!("{other}"),
        });
    }
    // Trailing garbage is an error too.
    let mut f = p.file_bytes.clone();
    f.extend_from_slice(b"junk");
    let d = p.variant("long", &p.manifest_bytes, &f);
    assert_fails(&d, |e| names_file(e, &d, None));
}

#[test]
fn manifest_lying_about_shapes_offsets_sizes_or_checksums_is_caught() {
    let p = Pristine::new();
    // Shape with the same byte size: the header disagrees.
    let m = p.with_manifest(|m| {
        let t = m.files[0]
            .tensors
            .iter_mut()
            .find(|t| t.name == "layer.0.weight")
            .unwrap();
        assert_eq!(t.shape, [100, 257]);
        t.shape = vec![257, 100];
    });
    let d = p.variant("shape", &m, &p.file_bytes);
    assert_fails(&d, |e| {
        assert!(
            matches!(e, Error::Corrupt { tensor: Some(t), .. } if t == "layer.0.weight"),
            "{e}"
        );
        names_file(e, &d, Some("layer.0.weight"));
    });
    // A checksum lie.
    let m = p.with_manifest(|m| {
        let t = m.files[0]
            .tensors
            .iter_mut()
            .find(|t| t.name == "optimizer.step")
            .unwrap();
        t.crc32c ^= 1;
    });
    let d = p.variant("crc", &m, &p.file_bytes);
    assert_fails(&d, |e| {
        assert!(
            matches!(e, Error::Checksum { tensor, .. } if tensor == "optimizer.step"),
            "{e}"
        );
        names_file(e, &d, Some("optimizer.step"));
    });
    // Overlapping offsets: refused by the manifest parser, naming the tensor.
    let m = p.with_manifest(|m| {
        m.files[0].tensors[1].data_offsets[0] -= 4;
    });
    let d = p.variant("overlap", &m, &p.file_bytes);
    let second = p.manifest.files[0].tensors[1].name.clone();
    assert_fails(&d, |e| {
        assert!(
            matches!(e, Error::Corrupt { tensor: Some(t), path, .. } if *t == second && path == &d.join(MANIFEST)),
            "{e}"
        );
    });
    // Out of range but self-consistent: the last tensor runs past the end of the file.
    let m = p.with_manifest(|m| {
        let f = &mut m.files[0];
        let last = f.tensors.last_mut().unwrap();
        assert_eq!(last.dtype, shmckpt::Dtype::U8);
        last.shape[0] += 8;
        last.data_offsets[1] += 8;
        f.bytes += 8;
    });
    let d = p.variant("range", &m, &p.file_bytes);
    assert_fails(&d, |e| assert!(matches!(e, Error::Truncated { .. }), "{e}"));
    // A terabyte tensor in a small file: an error, not an attempt to allocate it.
    let m = p.with_manifest(|m| {
        let f = &mut m.files[0];
        let last = f.tensors.last_mut().unwrap();
        let grow = (1u64 << 40) - last.len();
        last.shape[0] = 1 << 40;
        last.data_offsets[1] += grow;
        f.bytes += grow;
    });
    let d = p.variant("terabyte", &m, &p.file_bytes);
    assert_fails(&d, |e| assert!(matches!(e, Error::Truncated { .. }), "{e}"));
}

#[test]
fn header_length_and_header_json_corruption_is_caught() {
    let p = Pristine::new();
    for n in [u64::MAX, 1 << 40, 100_000_001, 99_999_999, 0, 4000] {
        let mut f = p.file_bytes.clone();
        f[..8].copy_from_slice(&n.to_le_bytes());
        let d = p.variant("len", &p.manifest_bytes, &f);
        assert_fails(&d, |e| {
            assert!(matches!(e, Error::Corrupt { .. }), "length {n}: {e}");
            names_file(e, &d, None);
        });
    }
    // A tensor renamed in the header only.
    let pos = p
        .file_bytes
        .windows(5)
        .position(|w| w == b"\"rng\"")
        .unwrap();
    let mut f = p.file_bytes.clone();
    f[pos + 1..pos + 4].copy_from_slice(b"rnh");
    let d = p.variant("rename", &p.manifest_bytes, &f);
    assert_fails(&d, |e| {
        assert!(
            matches!(e, Error::Corrupt { tensor: Some(t), .. } if t == "rng"),
            "{e}"
        );
    });
    // Invalid UTF-8 in the header.
    f[pos + 1..pos + 4].copy_from_slice(&[0xff, 0xfe, 0xfd]);
    let d = p.variant("utf8", &p.manifest_bytes, &f);
    assert_fails(&d, |e| {
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        names_file(e, &d, None);
    });
    // Overlapping offsets in the header while the manifest is right.
    let f = p.with_header(|v| {
        v["layer.0.bias"]["data_offsets"][0] =
            serde_json::json!(v["layer.0.bias"]["data_offsets"][0].as_u64().unwrap() - 2);
    });
    let d = p.variant("hdr-overlap", &p.manifest_bytes, &f);
    assert_fails(&d, |e| {
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        names_file(e, &d, Some("layer.0.bias"));
    });
    // Offsets past the data section in the header.
    let f = p.with_header(|v| {
        v["rng"]["data_offsets"][1] = serde_json::json!(1u64 << 50);
    });
    let d = p.variant("hdr-range", &p.manifest_bytes, &f);
    assert_fails(&d, |e| names_file(e, &d, None));
}

#[test]
fn invalid_manifest_bytes_are_reported_with_the_manifest_path() {
    let p = Pristine::new();
    let half = &p.manifest_bytes[..p.manifest_bytes.len() / 2];
    let mut bad_utf8 = p.manifest_bytes.clone();
    let at = bad_utf8.windows(5).position(|w| w == b"\"rng\"").unwrap();
    bad_utf8[at + 1..at + 4].copy_from_slice(&[0xff, 0xfe, 0xfd]);
    for (tag, m) in [
        ("half", half),
        ("utf8", &bad_utf8[..]),
        ("empty", &b""[..]),
        ("null", &b"null"[..]),
    ] {
        let d = p.variant(tag, m, &p.file_bytes);
        assert_fails(&d, |e| {
            assert!(
                matches!(e, Error::Corrupt { path, .. } if path == &d.join(MANIFEST)),
                "{tag}: {e}"
            );
        });
    }
    // A missing manifest is an I/O error naming it.
    let d = p.variant("missing", b"", &p.file_bytes);
    std::fs::remove_file(d.join(MANIFEST)).unwrap();
    assert_fails(&d, |e| {
        assert!(
            matches!(e, Error::Io { path, .. } if path == &d.join(MANIFEST)),
            "{e}"
        );
    });
}

fn corpus(sub: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(sub);
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "empty corpus {}", dir.display());
    v
}

#[test]
fn manifest_corpus_is_rejected_without_panics() {
    let p = Pristine::new();
    for (name, bytes) in corpus("manifest") {
        let d = p.variant("corpus", &bytes, &p.file_bytes);
        let v = restore::verify_dir(&d, &opts());
        let l = restore::load_owned(&d, 0, &opts());
        assert!(v.is_err() && l.is_err(), "{name}: accepted");
        eprintln!("{name}: {}", v.unwrap_err());
    }
}

#[test]
fn header_corpus_is_rejected_without_panics() {
    let p = Pristine::new();
    let entry = &p.manifest.files[0];
    for (name, bytes) in corpus("header") {
        let d = p.variant("hcorpus", &p.manifest_bytes, &bytes);
        let path = d.join(FILE);
        let f = std::fs::File::open(&path).unwrap();
        let r = restore::check_header(&f, &path, entry);
        assert!(r.is_err(), "{name}: accepted");
        eprintln!("{name}: {}", r.unwrap_err());
        // The same bytes at the start of a full-size file.
        let mut full = p.file_bytes.clone();
        let n = bytes.len().min(full.len());
        full[..n].copy_from_slice(&bytes[..n]);
        if full != p.file_bytes {
            let d = p.variant("hcorpus-full", &p.manifest_bytes, &full);
            assert_fails(&d, |e| names_file(e, &d, None));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Arbitrary bytes never panic the manifest parser.
    #[test]
    fn manifest_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let _ = Manifest::parse(&bytes, Path::new("fuzz.json"));
    }

    /// Arbitrary JSON-shaped text never panics it either.
    #[test]
    fn manifest_parser_never_panics_on_json_like_text(s in "[\\[\\]{}\",:0-9a-z_\\-. ]{0,400}") {
        let _ = Manifest::parse(s.as_bytes(), Path::new("fuzz.json"));
    }
}

fn mutate(base: &[u8], edits: &[(usize, u8)], range: std::ops::Range<usize>) -> Vec<u8> {
    let mut v = base.to_vec();
    for &(at, b) in edits {
        let i = range.start + at % (range.end - range.start).max(1);
        if i < v.len() {
            v[i] = b;
        }
    }
    v
}

thread_local! {
    static PRISTINE: Pristine = Pristine::new();
}

/// Load never panics, and when it succeeds it returns exactly the saved tensors.
fn never_lies(d: &Path) -> Result<(), TestCaseError> {
    let v = restore::verify_dir(d, &opts());
    let l = restore::load_owned(d, 0, &opts());
    prop_assert_eq!(
        v.is_ok(),
        l.is_ok(),
        "verify and load disagree: {:?} / {:?}",
        v.err(),
        l.as_ref().err()
    );
    if let Ok(ck) = l {
        let s = step_state(1);
        prop_assert_eq!(ck.tensors.len(), s.layout.len());
        for (e, d) in s.layout.iter().zip(&s.data) {
            let t = ck.get(&e.name);
            prop_assert!(t.is_some(), "{} missing", e.name);
            let t = t.unwrap();
            prop_assert_eq!(t.dtype, e.dtype);
            prop_assert_eq!(&t.shape, &e.shape);
            prop_assert!(t.data.as_bytes() == &d[..], "{} loaded wrong bytes", e.name);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random byte edits of the manifest: an error, or exactly the saved data.
    #[test]
    fn mutated_manifest_is_rejected_or_harmless(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)
    ) {
        PRISTINE.with(|p| {
            let m = mutate(&p.manifest_bytes, &edits, 0..p.manifest_bytes.len());
            let d = p.variant("prop-m", &m, &p.file_bytes);
            never_lies(&d)
        })?;
    }

    /// Random byte edits of the file, mostly in the header: an error, or exactly the saved
    /// data (edits to padding or to metadata values can be harmless).
    #[test]
    fn mutated_file_is_rejected_or_harmless(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        in_header in any::<bool>(),
    ) {
        PRISTINE.with(|p| {
            let ds = p.data_start() as usize;
            let range = if in_header { 0..ds } else { 0..p.file_bytes.len() };
            let f = mutate(&p.file_bytes, &edits, range);
            let d = p.variant("prop-f", &p.manifest_bytes, &f);
            never_lies(&d)
        })?;
    }

    /// Random safetensors headers never panic the header check.
    #[test]
    fn header_check_never_panics(
        n in prop_oneof![Just(4088u64), any::<u64>(), 0u64..5000],
        body in proptest::collection::vec(any::<u8>(), 0..512),
        json in "[\\[\\]{}\",:0-9a-zA-Z_\\-. ]{0,300}",
    ) {
        PRISTINE.with(|p| {
            let mut bytes = n.to_le_bytes().to_vec();
            bytes.extend_from_slice(json.as_bytes());
            bytes.extend_from_slice(&body);
            let d = p.variant("prop-h", &p.manifest_bytes, &bytes);
            let path = d.join(FILE);
            let f = std::fs::File::open(&path).unwrap();
            let _ = restore::check_header(&f, &path, &p.manifest.files[0]);
            let mut f2 = p.file_bytes.clone();
            let k = bytes.len().min(f2.len());
            f2[..k].copy_from_slice(&bytes[..k]);
            let d = p.variant("prop-h2", &p.manifest_bytes, &f2);
            never_lies(&d)
        })?;
    }
}
