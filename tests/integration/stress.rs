//! Stress: 200 back-to-back saves of changing data through a deliberately slow writer,
//! with the trainer's buffers overwritten in place as soon as each `save` returns and
//! staging chunks reused across saves in flight. Every committed checkpoint must hold
//! exactly the data of its own step: never a stale or mixed one.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use shmckpt::testing::io::OpKind;
use shmckpt::testing::io::fault::{Fault, FaultPlan, Rule};
use shmckpt::{Dtype, Engine, Metadata, Tensor};
use shmckpt_bench::synthetic::{self, LayoutEntry};

const SAVES: u64 = 200;
const CS: u64 = 64 << 10;

/// The trainer's tensors: the layout of [`small_layout`] plus, on odd steps, an extra
/// tensor whose size changes with the step (so file sizes and headers change too).
fn layout(step: u64) -> Vec<LayoutEntry> {
    let mut l = small_layout();
    if step % 2 == 1 {
        l.push(LayoutEntry {
            name: "extra".into(),
            dtype: Dtype::F16,
            shape: vec![1 + (step as usize * 7919) % 20_000],
        });
    }
    l
}

/// Overwrite `bufs` in place with step `step`'s data (resizing only the extra tensor).
fn fill_step(bufs: &mut Vec<Vec<u8>>, step: u64) {
    let l = layout(step);
    bufs.resize_with(l.len(), Vec::new);
    for (k, (e, b)) in l.iter().zip(bufs.iter_mut()).enumerate() {
        b.resize(e.len() as usize, 0);
        synthetic::fill(b, k as u64, 0xC0FFEE + step, 0);
    }
}

#[test]
fn back_to_back_saves_through_a_slow_writer_keep_every_step_exact() {
    for backend in BACKENDS {
        let dir = real_dir("stress");
        let root = dir.path();
        let plan = Arc::new(FaultPlan::new());
        plan.add(Rule {
            kind: OpKind::Write,
            offsets: 0..u64::MAX,
            fault: Fault::Delay(Duration::from_millis(1)),
            times: None,
        });
        // Staging for about two files: each save reuses chunks the previous ones just
        // released, while up to four saves are in flight.
        let engine = Engine::open(
            small_config(root, backend)
                .with_staging_capacity(9 * CS)
                .with_max_inflight_saves(4)
                .with_queue_depth(2)
                .with_faults(Arc::clone(&plan)),
        )
        .unwrap();
        let t = Instant::now();
        let mut bufs: Vec<Vec<u8>> = Vec::new();
        let mut handles = Vec::new();
        for step in 1..=SAVES {
            fill_step(&mut bufs, step);
            let l = layout(step);
            let tensors: Vec<Tensor<'_>> = l
                .iter()
                .zip(&bufs)
                .map(|(e, d)| Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), d))
                .collect();
            let meta: Metadata = [("step".to_owned(), step.to_string())].into();
            handles.push(engine.save(step, &tensors, &meta).unwrap());
            // `bufs` is overwritten with the next step's data right away.
        }
        for h in handles {
            let r = h.wait().unwrap();
            assert!(r.dir.is_some());
        }
        let saved = t.elapsed();
        assert!(plan.fired() as u64 >= 4 * SAVES);
        assert!(
            shmckpt::recover::inspect_arena(engine.shm_name())
                .details
                .unwrap()
                .slots
                .is_empty(),
            "every descriptor slot is free after the last commit"
        );

        assert_eq!(committed(root), (1..=SAVES).collect::<Vec<_>>());
        let mut expect: Vec<Vec<u8>> = Vec::new();
        for step in 1..=SAVES {
            let ck = engine.load(step).unwrap();
            fill_step(&mut expect, step);
            let l = layout(step);
            assert_eq!(ck.step, step);
            assert_eq!(ck.metadata["step"], step.to_string());
            assert_eq!(ck.tensors.len(), l.len(), "step {step}");
            for (e, d) in l.iter().zip(&expect) {
                let got = ck.get(&e.name).unwrap();
                assert_eq!(got.shape, e.shape, "step {step} {}", e.name);
                assert!(
                    got.data.as_bytes() == &d[..],
                    "step {step}: tensor {} holds other data than its step's",
                    e.name
                );
            }
            let file = root.join(format!("step-{step}/rank-00000-of-00001.safetensors"));
            let bytes = std::fs::read(&file).unwrap();
            let (_, h) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            assert_eq!(
                h.metadata().as_ref().unwrap()["shmckpt.step"],
                step.to_string()
            );
        }
        eprintln!(
            "{backend:?}: {SAVES} saves committed in {:.2} s, all exact",
            saved.as_secs_f64()
        );
    }
}
