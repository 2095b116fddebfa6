#!/usr/bin/env bash
# Disk-to-GPU load sweep: `shmckpt bench --load` (8 GiB / 64 bf16 by default) for several
# (binary, --device-read, --device-read-depth) settings, one bench per setting, in the
# order given, each alternating its loads with the two raw O_DIRECT read patterns of the
# same file (so every load_ratio is against the disk of that moment). Stops before a run
# that would end past DEADLINE_S (default 540) seconds from the start.
# Usage: benches/gpu/load_sweep.sh OUT DISKDIR BIN:READ:DEPTH ...
#   e.g. benches/gpu/load_sweep.sh $OUT /var/tmp/sweep .gpu/shmckpt:16MiB:4 .gpu/shmckpt:4MiB:16
# Env: SWEEP_SIZE (8GiB), SWEEP_TENSORS (64), SWEEP_REPEAT (2), SWEEP_EST_S (45: the
# estimate of one run used by the deadline).
set -uo pipefail
OUT=$1; DISK=$2; shift 2
mkdir -p "$OUT" "$DISK"
start=$(date +%s); deadline=${DEADLINE_S:-540}; est=${SWEEP_EST_S:-45}
i=0
for spec in "$@"; do
  IFS=: read -r bin rd depth <<< "$spec"
  i=$((i + 1))
  now=$(date +%s)
  if (( now - start + est > deadline )); then
    echo "== $(date +%T) skip run $i ($spec): past the deadline" | tee -a "$OUT/sweep.log"; continue
  fi
  name=$(printf 'run%02d-%s-%s-%s' "$i" "$(basename "$bin")" "$rd" "$depth")
  echo "== $(date +%T) $name" | tee -a "$OUT/sweep.log"
  rm -rf "${DISK:?}/$name"
  "$bin" -vv bench --source cuda --dir "$DISK/$name" --json --size "${SWEEP_SIZE:-8GiB}" \
    --tensors "${SWEEP_TENSORS:-64}" --repeat "${SWEEP_REPEAT:-2}" --no-reference --load \
    --device-read "$rd" --device-read-depth "$depth" > "$OUT/$name.json" 2> "$OUT/$name.log"
  echo "== $(date +%T) $name exit $?" | tee -a "$OUT/sweep.log"
  rm -rf "${DISK:?}/$name"
done
