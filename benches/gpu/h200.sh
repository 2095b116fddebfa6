#!/usr/bin/env bash
# The GPU run behind docs/benchmarks.md: GPU tests, then the SHM-vs-IPC comparisons at
# 8 GiB / 64 tensors and 16 GiB / 1,000 mixed tensors. Runs prebuilt binaries (the GPU
# machine has no Rust): BIN holds shmckpt and the test binaries `gpu`, `gpu_ipc`
# (`cargo test --release --no-run --test gpu --test gpu_ipc`, copied and stripped).
# Results go to OUT. Usage: benches/gpu/h200.sh BIN OUT DISKDIR [steps...]
# (pytests needs the shmckpt wheel importable, e.g. pip install --target and PYTHONPATH.)
set -uo pipefail
BIN=$(cd "$1" && pwd); OUT=$2; DISK=$3; shift 3
steps=${*:-"env tests c8 c16c c16u"}
mkdir -p "$OUT" "$DISK"
export SHMCKPT_EXE=$BIN/shmckpt SHMCKPT_TEST_DIR=$DISK/tests SHMCKPT_REQUIRE_GPU=1
log() { echo "== $(date +%T) $*" | tee -a "$OUT/bench.log"; }
bench() { # name, args...
  local name=$1; shift
  log "bench $name: $*"
  rm -rf "${DISK:?}/$name"
  "$BIN/shmckpt" bench --source cuda --dir "$DISK/$name" --json "$@" \
    > "$OUT/$name.json" 2>> "$OUT/bench.log"
  log "bench $name exit $?"
  rm -rf "${DISK:?}/$name"
}
for s in $steps; do
  case $s in
    env)
      { date -u; uname -r; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv;
        df -h "$DISK"; findmnt -T "$DISK" -no SOURCE,FSTYPE,OPTIONS; nproc; free -g; } > "$OUT/env.txt" 2>&1 ;;
    tests)
      log "gpu tests"
      "$BIN/gpu" --ignored --test-threads=1 --nocapture > "$OUT/tests.log" 2>&1; log "gpu exit $?"
      "$BIN/gpu_ipc" --ignored --test-threads=1 --nocapture >> "$OUT/tests.log" 2>&1; log "gpu_ipc exit $?"
      rm -rf "${DISK:?}/tests" ;;
    pytests)
      log "pytest -m gpu"
      python3 -m pytest -m gpu python/tests -q -p no:cacheprovider > "$OUT/pytests.log" 2>&1; log "pytest exit $?"
      rm -rf "${DISK:?}/tests" ;;
    # Restore: loads to the GPU from disk alternated with raw O_DIRECT reads, then from
    # the kept arena (flash restore); -vv logs where each file read spends its time.
    l8)   bench l8  -vv --size 8GiB  --tensors 64 --repeat "${L8_REPEAT:-7}" --no-reference --load --flash ;;
    l16)  bench l16 -vv --size 16GiB --tensors 1000 --dtype mixed --repeat 3 --no-reference --load --flash ;;
    c8)   bench c8   --mode compare --size 8GiB  --tensors 64 --repeat 3 ;;
    c16c) bench c16c --mode compare --ipc-cache on  --size 16GiB --tensors 1000 --dtype mixed --repeat 3 ;;
    c16u) bench c16u --mode compare --ipc-cache off --size 16GiB --tensors 1000 --dtype mixed --repeat 3 ;;
    *) log "unknown step $s" ;;
  esac
done
log done
