//! The device-memory experiment of `--mode compare`: what a save leaves mapped after
//! the trainer frees its tensors, and what the cleanup returns.

use std::time::Instant;

use serde_json::{Value, json};
use shmckpt::cuda::{Context, DeviceBuffer};
use shmckpt_bench::synthetic::LayoutEntry;

use super::variant::{Variant, free, tensors};

/// Save a fresh copy of the state with `v`, free it on the trainer's side, and measure
/// what comes back; for an IPC writer then release its handles and measure again.
pub(super) fn memory_experiment(
    ctx: &std::sync::Arc<Context>,
    layout: &[LayoutEntry],
    v: &mut Variant,
) -> Result<Value, Box<dyn std::error::Error>> {
    if let Some(c) = v.client() {
        c.release()?;
    }
    let f0 = free(ctx)?;
    let mut bufs = Vec::with_capacity(layout.len());
    for (k, e) in layout.iter().enumerate() {
        let mut b = DeviceBuffer::alloc(ctx, e.len() as usize)?;
        b.memset(k as u8 ^ 0x5A)?;
        bufs.push(b);
    }
    let allocated: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let f_alloc = free(ctx)?;
    let run = v.save(ctx, &tensors(layout, &bufs))?;
    let f_saved = free(ctx)?;
    let cached = match v.client() {
        Some(c) => c.stats()?.cached_bytes,
        None => 0,
    };
    // The trainer frees its tensors (as a colocated trainer does before generation).
    let t = Instant::now();
    drop(bufs);
    let free_s = t.elapsed();
    let f_freed = free(ctx)?;
    let returned = f_freed as i64 - f_saved as i64;
    let retained = f0 as i64 - f_freed as i64;
    let mut out = json!({
        "allocated_bytes": allocated,
        "gpu_free_start_bytes": f0,
        "gpu_taken_by_state_bytes": f0 as i64 - f_alloc as i64,
        "gpu_free_change_during_save_bytes": f_saved as i64 - f_alloc as i64,
        "stall_s": run.stall.as_secs_f64(),
        "trainer_free_s": free_s.as_secs_f64(),
        "returned_on_free_bytes": returned,
        "retained_bytes": retained,
        "writer_cached_bytes": cached,
    });
    let o = out.as_object_mut().expect("object");
    match v.client() {
        Some(c) => {
            // The cleanup that gives the memory back: the writer closes its handles.
            let rel = c.release()?;
            let f_rel = free(ctx)?;
            o.insert("release_s".into(), json!(rel.writer_took.as_secs_f64()));
            o.insert("release_round_trip_s".into(), json!(rel.took.as_secs_f64()));
            o.insert("release_closed".into(), json!(rel.closed));
            o.insert(
                "returned_on_release_bytes".into(),
                json!(f_rel as i64 - f_freed as i64),
            );
            o.insert(
                "retained_after_release_bytes".into(),
                json!(f0 as i64 - f_rel as i64),
            );
        }
        None => {
            // Nothing to clean up: the engine holds no reference to device memory.
            o.insert("release_s".into(), json!(0.0));
            o.insert("returned_on_release_bytes".into(), json!(0));
            o.insert("retained_after_release_bytes".into(), json!(retained));
        }
    }
    Ok(out)
}
