# Everything a fresh machine needs: `make test` runs all checks, `make demo` the main job.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-slow lint typecheck pytest demo bench gpu-check mutants clean

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .[bench]
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/ruff format --check src tests benchmarks tools

typecheck: $(STAMP)
	$(BIN)/mypy src

pytest: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The type check runs beside the tests (2 cores: mypy takes one while the tests mostly take the other); each
# one's output is printed whole when it ends.
test: lint
	$(MAKE) --no-print-directory -j2 --output-sync=target typecheck pytest

# Mutation testing (not in CI: an hour or more): the curated mutants the default suite must kill, then
# mutmut over the core modules listed in pyproject.toml, and its score.
mutants: $(STAMP)
	$(BIN)/python tools/mutants.py
	$(BIN)/mutmut run --max-children $$(nproc)
	$(BIN)/python tools/mutation_score.py

demo: $(STAMP)
	$(BIN)/mixprec bench

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_autocast.py
	$(BIN)/python benchmarks/bench_scaler.py
	$(BIN)/python benchmarks/bench_monitor.py

# On a CUDA machine: the CUDA tests, the bench eager and compiled, the fp8 GEMM table and the kernel counts, the
# step-cost table and a 1.1B Llama at each level, in one report (mixprec-gpu-check/report.md and .json); each piece
# has a time limit, 19 minutes in all (ONLY=llama,fp8-gemm,step-cost runs some). Refused without CUDA.
gpu-check: $(STAMP)
	$(BIN)/python tools/gpu_check.py --out mixprec-gpu-check $(if $(ONLY),--only $(ONLY))

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache mutants mixprec-gpu-check
