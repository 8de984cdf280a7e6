# The course's commands. `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Extra pip options for the first install, e.g. PyTorch's CPU index on a laptop (see the README).
PIP_OPTIONS ?=

ASSIGNMENTS := ex01_collectives ex02_zero1_sharded_adam ex03_zero2_reduce_scatter_backward ex04_zero3_gather_linear \
	ex05_memory_planning
# nbgrader's own commands need the venv's bin on PATH (it runs alembic from there): nothing to activate.
NBGRADER := PATH="$(abspath $(VENV))/bin:$$PATH" $(abspath $(VENV))/bin/nbgrader
# JupyterLab refuses to run as root unless told it may (containers, CI).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
# Bounds for one notebook in the batch grader: a correct one takes seconds, a looping one costs these.
GRADE_LIMITS := --time-limit 120 --check-time-limit 30

.PHONY: demo test lint lab release autograde feedback grade bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed (found " + sys.version.split()[0] + "); set PYTHON=python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_OPTIONS) -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m zero_core compare --world-size 32 --steps 3

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --no-browser $(ALLOW_ROOT) --ServerApp.root_dir=$(CURDIR) \
		--ServerApp.default_url=/lab/tree/lessons

release: $(STAMP)
	for a in $(ASSIGNMENTS); do $(NBGRADER) generate_assignment $$a --force --create || exit 1; done

autograde: release
	for a in $(ASSIGNMENTS); do \
		if ls out/submitted/*/$$a/$$a.ipynb > /dev/null 2>&1; then $(NBGRADER) autograde $$a || exit 1; fi; \
	done

feedback: $(STAMP)
	for a in $(ASSIGNMENTS); do \
		if ls out/autograded/*/$$a > /dev/null 2>&1; then $(NBGRADER) generate_feedback $$a || exit 1; fi; \
	done

grade: $(STAMP)
	$(PY) -m autograder grade out/submitted --out out/grades.csv --feedback out/autograder-feedback $(GRADE_LIMITS)

bench: $(STAMP)
	$(PY) benchmarks/bench_collectives.py
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/bench_grading.py
	$(PY) benchmarks/crosscheck_pytorch.py
	$(PY) benchmarks/bench_memory_audit.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
