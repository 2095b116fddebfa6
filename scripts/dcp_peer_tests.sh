#!/usr/bin/env bash
# PyTorch DCP's own storage tests, unchanged, with ShmckptWriter and ShmckptReader in place
# of FileSystemWriter and FileSystemReader (python/tests/third_party/dcp/README.md).
#
#   scripts/dcp_peer_tests.sh                  # the interpreter: $PYTHON, else python3
#   PYTHON=.venv/bin/python scripts/dcp_peer_tests.sh -k read_write
#
# The test files (python/tests/third_party/dcp/FILES) are fetched from GitHub at the commit
# of the installed torch (torch.version.git_version) into target/dcp-peer-tests/<commit>/
# (or $SHMCKPT_DCP_TESTS_CACHE/<commit>/, where they can be put by hand on a machine
# without network); the repository holds none of their code. When a file cannot be had,
# the run prints NOT RUN and exits 0, or fails with SHMCKPT_REQUIRE_DCP_PEER=1.
# Expected failures (reasons in docs/dcp.md) are xfail(strict=True).
#
# The subset: every test of FILES except the thread_count=2 copies (thread_count only
# sets ShmckptWriter's writer threads; they double the run, ~2 min on 2 cores); pass
# other pytest arguments to choose (e.g. -k '' for all).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
here=python/tests/third_party/dcp
rev=$("$py" -c "import torch; print(torch.version.git_version)")
if ! [[ "$rev" =~ ^[0-9a-f]{40}$ ]]; then
    echo "dcp_peer_tests: torch.version.git_version is not a commit ($rev)" >&2
    exit 2
fi
cache="${SHMCKPT_DCP_TESTS_CACHE:-target/dcp-peer-tests}/$rev"
mkdir -p "$cache"
files=()
while read -r f; do
    case "$f" in ''|'#'*) continue ;; esac
    dest="$cache/$(basename "$f")"
    if [ ! -s "$dest" ]; then
        echo "== fetching $f at $rev"
        if ! curl -fsSL --retry 2 "https://raw.githubusercontent.com/pytorch/pytorch/$rev/$f" -o "$dest.tmp"; then
            rm -f "$dest.tmp"
            echo "== NOT RUN: DCP's own tests ($f at $rev cannot be fetched; put it in $cache)"
            [ "${SHMCKPT_REQUIRE_DCP_PEER:-0}" = "1" ] && exit 1
            exit 0
        fi
        mv "$dest.tmp" "$dest"
    fi
    files+=("$dest")
done < "$here/FILES"
export SHMCKPT_DCP_SWAP=1
export PYTHONPATH="$PWD/$here/site:$PWD/$here${PYTHONPATH:+:$PYTHONPATH}"
# torch.testing._internal (the tests' helpers, shipped in the wheel) imports expecttest;
# DCP's ZStandard extension needs zstandard (without it its test fails before any writer).
"$py" -c "import expecttest" 2>/dev/null || "$py" -m pip install --quiet expecttest
"$py" -c "import zstandard" 2>/dev/null || "$py" -m pip install --quiet zstandard
if [ $# -eq 0 ]; then
    set -- -k "not thread_count_2"
fi
exec "$py" -m pytest "${files[@]}" -p dcp_peer_plugin -p no:logging -q -p no:cacheprovider --rootdir "$cache" -rxXs "$@"
