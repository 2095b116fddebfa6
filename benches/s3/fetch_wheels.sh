#!/usr/bin/env bash
# Download the peers of benches/s3/s3_bench.py (s3torchconnector, s3fs, boto3 and their
# dependencies) as wheels for a machine without network: CPython 3.12, Linux x86_64.
#
#   benches/s3/fetch_wheels.sh DIR          # here (network)
#   pip install --no-deps --target /tmp/peers DIR/*.whl && export PYTHONPATH=/tmp/peers:$PYTHONPATH   # there
#
# Versions are pinned together (aiobotocore pins botocore; s3fs pins fsspec), so that
# installing every wheel with --no-deps gives a consistent set. torch is not fetched (the
# machine has it). s3torchconnector is published as an sdist only (pure Python): its wheel
# is built here with `pip wheel` (its native part, s3torchconnectorclient, is a wheel;
# tenacity is its `dcp` extra).
set -euo pipefail
DIR=${1:?usage: fetch_wheels.sh DIR}
PY=${PYTHON:-python3}
PYVER=${PYVER:-3.12}
mkdir -p "$DIR"
"$PY" -m pip download --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --only-binary=:all: -d "$DIR" \
    "s3fs==2026.9.0" "aiobotocore==3.10.0" \
    "boto3>=1.43.115,<1.43.118" "botocore>=1.43.115,<1.43.118" \
    "s3torchconnectorclient==1.5.0" tenacity
sd=$(mktemp -d)
trap 'rm -rf "$sd"' EXIT
"$PY" -m pip download --no-deps --no-binary=:all: -d "$sd" "s3torchconnector==1.5.0"
"$PY" -m pip wheel --no-deps -w "$DIR" "$sd"/s3torchconnector-1.5.0.tar.gz
ls "$DIR"
