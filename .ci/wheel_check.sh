#!/usr/bin/env bash
# What users install: build the wheel, install it (not editable) into a fresh venv, and use it from
# a folder outside the checkout: import every public name, inspect every family, prewarm a slice
# of the default manifest for sm_80 and sm_90a that touches every template piece.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m pip wheel -q --no-deps "$repo" -w "$work/dist"
python3 -m venv "$work/venv"
whl=$(ls "$work"/dist/attngen-*.whl)
"$work/venv/bin/python" -m pip install -q "$whl[cu13]"
cd "$work"
ATTNGEN_CACHE_DIR="$work/cache" PATH="$work/venv/bin:$PATH" "$work/venv/bin/python" "$repo/.ci/wheel_check.py" "$repo"
