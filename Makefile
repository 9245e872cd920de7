VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST := cd tests && ../$(VENV)/bin/pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml

.PHONY: demo test slurm-up slurm-down

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Install and run the main job on the embedded default (this machine, bare mpirun).
demo: $(PY)
	$(PY) -m pip install -q '.[test]'
	$(VENV)/bin/hetflow demo

# The whole suite on a plain install (checked to be the one imported: the tests must not
# pass by reading the source tree), then the executor-parity and fault suites again on an
# editable install (the remapped hetflow.executors package must import both ways).
test: $(PY)
	$(PY) -m pip install -q '.[test]'
	cd tests && ../$(PY) -c "import hetflow.executors.mpirun as m; assert 'site-packages' in m.__file__, m.__file__"
	$(PYTEST)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c "import hetflow.executors.mpirun as m, os; assert os.path.dirname(m.__file__) == os.path.abspath('executors'), m.__file__"
	$(PYTEST) test_parity.py test_faults.py -k "mpirun or pool"

# A two-node Slurm test cluster on this host (root; installs slurm-wlm and munge when
# missing); both idempotent. Slurm's tests skip without it (and fail in CI).
slurm-up:
	.ci/slurm up

slurm-down:
	.ci/slurm down
