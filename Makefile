PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-long demo bench-deps clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first, from the pinned CPU wheel; everything else after it
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# two workers for the two cores (tests/conftest.py gives each one intra-op thread)
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15 tests

# the property test's long profile (200 random models; CI runs its short profile in `make test`)
test-long: $(STAMP)
	TAILORFX_PROPERTY_EXAMPLES=200 $(BIN)/python -m pytest -q -n 2 --dist worksteal tests/test_property.py

demo: $(STAMP)
	$(BIN)/python -m tailorfx.cli demo

# the benchmarks' optional peers (the `alst` extra): DeepSpeed with none of its ops built, built
# against the venv's torch (no build isolation, so pip never fetches another torch)
bench-deps: $(STAMP)
	DS_BUILD_OPS=0 $(BIN)/pip install --no-build-isolation deepspeed==0.19.8

clean:
	rm -rf $(VENV) .pytest_cache
