# The course's commands. `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Extra pip options for the first install, e.g. PyTorch's CPU index on a laptop (see the README).
PIP_OPTIONS ?=

ASSIGNMENTS := ex01_collectives ex02_zero1_sharded_adam ex03_zero2_reduce_scatter_backward ex04_zero3_gather_linear \
	ex05_memory_planning ex06_bucketed_overlap ex07_zero3_prefetch ex08_clip_and_accumulate ex09_hierarchical_allgather \
	ex10_sharded_checkpoints
# nbgrader's own commands need the venv's bin on PATH (it runs alembic from there): nothing to activate.
# The grading parents run as `python -I`: nothing from PYTHONPATH or a user site reaches them.
NBGRADER := PATH="$(abspath $(VENV))/bin:$$PATH" $(abspath $(VENV))/bin/python -I -m nbgrader
# JupyterLab refuses to run as root unless told it may (containers, CI).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
# Bounds for one notebook, in `make autograde` (nbgrader's TrustedGrade) and `make grade` alike: a correct one takes
# seconds, a looping one costs these: TIME_LIMIT wall-clock seconds for its child, CHECK_TIME_LIMIT CPU seconds for one
# check (however loaded the machine). `make grade CHECK_TIME_LIMIT=10` (or the variable in the environment) sets one.
TIME_LIMIT ?= 120
CHECK_TIME_LIMIT ?= 30
GRADE_LIMITS := --time-limit $(TIME_LIMIT) --check-time-limit $(CHECK_TIME_LIMIT)
# Notebooks the batch grader grades at once (`make grade JOBS=2`); empty: its default, one per core. The wall time
# changes, not the grades: every notebook still has its own child and the bounds above.
JOBS ?=

comma := ,
space := $(subst ,, )

# The oldest and the newest torch the package accepts (pyproject.toml), and what must work on both: the real
# backend. Each gets a venv of its own (`make test-oldest-torch`, `make test-newest-torch`).
OLDEST_TORCH := 2.6.0
NEWEST_TORCH := 2.15.0
TORCH_EDGE_TESTS := tests/test_torch_backend.py tests/test_launch.py tests/test_dist.py

.PHONY: FORCE demo bytecode test test-oldest-torch test-newest-torch lint lab release student-release autograde scores feedback grade bench clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed (found " + sys.version.split()[0] + "); set PYTHON=python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_OPTIONS) -c constraints.txt -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m zero_core compare --world-size 32 --steps 3

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The course's modules compiled to bytecode before anything grades: a walled grading child sees the course read-only
# and cannot write its bytecode, and where PYTHONDONTWRITEBYTECODE is set the tests' own processes do not write it
# either, so each of them would compile every course module it imports again. `make test` lets its processes write
# bytecode whatever PYTHONDONTWRITEBYTECODE says (pytest's rewritten test modules included: each test worker would
# otherwise rewrite every test module again).
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 zero_core autograder

# The tests run in TEST_WORKERS parallel processes (pytest-xdist; tests/work_units.py says which tests share one):
# one per core and one more, at most 4 and at most one per 4 GiB of memory (a worker running the grading tests holds
# up to about 3 GB). The one more keeps the cores busy while a test waits on a timeout or on its grading child: on the
# 2-core test machine the cores were idle 9% of a run with 2 workers, 1.4% with 3. `make test TEST_WORKERS=1`
# runs them one after another. In CI (CI=true) the same command also runs the real backend's tests on the oldest
# and the newest supported torch.
TEST_WORKERS ?= $(shell n=$$(nproc 2> /dev/null || echo 1); m=$$(awk '/^MemTotal:/ {print int($$2 / 4194304)}' \
	/proc/meminfo 2> /dev/null); w=$$(( n + 1 < 4 ? n + 1 : 4 )); w=$$(( w < $${m:-4} ? w : $${m:-4} )); \
	echo $$(( w > 1 ? w : 1 )))
test: lint bytecode
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15
	$(if $(filter true,$(CI)),$(MAKE) --no-print-directory test-oldest-torch test-newest-torch)

# A venv with torch $(2) and what the backend's tests need: `make test-$(1)-torch`. PyPI's torch for Linux is
# the CUDA build: about 5 GB installed, once per venv. PIP_CONSTRAINT replaces any machine-wide constraint file
# of pip's (one that caps torch below $(2) would make the install impossible); the course's own pins still apply.
define TORCH_EDGE
.venv-$(1)-torch/.installed: pyproject.toml constraints.txt
	test -x .venv-$(1)-torch/bin/python || $$(PYTHON) -m venv .venv-$(1)-torch
	grep -v '^torch==' constraints.txt > .venv-$(1)-torch/constraints.txt
	PIP_CONSTRAINT=.venv-$(1)-torch/constraints.txt .venv-$(1)-torch/bin/python -m pip install --quiet \
		--disable-pip-version-check torch==$(2) numpy tqdm psutil pytest pytest-timeout
	.venv-$(1)-torch/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	sync  # 5 GB just written: let the disk settle before the timed multi-process tests start
	.venv-$(1)-torch/bin/python -c 'import torch, torch.distributed.run, zero_core.launch'
	# One untimed two-process launch first: the first launches from a fresh venv of torch 2.6 were twice seen
	# to outlast the tests' 110 s limit, while warm ones take 4-5 s.
	timeout 300 .venv-$(1)-torch/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \
		-m zero_core.launch --preset micro --stages 0,3 --steps 1 --no-progress --check-virtual > /dev/null \
		|| echo "the warm-up launch did not finish within 300 s; the tests below say more"
	touch $$@

test-$(1)-torch: .venv-$(1)-torch/.installed
	.venv-$(1)-torch/bin/python -c 'import torch; print("the real backend on the $(1) supported torch,", torch.__version__)'
	.venv-$(1)-torch/bin/python -m pytest -q -p no:cacheprovider $$(TORCH_EDGE_TESTS)
endef
$(eval $(call TORCH_EDGE,oldest,$(OLDEST_TORCH)))
$(eval $(call TORCH_EDGE,newest,$(NEWEST_TORCH)))

# A learner's own copies first, in work/ (git-ignored; autograder/workspace.py): running a lesson or answering an
# exercise never changes a tracked notebook. The venv's bin first on PATH: the lab's terminals then run the course's
# Python (`python -m autograder check`). LabApp's default URL is the one the server prints: it opens work/lessons/.
lab: $(STAMP)
	$(PY) -m autograder workspace work
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/jupyter lab --no-browser $(ALLOW_ROOT) --ServerApp.root_dir=$(CURDIR) \
		--LabApp.default_url=/lab/tree/work/lessons

# Every assignment in one nbgrader process, which matches them by ASSIGNMENT_GLOB (nbgrader's start is then paid once:
# here 2.3 s instead of 12.6-13.9 s one by one, 2026-12-07); with ASSIGNMENTS set on the command line, those one by one.
ASSIGNMENT_GLOB := ex[0-9][0-9]_*
release: $(STAMP)
ifeq ($(origin ASSIGNMENTS),file)
	$(NBGRADER) generate_assignment "$(ASSIGNMENT_GLOB)" --force --create
else
	for a in $(ASSIGNMENTS); do $(NBGRADER) generate_assignment $$a --force --create || exit 1; done
endif
	@mkdir -p out/released && cd out/released && touch $(ASSIGNMENTS)

# What `make release` last released, one stamp per assignment (out/released/<assignment>): out of date when the
# assignment's source, nbgrader's configuration or the gradebook changed since, or when there is no gradebook.
# `make autograde` runs `make release` first only then (1.3 s here for one assignment, 2.3 s for all ten); the
# stamps are never made by this rule, only asked about (`make --question`).
RELEASED = $(addprefix out/released/,$(ASSIGNMENTS))
.SECONDEXPANSION:
out/released/%: solutions/$$*/$$*.ipynb nbgrader_config.py $(or $(wildcard gradebook.db),FORCE)
	@exit 1
FORCE:

# What a class's students receive for one assignment, e.g. `make student-release ASSIGNMENT=ex02_zero1_sharded_adam`:
# the course without that assignment's answers, solutions or tests, lessons run, into OUT (a new folder beside the course).
OUT ?= ../zero-course-$(ASSIGNMENT)
student-release: $(STAMP)
	@test -n "$(ASSIGNMENT)" || { echo "name the assignment: make student-release ASSIGNMENT=ex02_zero1_sharded_adam"; exit 2; }
	$(PY) -m autograder student-release $(ASSIGNMENT) $(OUT)

# nbgrader's log goes to out/autograde.log (its last lines are shown if it fails); the scores end the run.
autograde: bytecode
	@$(MAKE) --no-print-directory --question $(RELEASED) 2> /dev/null || $(MAKE) --no-print-directory release
	@mkdir -p out && : > out/autograde.log
	@for a in $(ASSIGNMENTS); do \
		if ls out/submitted/*/$$a/$$a.ipynb > /dev/null 2>&1; then \
			echo "autograding $$a (nbgrader's log: out/autograde.log)"; \
			$(NBGRADER) autograde $$a --TrustedGrade.time_limit_s=$(TIME_LIMIT) \
				--TrustedGrade.check_time_limit_s=$(CHECK_TIME_LIMIT) >> out/autograde.log 2>&1 \
				|| { tail -n 30 out/autograde.log; exit 1; }; \
		fi; \
	done
	@$(MAKE) --no-print-directory scores

# nbgrader's gradebook as one table: a row per student, a column per assignment handed in (or ASSIGNMENTS=...).
scores: $(STAMP)
	@$(PY) -m autograder scores $(if $(filter command line environment,$(origin ASSIGNMENTS)),\
		--assignments $(subst $(space),$(comma),$(strip $(ASSIGNMENTS))))

feedback: $(STAMP)
	for a in $(ASSIGNMENTS); do \
		if ls out/autograded/*/$$a > /dev/null 2>&1; then $(NBGRADER) generate_feedback $$a || exit 1; fi; \
	done

# ASSIGNMENTS="ex01_collectives ex02_zero1_sharded_adam" limits this target (and release, autograde, feedback) to the
# assignments set so far: the CSV and the feedback then list those only.
grade: bytecode
	$(PY) -I -m autograder grade out/submitted --out out/grades.csv --feedback out/autograder-feedback \
		--assignments $(subst $(space),$(comma),$(strip $(ASSIGNMENTS))) $(GRADE_LIMITS) $(if $(JOBS),--jobs $(JOBS))

bench: $(STAMP)
	$(PY) benchmarks/bench_collectives.py
	$(PY) benchmarks/bench_step.py --world-sizes 8,32,128,256 --compare-world-size 256
	$(PY) benchmarks/bench_bound.py
	$(PY) benchmarks/bench_slots.py
	$(PY) benchmarks/bench_grading.py
	$(PY) benchmarks/bench_class.py
	$(PY) benchmarks/crosscheck_pytorch.py
	$(PY) benchmarks/bench_memory_audit.py

clean:
	rm -rf $(VENV) .venv-oldest-torch .venv-newest-torch .pytest_cache .ruff_cache
