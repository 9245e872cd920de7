VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Install and run the main job on the embedded default (this machine, bare mpirun).
demo: $(PY)
	$(PY) -m pip install -q '.[test]'
	$(VENV)/bin/hetflow demo

# Install (plain, non-editable) and run the whole test suite.
test: $(PY)
	$(PY) -m pip install -q '.[test]'
	cd tests && ../$(VENV)/bin/pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml
