#!/usr/bin/env bash
# Lightning's and PyTorch DCP's own tests, with shmckpt's plugins swapped in, from upstream
# checkouts this script makes (it needs GitHub access; the repository holds none of their
# code). Without them the pytest suite (scripts/test.sh, CI) shows the two runner tests as
# skipped.
#
#   scripts/upstream_tests.sh                       # the venv of scripts/test.sh (.venv)
#   SHMCKPT_VENV=/opt/venv-torch scripts/upstream_tests.sh
#   PYTHON=/opt/venv/bin/python scripts/upstream_tests.sh -k lightning   # pytest arguments
#
# 1. Lightning-AI/pytorch-lightning at tag 2.6.5, tests/tests_pytorch only (a shallow,
#    sparse clone), into target/upstream/pytorch-lightning.
# 2. pytorch/pytorch's test/distributed/checkpoint/test_file_system_checkpoint_cpu.py at
#    the installed torch's torch.version.git_version (a shallow, sparse fetch of that
#    commit), into target/upstream/pytorch/<commit>.
# 3. The suites' test dependencies into the venv where missing: cloudpickle, jsonargparse,
#    tensorboard (Lightning's tests), expecttest (torch.testing._internal), zstandard
#    (DCP's ZStandard extension).
# 4. pytest python/tests/test_upstream_lightning.py python/tests/test_upstream_dcp.py with
#    SHMCKPT_LIGHTNING_TESTS and SHMCKPT_DCP_TESTS set to the checkouts and
#    SHMCKPT_REQUIRE_UPSTREAM_TESTS=1 (a missing checkout fails).
#
# A checkout that exists is reused (delete target/upstream to fetch again). The interpreter
# must import shmckpt (scripts/test.sh installs its wheel into the venv; a source tree with
# the compiled module works with PYTHONPATH=python). SHMCKPT_LIGHTNING_GIT and
# SHMCKPT_PYTORCH_GIT replace the GitHub URLs (a mirror).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py="${PYTHON:-${SHMCKPT_VENV:-$repo/.venv}/bin/python}"
if ! "$py" -c "import shmckpt, torch, lightning" 2>/dev/null; then
    echo "upstream_tests: $py cannot import shmckpt, torch and lightning (run scripts/test.sh first, or set PYTHON)" >&2
    exit 2
fi

lightning_git="${SHMCKPT_LIGHTNING_GIT:-https://github.com/Lightning-AI/pytorch-lightning.git}"
lightning_tag=2.6.5
lightning_commit=be98784a1a03581b7051a355ae1084fd352d7cea   # the tag's commit, as recorded
lightning="$repo/target/upstream/pytorch-lightning"
if [ ! -f "$lightning/tests/tests_pytorch/conftest.py" ]; then
    echo "== cloning $lightning_git at $lightning_tag (tests/tests_pytorch) into $lightning"
    rm -rf "$lightning"
    git clone -q --depth 1 --branch "$lightning_tag" --filter=blob:none --sparse "$lightning_git" "$lightning"
    git -C "$lightning" sparse-checkout set tests/tests_pytorch
fi
got=$(git -C "$lightning" rev-parse HEAD)
if [ "$got" != "$lightning_commit" ]; then
    echo "upstream_tests: $lightning is at $got, not $lightning_tag ($lightning_commit)" >&2
    exit 1
fi

pytorch_git="${SHMCKPT_PYTORCH_GIT:-https://github.com/pytorch/pytorch.git}"
dcp_file=test/distributed/checkpoint/test_file_system_checkpoint_cpu.py
rev=$("$py" -c "import torch; print(torch.version.git_version)")
if ! [[ "$rev" =~ ^[0-9a-f]{40}$ ]]; then
    echo "upstream_tests: torch.version.git_version is not a commit ($rev)" >&2
    exit 2
fi
pytorch="$repo/target/upstream/pytorch/$rev"
if [ ! -f "$pytorch/$dcp_file" ]; then
    echo "== fetching $dcp_file at $rev from $pytorch_git into $pytorch"
    rm -rf "$pytorch"
    mkdir -p "$pytorch"
    git -C "$pytorch" init -q
    git -C "$pytorch" config core.sparseCheckout true
    echo "/$dcp_file" > "$pytorch/.git/info/sparse-checkout"
    git -C "$pytorch" fetch -q --depth 1 --filter=blob:none "$pytorch_git" "$rev"
    git -C "$pytorch" checkout -q FETCH_HEAD
fi

missing=()
for mod in cloudpickle jsonargparse tensorboard expecttest zstandard; do
    "$py" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing ${missing[*]}"
    "$py" -m pip install --quiet "${missing[@]}"
fi

echo "== Lightning's and DCP's own tests with shmckpt swapped in"
export SHMCKPT_LIGHTNING_TESTS="$lightning" SHMCKPT_DCP_TESTS="$pytorch" SHMCKPT_REQUIRE_UPSTREAM_TESTS=1
exec "$py" -m pytest python/tests/test_upstream_lightning.py python/tests/test_upstream_dcp.py \
    -q -p no:cacheprovider -rs -s "$@"
