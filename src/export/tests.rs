//! Tests of the export: selection, sharding, header and index, DCP assembly, casts,
//! atomicity and CRC failures.

use std::path::{Path, PathBuf};

use super::*;
use crate::{Engine, EngineConfig, Metadata, Tensor};

fn f32_bytes(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| ((i as f32) * 0.37 + seed as f32 - 3.1).to_le_bytes())
        .collect()
}

/// Save `tensors` (name, dtype, shape, bytes) at step 1 of a fresh root with `meta`.
fn save(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)], meta: Metadata) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let engine = Engine::open(
        EngineConfig::new(&root)
            .with_create_root(true)
            .with_staging_capacity(8 << 20)
            .with_chunk_size(1 << 20),
    )
    .unwrap();
    let ts: Vec<Tensor<'_>> = tensors
        .iter()
        .map(|(n, d, s, b)| Tensor::host(*n, *d, s.clone(), b))
        .collect();
    engine.save(1, &ts, &meta).unwrap().wait().unwrap();
    drop(engine);
    dir
}

/// Each exported tensor: dtype, shape, bytes.
type Exported = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

fn read_out(out: &Path) -> (serde_json::Value, Exported) {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join(INDEX_NAME)).unwrap()).unwrap();
    let mut all = BTreeMap::new();
    let files: std::collections::BTreeSet<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    for f in files {
        let bytes = std::fs::read(out.join(&f)).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            meta.metadata()
                .as_ref()
                .unwrap()
                .get("format")
                .map(String::as_str),
            Some("pt")
        );
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, v) in st.tensors() {
            assert_eq!(index["weight_map"][&name], f.as_str());
            all.insert(
                name,
                (
                    format!("{:?}", v.dtype()),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                ),
            );
        }
    }
    (index, all)
}

fn model_state() -> Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)> {
    vec![
        (
            "model.embed.weight",
            Dtype::F32,
            vec![40, 30],
            f32_bytes(1200, 1),
        ),
        (
            "model.layers.0.bias",
            Dtype::F32,
            vec![30],
            f32_bytes(30, 2),
        ),
        (
            "model.count",
            Dtype::I64,
            vec![2],
            [7i64, -9].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            "optim.state.0.exp_avg",
            Dtype::F32,
            vec![30],
            f32_bytes(30, 3),
        ),
    ]
}

/// The default rule keeps `model.*` without the prefix, leaves the optimizer out, and
/// every exported byte equals the saved one; a small shard size gives several shards
/// planned as Hugging Face does, with an index that names each tensor's shard.
#[test]
fn exports_the_model_part_in_shards_with_an_index() {
    let state = model_state();
    let dir = save(&state, Metadata::new());
    let out = dir.path().join("hf");
    let opts = ExportOptions {
        max_shard_size: 4900,
        ..ExportOptions::default()
    };
    let rep = export(&dir.path().join("root"), &out, &opts).unwrap();
    assert_eq!(rep.step, 1);
    assert_eq!(rep.tensors, 3);
    assert_eq!(rep.bytes, 4800 + 120 + 16);
    // File order (the engine puts 8-byte elements first): the count and the embedding
    // fill shard 1 (4816 bytes), the bias would overflow it.
    assert_eq!(
        rep.files,
        vec![shard_name(0, 2), shard_name(1, 2), INDEX_NAME.to_owned()]
    );
    let (index, all) = read_out(&out);
    assert_eq!(index["metadata"]["total_size"], 4936);
    assert_eq!(index["weight_map"]["embed.weight"], shard_name(0, 2));
    assert_eq!(index["weight_map"]["count"], shard_name(0, 2));
    assert_eq!(index["weight_map"]["layers.0.bias"], shard_name(1, 2));
    assert_eq!(all.len(), 3);
    assert_eq!(
        all["embed.weight"],
        ("F32".into(), vec![40, 30], state[0].3.clone())
    );
    assert_eq!(
        all["layers.0.bias"],
        ("F32".into(), vec![30], state[1].3.clone())
    );
    assert_eq!(all["count"], ("I64".into(), vec![2], state[2].3.clone()));
    // Nothing else is left beside it.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");

    // With the optimizer, full names; renaming rules apply in order.
    let out2 = dir.path().join("hf2");
    let opts = ExportOptions {
        include_optimizer: true,
        rename: vec![
            Rename::StripPrefix("model.".into()),
            Rename::Prefix {
                from: "optim.".into(),
                to: "o.".into(),
            },
        ],
        ..ExportOptions::default()
    };
    export(&dir.path().join("root/step-1"), &out2, &opts).unwrap();
    let (_, all) = read_out(&out2);
    let names: Vec<&str> = all.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "count",
            "embed.weight",
            "layers.0.bias",
            "o.state.0.exp_avg"
        ]
    );
}

/// The shard plan: greedy in order, a tensor larger than the limit alone.
#[test]
fn shards_are_planned_like_hugging_face() {
    assert_eq!(plan_shards(&[3, 3, 3, 10, 1], 6), vec![0, 0, 1, 2, 3]);
    assert_eq!(plan_shards(&[10], 6), vec![0]);
    assert_eq!(plan_shards(&[6, 0, 1], 6), vec![0, 0, 1]);
    assert_eq!(shard_name(0, 3), "model-00001-of-00003.safetensors");
}

#[test]
fn sizes_parse_like_hugging_face() {
    assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
    assert_eq!(parse_size("500MB").unwrap(), 500_000_000);
    assert_eq!(parse_size("5GiB").unwrap(), 5 << 30);
    assert_eq!(parse_size("10kb").unwrap(), 10_000);
    assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
    assert_eq!(parse_size("4096").unwrap(), 4096);
    for bad in ["", "0", "5XB", "GB", "-1GB", "99999999999999999999GB"] {
        assert!(matches!(parse_size(bad), Err(Error::Config(_))), "{bad}");
    }
}

/// A DCP-style rank file (pieces with their offsets in `DCP_SHARDING_INFO`, a second piece
/// of a tensor named `fqn@offsets`): column pieces are re-joined at their places, row
/// pieces too, and F32 is cast to BF16 exactly as torch rounds.
#[test]
fn dcp_pieces_are_assembled_and_cast() {
    // w: 4 x 6 F32, saved as two column blocks [4 x 2] at col 0 and [4 x 4] at col 2.
    let full: Vec<f32> = (0..24).map(|i| i as f32 * 1.001 + 0.5).collect();
    let block = |c0: usize, cs: usize| -> Vec<u8> {
        (0..4)
            .flat_map(|r| (c0..c0 + cs).map(move |c| (r, c)))
            .flat_map(|(r, c)| full[r * 6 + c].to_le_bytes())
            .collect()
    };
    // v: 5 rows of 3 I32, split 2 + 3 rows.
    let v: Vec<u8> = (0..15i32)
        .flat_map(|x| (x * 1000 - 7).to_le_bytes())
        .collect();
    let state = vec![
        ("model.w", Dtype::F32, vec![4, 2], block(0, 2)),
        ("model.w@0,2", Dtype::F32, vec![4, 4], block(2, 4)),
        ("model.v@2,0", Dtype::I32, vec![3, 3], v[24..].to_vec()),
        ("model.v", Dtype::I32, vec![2, 3], v[..24].to_vec()),
    ];
    let sharding = r#"{"model.w":{"saved_offsets":[0,0]},"model.w@0,2":{"saved_offsets":[0,2]},"model.v@2,0":{"saved_offsets":[2,0]},"model.v":{"saved_offsets":[0,0]}}"#;
    let meta: Metadata = [(DCP_SHARDING_KEY.to_owned(), sharding.to_owned())].into();
    let dir = save(&state, meta);
    let out = dir.path().join("hf");
    let opts = ExportOptions {
        dtype: Some(Dtype::BF16),
        ..ExportOptions::default()
    };
    export(&dir.path().join("root"), &out, &opts).unwrap();
    let (_, all) = read_out(&out);
    let want_w: Vec<u8> = full
        .iter()
        .flat_map(|&f| cast::f32_to_bf16(f).to_le_bytes())
        .collect();
    assert_eq!(all["w"], ("BF16".into(), vec![4, 6], want_w));
    assert_eq!(all["v"], ("I32".into(), vec![5, 3], v));

    // Pieces that do not tile their tensor are refused, and nothing is written.
    let sharding = r#"{"model.w":{"saved_offsets":[0,1]},"model.w@0,2":{"saved_offsets":[0,2]},"model.v@2,0":{"saved_offsets":[2,0]},"model.v":{"saved_offsets":[0,0]}}"#;
    let meta: Metadata = [(DCP_SHARDING_KEY.to_owned(), sharding.to_owned())].into();
    let bad = save(&state, meta);
    let out = bad.path().join("hf");
    match export(&bad.path().join("root"), &out, &ExportOptions::default()) {
        Err(Error::Corrupt { tensor, reason, .. }) => {
            assert_eq!(tensor.as_deref(), Some("model.w"));
            assert!(
                reason.contains("do not tile") && reason.contains("overlapping"),
                "{reason}"
            );
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(!out.exists());
}

/// Tensors larger than the writer's pool (40 MiB: ten 4 MiB reads for eight buffers, more
/// than one write-back span), with left-out optimizer state between them, over two
/// shards: every exported byte is the saved one, and cast to BF16 every element is
/// torch's rounding; each shard file is exactly its header and its tensors.
#[test]
fn tensors_larger_than_the_writer_pool_stream_exactly() {
    let big_n = 10_000_000;
    let big = f32_bytes(big_n, 5);
    let state = [
        ("model.big", Dtype::F32, vec![big_n / 1000, 1000], big),
        (
            "optim.state.0.m",
            Dtype::F32,
            vec![300_000],
            f32_bytes(300_000, 6),
        ),
        ("model.small", Dtype::F32, vec![3, 1001], f32_bytes(3003, 7)),
    ];
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let engine = Engine::open(
        EngineConfig::new(&root)
            .with_create_root(true)
            .with_staging_capacity(64 << 20)
            .with_chunk_size(1 << 20),
    )
    .unwrap();
    let ts: Vec<Tensor<'_>> = state
        .iter()
        .map(|(n, d, s, b)| Tensor::host(*n, *d, s.clone(), b))
        .collect();
    engine
        .save(1, &ts, &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    drop(engine);
    let shard_files = |out: &Path| {
        (0..2)
            .map(|k| {
                let bytes = std::fs::read(out.join(shard_name(k, 2))).unwrap();
                let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
                let data: usize = meta
                    .tensors()
                    .values()
                    .map(|t| t.data_offsets.1)
                    .max()
                    .unwrap();
                assert_eq!(
                    bytes.len(),
                    8 + n + data,
                    "shard {k} is its header and data"
                );
                assert_eq!((8 + n) % 4096, 0);
            })
            .count()
    };
    for dtype in [None, Some(Dtype::BF16)] {
        let out = dir.path().join(format!("hf-{dtype:?}"));
        let opts = ExportOptions {
            max_shard_size: (big_n * 2) as u64,
            dtype,
            ..ExportOptions::default()
        };
        let rep = export(&root, &out, &opts).unwrap();
        let (_, all) = read_out(&out);
        assert_eq!(shard_files(&out), 2);
        let keep = |(_, _, s, b): &(&str, Dtype, Vec<usize>, Vec<u8>)| match dtype {
            None => ("F32".to_owned(), s.clone(), b.clone()),
            Some(_) => (
                "BF16".to_owned(),
                s.clone(),
                b.chunks_exact(4)
                    .flat_map(|c| {
                        cast::f32_to_bf16(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                    })
                    .collect(),
            ),
        };
        assert_eq!(all.len(), 2);
        assert!(all["big"] == keep(&state[0]), "big, {dtype:?}");
        assert!(all["small"] == keep(&state[2]), "small, {dtype:?}");
        // Only the model's bytes were read (the optimizer state between is left out).
        assert!(
            rep.bytes_read < (big_n as u64 + 3003) * 4 + (64 << 10),
            "{}",
            rep.bytes_read
        );
    }
}

fn flip_byte_of(step: &Path, tensor: &str) -> PathBuf {
    let (_, entry) = crate::restore::rank_file(step, 0).unwrap();
    let t = entry.tensors.iter().find(|t| t.name == tensor).unwrap();
    let path = step.join(&entry.file);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = (entry.data_start + t.data_offsets[0] + 5) as usize;
    bytes[at] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A flipped byte in an exported tensor is a checksum error naming it, and nothing is
/// visible at `out` (no temporary directory left either); a flipped byte of a tensor the
/// export leaves out (optimizer state) is never read.
#[test]
fn a_damaged_tensor_fails_the_export_and_leaves_nothing() {
    let dir = save(&model_state(), Metadata::new());
    let step = dir.path().join("root/step-1");
    flip_byte_of(&step, "optim.state.0.exp_avg");
    export(&step, &dir.path().join("ok"), &ExportOptions::default()).unwrap();

    flip_byte_of(&step, "model.embed.weight");
    let out = dir.path().join("hf");
    match export(&step, &out, &ExportOptions::default()) {
        Err(Error::Checksum { tensor, .. }) => assert_eq!(tensor, "model.embed.weight"),
        other => panic!("expected Checksum, got {other:?}"),
    }
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(!out.exists());
}

/// An existing non-empty destination is refused unless `overwrite`, which replaces it
/// whole; an empty one is used; a destination holding a checkpoint is never replaced.
#[test]
fn the_destination_is_replaced_only_on_request() {
    let dir = save(&model_state(), Metadata::new());
    let root = dir.path().join("root");
    let out = dir.path().join("hf");
    std::fs::create_dir(&out).unwrap();
    export(&root, &out, &ExportOptions::default()).unwrap();
    std::fs::write(out.join("stale.txt"), b"x").unwrap();
    match export(&root, &out, &ExportOptions::default()) {
        Err(Error::UnsafePath { path, .. }) => assert_eq!(path, out),
        other => panic!("expected UnsafePath, got {other:?}"),
    }
    assert!(out.join("stale.txt").exists());
    let opts = ExportOptions {
        overwrite: true,
        max_shard_size: 1000,
        ..ExportOptions::default()
    };
    export(&root, &out, &opts).unwrap();
    assert!(!out.join("stale.txt").exists());
    assert!(out.join(shard_name(0, 3)).exists());
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    // The checkpoint itself as the destination: refused even with overwrite.
    match export(&root, &root, &opts) {
        Err(Error::UnsafePath { .. }) => {}
        other => panic!("expected UnsafePath, got {other:?}"),
    }
    match export(&root, &root.join("step-1"), &opts) {
        Err(Error::UnsafePath { .. }) => {}
        other => panic!("expected UnsafePath, got {other:?}"),
    }
    assert!(root.join("step-1").join(MANIFEST).exists());
}

/// Replicas of a tensor on several ranks must agree; `default_names` lists what the
/// export takes, before renaming.
#[test]
fn default_names_list_the_selection() {
    let dir = save(&model_state(), Metadata::new());
    let names = default_names(&dir.path().join("root"), false).unwrap();
    let got: Vec<(&str, Dtype, Vec<u64>)> = names
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("count", Dtype::I64, vec![2]),
            ("embed.weight", Dtype::F32, vec![40, 30]),
            ("layers.0.bias", Dtype::F32, vec![30]),
        ]
    );
    // Explicit names: only those, under the names given.
    let out = dir.path().join("hf");
    let opts = ExportOptions {
        names: Some(vec![("count".into(), "n".into())]),
        ..ExportOptions::default()
    };
    export(&dir.path().join("root"), &out, &opts).unwrap();
    let (_, all) = read_out(&out);
    assert_eq!(all.keys().collect::<Vec<_>>(), ["n"]);
    let opts = ExportOptions {
        names: Some(vec![("optim.state.0.exp_avg".into(), "x".into())]),
        ..ExportOptions::default()
    };
    assert!(matches!(
        export(&dir.path().join("root"), &dir.path().join("hf3"), &opts),
        Err(Error::Destination { .. })
    ));
}

#[test]
fn dtypes_parse_by_torch_and_safetensors_names() {
    assert_eq!(parse_dtype("bf16").unwrap(), Dtype::BF16);
    assert_eq!(parse_dtype("bfloat16").unwrap(), Dtype::BF16);
    assert_eq!(parse_dtype("FP16").unwrap(), Dtype::F16);
    assert_eq!(parse_dtype("float32").unwrap(), Dtype::F32);
    assert_eq!(parse_dtype("F32").unwrap(), Dtype::F32);
    assert!(matches!(parse_dtype("fp8"), Err(Error::Config(_))));
}

/// A sub-byte dtype (two F4 per byte) is exported byte for byte.
#[test]
fn sub_byte_tensors_are_copied_whole() {
    let state = vec![
        (
            "model.q",
            Dtype::F4,
            vec![10],
            vec![0x12, 0x34, 0x56, 0x78, 0x9a],
        ),
        ("model.w", Dtype::F32, vec![3], f32_bytes(3, 9)),
    ];
    let dir = save(&state, Metadata::new());
    let out = dir.path().join("hf");
    let opts = ExportOptions {
        dtype: Some(Dtype::BF16),
        ..ExportOptions::default()
    };
    export(&dir.path().join("root"), &out, &opts).unwrap();
    let (_, all) = read_out(&out);
    assert_eq!(all["q"], ("F4".into(), vec![10], state[0].3.clone()));
    assert_eq!(all["w"].0, "BF16");
}

/// Two ranks of a plain checkpoint (DDP): a tensor both hold is exported once when the
/// replicas agree, and refused, naming it, when they differ (a shard saved without its
/// offsets must not be exported as if it were the whole tensor).
#[test]
fn replicas_must_agree() {
    let run = |second: Vec<u8>| {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let first = f32_bytes(6, 1);
        let engines: Vec<Engine> = (0..2)
            .map(|r| {
                Engine::open(
                    EngineConfig::new(&root)
                        .with_create_root(true)
                        .with_rank(r, 2)
                        .with_staging_capacity(4 << 20)
                        .with_chunk_size(1 << 20),
                )
                .unwrap()
            })
            .collect();
        let handles: Vec<_> = engines
            .iter()
            .zip([&first, &second])
            .map(|(e, b)| {
                let t = [Tensor::host("model.w", Dtype::F32, vec![6], b)];
                e.save(1, &t, &Metadata::new()).unwrap()
            })
            .collect();
        for h in handles {
            h.wait().unwrap();
        }
        drop(engines);
        let out = dir.path().join("hf");
        let r = export(&root, &out, &ExportOptions::default());
        (dir, out, r, first)
    };
    let (_d, out, r, first) = run(f32_bytes(6, 1));
    assert_eq!(r.unwrap().tensors, 1);
    let (_, all) = read_out(&out);
    assert_eq!(all["w"].2, first);
    let (d, out, r, _) = run(f32_bytes(6, 2));
    match r {
        Err(Error::Corrupt { tensor, reason, .. }) => {
            assert_eq!(tensor.as_deref(), Some("model.w"));
            assert!(reason.contains("differs from rank 0"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(!out.exists());
    drop(d);
}

/// Every file of `a` and `b`, by name, byte for byte.
fn assert_same_dirs(a: &Path, b: &Path) {
    let files = |d: &Path| -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().into_string().unwrap(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect()
    };
    let (fa, fb) = (files(a), files(b));
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (name, bytes) in &fa {
        assert!(bytes == &fb[name], "{name} differs");
    }
}

/// Removes a kept arena when the test ends, passed or not.
struct KeptGuard(String);

impl Drop for KeptGuard {
    fn drop(&mut self) {
        let _ = crate::engine::remove_kept_forced(&self.0);
    }
}

/// `memory:ROOT` exports the image flash restore keeps in `/dev/shm` while its engine
/// still runs, byte for byte what the export from the disk gives; a flipped byte in the
/// arena is a checksum error with nothing visible at `out`; a root whose engine keeps
/// nothing in memory is `NotFound`.
#[test]
fn exports_from_the_kept_arena_while_the_engine_runs() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let engine = Engine::open(
        EngineConfig::new(&root)
            .with_create_root(true)
            .with_staging_capacity(8 << 20)
            .with_chunk_size(64 << 10)
            .with_keep_in_memory(true),
    )
    .unwrap();
    let canon = std::fs::canonicalize(&root).unwrap();
    let _guard = KeptGuard(crate::staging::kept_name(&canon, 0));
    let mut state = model_state();
    // Over several arena chunks.
    state.push((
        "model.big",
        Dtype::F32,
        vec![250, 400],
        f32_bytes(100_000, 5),
    ));
    let ts: Vec<Tensor<'_>> = state
        .iter()
        .map(|(n, d, s, b)| Tensor::host(*n, *d, s.clone(), b))
        .collect();
    for step in [1, 2] {
        engine
            .save(step, &ts, &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
    }
    let opts = ExportOptions {
        max_shard_size: 100_000,
        include_optimizer: true,
        ..ExportOptions::default()
    };
    let mem = PathBuf::from(format!("{MEMORY_PREFIX}{}", root.display()));
    let (out_m, out_d) = (dir.path().join("from-mem"), dir.path().join("from-disk"));
    let rm = export(&mem, &out_m, &opts).unwrap();
    let rd = export(&root, &out_d, &opts).unwrap();
    assert_eq!((rm.step, rd.step), (2, 2));
    assert_eq!(
        rm.source,
        PathBuf::from(format!("{MEMORY_PREFIX}{}", root.join("step-2").display()))
    );
    assert!(rm.files.len() > 2, "{:?}", rm.files);
    assert_eq!(
        (rm.files.clone(), rm.tensors, rm.bytes),
        (rd.files.clone(), rd.tensors, rd.bytes)
    );
    assert_eq!(rm.bytes_read, rm.bytes);
    assert_same_dirs(&out_m, &out_d);
    // The step's directory on disk is never a destination, not even a new directory
    // inside it, as for a disk export.
    let inside = root.join("step-2").join("hf");
    for src in [&mem, &root.join("step-2")] {
        match export(src, &inside, &opts) {
            Err(Error::UnsafePath { .. }) => {}
            other => panic!("expected UnsafePath, got {other:?}"),
        }
        assert!(!inside.exists());
    }

    // A flipped byte of a tensor in the arena: a checksum error naming it.
    let (_, entry) = crate::restore::rank_file(&root.join("step-2"), 0).unwrap();
    let t = entry
        .tensors
        .iter()
        .find(|t| t.name == "model.embed.weight")
        .unwrap();
    let name = crate::staging::kept_name(&canon, 0);
    let att = crate::staging::AttachedArena::open(&name).unwrap();
    let slot = (0..att.slot_count())
        .map(|s| att.slot(s))
        .find(|v| v.state == crate::staging::descriptor::slot_state::KEPT)
        .unwrap();
    let geo = att.header().geometry;
    let off = entry.data_start + t.data_offsets[0] + 7;
    let (_, index) = slot.chunks[(off / geo.chunk_size) as usize];
    let at = geo.data_offset + u64::from(index) * geo.chunk_size + off % geo.chunk_size;
    let shm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(Path::new("/dev/shm").join(&name))
        .unwrap();
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&shm, &mut b, at).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&shm, &[b[0] ^ 0x10], at).unwrap();
    let out = dir.path().join("damaged");
    match export(&mem, &out, &opts) {
        Err(Error::Checksum { tensor, path, .. }) => {
            assert_eq!(tensor, "model.embed.weight");
            assert_eq!(path, Path::new("/dev/shm").join(&name));
        }
        other => panic!("expected Checksum, got {other:?}"),
    }
    assert!(!out.exists());
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 3, "{left:?}");
    drop(engine);

    // A root whose engine keeps nothing in memory.
    let plain = save(&model_state(), Metadata::new());
    let src = PathBuf::from(format!(
        "{MEMORY_PREFIX}{}",
        plain.path().join("root").display()
    ));
    match export(&src, &plain.path().join("hf"), &opts) {
        Err(Error::NotFound { step, .. }) => assert_eq!(step, Some(1)),
        other => panic!("expected NotFound, got {other:?}"),
    }
}
