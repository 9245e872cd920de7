VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
PYTEST = cd tests && ../$(1)/bin/python -m pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml $(XDIST)
# The suite runs in pytest-xdist workers. Tests that must share a worker (the Slurm tests,
# the tests on one shared runtime) are grouped by tests/conftest.py, which also hands out
# the longest groups first. Four workers on two cores: most of the suite's time is waiting
# (pilot starts, the batch queue, launches), and three left the cores half idle (a fresh-clone
# CI run, Dec 8: 19.4 CPU minutes in 18.2 minutes of wall on 2 cores, the workers' tests
# 3,124 s). `make test XDIST=` runs it in one process.
XDIST ?= -n 4 --dist loadgroup --no-loadscope-reorder
# The engine and parity tests, run again on the lowest declared versions and on Open MPI.
ENGINE_TESTS := test_frame_join.py test_frame_sort.py test_frame_ops.py test_frame_errors.py
LOWEST ?= .venv-lowest
OPENMPI ?= .venv-openmpi
OMPI_MPIEXEC ?= /usr/bin/mpiexec.openmpi
# The test extra's torch, as the CPU build from the machine's wheel folder: installed before
# the extra, so uv finds its range satisfied instead of downloading PyPI's CUDA build (~3 GB).
TORCH_CPU ?= torch==2.13.0
WHEELS ?= $(or $(PIP_FIND_LINKS),/opt/wheels)

.PHONY: demo test test-main install-main pytest-main test-later test-later-logged test-lowest \
	test-openmpi openmpi chromium slurm-up slurm-down

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(UV): $(PY)
	$(PY) -m pip install -q uv

# Install and run the main job on the embedded default (this machine, bare mpirun, the
# mpich wheel's MPI).
demo: $(PY)
	$(PY) -m pip install -q '.[mpich]'
	$(VENV)/bin/hetflow demo

# Everything CI runs (.ci/run): the whole suite (test-main) and, beside it from its start, Open
# MPI as a second MPI, then the lowest declared versions (test-later). test-main is the
# critical path: its workers are handed work until its end (xdist's hand-out replayed
# with CI's test times ends them within 5 s of each other; .ci/timeline JUNIT shows a run's),
# so run after it the other two added their whole ~140 s to the wall. Beside it they are one
# pytest process at a time, -n 1, and end well before it (measured, n=1 each: test-openmpi
# 150 s and 53 CPU s, test-lowest 284 s and 160 CPU s, at load 6-96; make test-later 345 s
# with its installs and 185 CPU s, at load 10-17). The CPU they take is taken from test-main,
# which uses about one of the two cores (CI: ~14 of the run's 18 CPU minutes in its ~13).
# Open MPI's, the lighter, runs while test-main starts its pilots. test-main's output is live;
# test-later's goes to $(LATER_LOG), printed whole once both end. The installs run one at a
# time (each builds hetflow from this directory).
test: install-main
	@rc=0; $(MAKE) --no-print-directory -j2 pytest-main test-later-logged || rc=$$?; \
	  echo "== make test-later (ran beside test-main; $(LATER_LOG)) =="; \
	  cat $(LATER_LOG); exit $$rc

LATER_LOG ?= $(VENV)/test-later.log
LATER_XDIST ?= -n 1
# Both run, and it fails if either failed.
test-later: $(UV)
	@rc=0; $(MAKE) --no-print-directory test-openmpi XDIST="$(LATER_XDIST)" || rc=1; \
	  $(MAKE) --no-print-directory test-lowest XDIST="$(LATER_XDIST)" || rc=1; exit $$rc

test-later-logged:
	@$(MAKE) --no-print-directory test-later > $(LATER_LOG) 2>&1

# The whole suite on a plain install, checked to be the one imported (the tests must not
# pass by reading the source tree). uv installs it in ~5 s where pip took ~35 s; hetflow
# itself is always rebuilt (uv would reuse a cached build of this directory). The remapped
# hetflow.executors package must import both ways: test-openmpi runs on an editable install.
# JUNIT=path also writes every test's time, worker and start there (pytest's JUnit XML;
# .ci/timeline JUNIT shows each worker's span).
test-main: install-main
	$(MAKE) --no-print-directory pytest-main

install-main: chromium $(UV)
	$(UV) pip install -q --compile-bytecode --python $(PY) --find-links $(WHEELS) '$(TORCH_CPU)'
	$(UV) pip install -q --compile-bytecode --reinstall-package hetflow --python $(PY) '.[test]'
	$(PY) -c "import torch; print('torch', torch.__version__)"
	cd tests && ../$(PY) -c "import hetflow.executors.mpirun as m; assert 'site-packages' in m.__file__, m.__file__"

pytest-main:
	$(call PYTEST,$(VENV)) --durations=25 $(if $(JUNIT),--junitxml=$(JUNIT))

# The declared floors are tested: every direct dependency at the lowest version
# pyproject.toml allows (pyarrow, numpy, parsl, mpi4py, ...), engine and parity tests on
# the runtimes whose code those libraries reach (the slurm runtime is the kernel's, as
# mpirun's and the pool's are, plus Slurm's own commands: its 22 tests ran here too, and
# made this the longer of the two side-by-side runs CI waits for).
test-lowest: $(UV)
	rm -rf $(LOWEST)
	$(UV) venv -q --python $(PY) $(LOWEST)
	$(UV) pip install -q --compile-bytecode --python $(LOWEST)/bin/python --resolution lowest-direct '.[mpich,testing]'
	$(LOWEST)/bin/python -c "import numpy, pyarrow; print('lowest: numpy', numpy.__version__, 'pyarrow', pyarrow.__version__)"
	$(call PYTEST,$(LOWEST)) $(ENGINE_TESTS) test_parity.py -k "not (parsl or radical or slurm)"

# Debian's Open MPI (as root, as CI runs): the site-MPI case, no MPI wheel.
openmpi:
	command -v $(OMPI_MPIEXEC) >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev; }

# Debian's Chromium, headless: tests/test_monitoring.py loads parsl-visualize's pages in it.
chromium:
	command -v chromium >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The parity and fault suites on Open MPI: a venv without the mpich wheel, mpi4py's binary
# wheel loading Debian's libmpi, HETFLOW_MPIEXEC naming the site's launcher. (The parsl
# runtime needs a Hydra launcher: Parsl's $PARSL_MPI_PREFIX uses MPICH's flags.) An
# editable install, checked to be the one imported (test-main tests a plain one).
test-openmpi: openmpi $(UV)
	rm -rf $(OPENMPI)
	$(UV) venv -q --python $(PY) $(OPENMPI)
	$(UV) pip install -q --compile-bytecode --python $(OPENMPI)/bin/python -e '.[testing]'
	test ! -e $(OPENMPI)/bin/mpiexec
	cd tests && ../$(OPENMPI)/bin/python -c "import hetflow.executors.mpirun as m, os; assert os.path.dirname(m.__file__) == os.path.abspath('../executors'), m.__file__"
	HETFLOW_MPIEXEC=$(OMPI_MPIEXEC) OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	  $(OMPI_MPIEXEC) -n 1 $(OPENMPI)/bin/python -c "from mpi4py import MPI; v = MPI.Get_library_version(); print(v.splitlines()[0]); assert 'Open MPI' in v"
	export HETFLOW_MPIEXEC=$(OMPI_MPIEXEC); $(call PYTEST,$(OPENMPI)) test_parity.py test_faults.py \
	  test_shm.py test_rank_comms.py test_pool_kept_comms.py test_pool_world_exit.py \
	  -k "(mpirun or pool) and not leaves_nothing or killed_before_it_unlinked or aborted_world or stale_message"

# A Slurm test cluster on this host, two partitions of two nodes (root; installs slurm-wlm
# and munge when missing); both idempotent. Slurm's tests skip without it (and fail in CI).
slurm-up:
	.ci/slurm up

slurm-down:
	.ci/slurm down
