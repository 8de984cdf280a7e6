# The course's commands. `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint lab grade bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed (found " + sys.version.split()[0] + "); set PYTHON=python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m zero_core compare --world-size 32 --steps 3

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q

lab: $(STAMP)
	$(VENV)/bin/jupyter lab lessons/

grade: $(STAMP)
	$(PY) -m autograder grade out/submitted --out out/grades.csv --feedback out/autograder-feedback

bench: $(STAMP)
	$(PY) benchmarks/bench_collectives.py
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/bench_grading.py
	$(PY) benchmarks/crosscheck_pytorch.py
	$(PY) benchmarks/bench_memory_audit.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
