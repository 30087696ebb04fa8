#!/usr/bin/env bash
# Writes .devbundle/extra.tar.xz: wheels for the lent GPU machines' CPython 3.12 that ../shared/device/make-bundle.sh
# does not fetch (httptools, prometheus-client) or cannot (llguidance is manylinux_2_31 only, beyond its platform
# list). benchmarks/gpu_run.sh unpacks it next to the shared bundle. Run from the project root.
set -euo pipefail
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plat=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$work/wheels" "llguidance>=1.9.1,<2" "prometheus-client>=0.20" "httptools>=0.6"
python3 -m pip install -q --target "$work/site" --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" "$work"/wheels/*.whl
mkdir -p .devbundle
tar cJf .devbundle/extra.tar.xz -C "$work/site" .
ls -la .devbundle/extra.tar.xz
