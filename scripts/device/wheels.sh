#!/usr/bin/env bash
# Here, before a GPU check: download into .whl/ the CPython 3.12 wheels that the device machine's
# image lacks (scripts/device/requirements.txt), at the versions of this checkout's .venv (the
# ones CI tests). The device reaches no package registry; the run tool carries .whl/ there
# (`carry: [".whl"]`), and scripts/device/check.sh installs it (docs/benchmarks.md, "The GPU check").
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VENV:-.venv}
OUT=.whl
# The wheels the image already holds in a version that serves: left behind, since the carried
# tree has a 64 MiB limit (numpy alone is 16 MiB, and torch is built against the image's;
# its tokenizers 0.23.2 and safetensors 0.8.0 are what transformers 5.25 asks for).
IMAGE_HAS='^(numpy|setuptools|pip|wheel|hf[-_]xet|pygments|pyyaml|uvloop|psutil|filelock|fsspec|sympy|mpmath|networkx|tokenizers|safetensors|torch|triton|nvidia[-_].*)-'
LIMIT_BYTES=$((56 * 1024 * 1024))

test -x "$VENV/bin/python" || { echo "no $VENV: run 'make install' first" >&2; exit 1; }
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# Pin every package to what the venv runs (editable and local builds left out).
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9_.-]+==' \
  | grep -v -E '^(torch|nvidia-|triton)' | sed 's/+cpu$//' >"$constraints"

platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done

rm -rf "$OUT"
mkdir -p "$OUT"
"$VENV/bin/python" -m pip download --quiet --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -c "$constraints" -r scripts/device/requirements.txt -d "$OUT"
for wheel in "$OUT"/*.whl; do
  if basename "$wheel" | grep -q -i -E "$IMAGE_HAS"; then rm -f "$wheel"; fi
done

bytes=$(du -cb "$OUT"/*.whl | tail -n 1 | cut -f 1)
echo "$(ls "$OUT"/*.whl | wc -l) wheels, $((bytes / 1024 / 1024)) MiB in $OUT/"
if [ "$bytes" -gt "$LIMIT_BYTES" ]; then
  echo "over the $((LIMIT_BYTES / 1024 / 1024)) MiB this leaves beside the tree in the device's 64 MiB" >&2
  exit 1
fi
