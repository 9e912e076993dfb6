# Two entry points (see README): `make run` serves a PD workload, `make test` runs the test suite.
# Both create (or reuse) .venv and install torch==2.13.0 first when torch is missing, so a range in
# pyproject.toml never pulls a multi-GB CUDA build onto a CPU-only machine.
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_ARGS ?=

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

run: setup
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m distpool run $(RUN_ARGS)

test: setup
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
