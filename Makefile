# One entry point for people and CI. `make demo` and `make test` work on a fresh machine:
# they create .venv, install the CPU build of torch first (so the `torch>=2.6` requirement
# is already met and never pulls CUDA wheels), then this project with its dev extra (which
# holds the `daemon` and `frameworks` extras). A current pip first: its resolver settles the
# dev set (torchtitan's fsspec cap beside s3fs) in one pass; the torch pin is repeated so
# that no backtracking can swap in another torch.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP_PIN := pip==26.2.1
TORCH_PIN := torch==2.13.0

.PHONY: setup demo test lint typecheck stubs stubs-check bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(PIP_PIN)
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e '.[dev]' $(TORCH_PIN)
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python examples/demo.py

# Every test's duration lands in $(REPORTS)/durations.txt (slowest first, from the JUnit XML
# beside it), written whether or not the run passed; pytest's exit status is make's.
# Two pytest-xdist workers, one test file each at a time (a file's module fixtures stay in
# one process): on the 2-core CI machine most tests wait on daemons, gloo ranks and moto,
# so two at once take about half the time; TEST_WORKERS=0 runs serially.
# PYTEST_ARGS goes to pytest as is (a subset of the tests, -x, ...).
REPORTS := .ci/reports
TEST_WORKERS ?= 2
PYTEST_ARGS ?=

test: setup
	mkdir -p $(REPORTS) && rm -f $(REPORTS)/junit.xml
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) \
		--junitxml=$(REPORTS)/junit.xml; status=$$?; \
	$(BIN)/python .ci/durations.py $(REPORTS)/junit.xml $(REPORTS)/durations.txt; \
	exit $$status

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

stubs: setup
	$(BIN)/python proto/gen_stubs.py

stubs-check: setup
	$(BIN)/python proto/gen_stubs.py --check

bench: setup
	$(BIN)/python bench/bench_memory_tier.py

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info server/*.egg-info .pytest_cache .mypy_cache .ruff_cache
