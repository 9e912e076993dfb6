# Two entry points (see README): `make run` serves a PD workload, `make test` runs the test suite.
# Both create (or reuse) .venv and install torch==2.13.0 first when torch is missing, so the range in
# pyproject.toml never pulls a newer torch (TORCH_INDEX_URL picks where the pin comes from; README).
# `make bench` adds the plots' extra and runs the quick benchmarks into out/.
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

bench: setup
	$(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"
	mkdir -p out
	RAY_USAGE_STATS_ENABLED=0 $(PY) scripts/bench_pool.py --quick --json out/bench_pool.json
	RAY_USAGE_STATS_ENABLED=0 $(PY) scripts/bench_transfer.py --quick --json out/bench_transfer.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
