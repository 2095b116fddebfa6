#!/usr/bin/env bash
# Build the Python package's wheel: one manylinux abi3 wheel (CPython >= 3.9, x86_64 or
# aarch64 as the host), release build, checked with auditwheel; prints its path and size.
#
#   scripts/build_wheel.sh                        # maturin and auditwheel from PATH
#   SHMCKPT_VENV=/opt/venv scripts/build_wheel.sh # installs ziglang, auditwheel there
#
# Policy: manylinux_2_28 (glibc 2.28: RHEL 8, Debian 10, Ubuntu 18.10 and later). A
# toolchain newer than that links against newer glibc symbols, so the extension is
# linked with zig (`--zig`, pip package ziglang), which targets glibc 2.28 from any host.
# The wheel lands in target/wheels/; the last line printed is its path.
set -euo pipefail
cd "$(dirname "$0")/.."
policy="${SHMCKPT_MANYLINUX:-manylinux_2_28}"
if [ -n "${SHMCKPT_VENV:-}" ]; then
    export PATH="$SHMCKPT_VENV/bin:$PATH"
fi
py="$(command -v python3)"
for mod in ziglang auditwheel; do
    "$py" -c "import $mod" 2>/dev/null || "$py" -m pip install --quiet "$mod"
done
command -v maturin >/dev/null || "$py" -m pip install --quiet 'maturin>=1.9.4,<2'

out=target/wheels
rm -f "$out"/shmckpt-*.whl
echo "== maturin build --release --compatibility $policy --zig" >&2
maturin build --release --compatibility "$policy" --zig -m python/Cargo.toml -o "$out" >&2
wheel=$(ls "$out"/shmckpt-*.whl)
[ "$(echo "$wheel" | wc -l)" = 1 ] || { echo "expected one wheel in $out: $wheel" >&2; exit 1; }

echo "== auditwheel show" >&2
shown=$("$py" -m auditwheel show "$wheel")
echo "$shown" >&2
# auditwheel names the most compatible policy the wheel satisfies; it must be ours or
# older (a newer one means a symbol from a newer glibc slipped in).
glibc_of() { echo "$1" | sed -n 's/.*manylinux_\([0-9]*\)_\([0-9]*\).*/\1 \2/p' | head -1; }
read -r want_major want_minor <<<"$(glibc_of "$policy")"
read -r got_major got_minor <<<"$(glibc_of "$(echo "$shown" | grep -o 'manylinux_[0-9]*_[0-9]*_[a-z0-9_]*' | head -1)")"
if [ -z "${got_major:-}" ] || [ "$got_major" -gt "$want_major" ] ||
   { [ "$got_major" = "$want_major" ] && [ "$got_minor" -gt "$want_minor" ]; }; then
    echo "auditwheel: $wheel is not $policy compatible" >&2
    exit 1
fi
case "$wheel" in
    *-cp39-abi3-*"$policy"*) ;;
    *) echo "unexpected wheel name (want cp39-abi3 $policy): $wheel" >&2; exit 1 ;;
esac
size=$(stat -c %s "$wheel")
echo "== $(basename "$wheel"): $size bytes ($((size / 1024)) KiB)" >&2
echo "$wheel"
