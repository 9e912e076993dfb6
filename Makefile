# Two entry points (see README): `make run` serves a PD workload, `make test` runs the test suite.
# Both create (or reuse) .venv and install torch==2.13.0 first when torch is missing, so the range in
# pyproject.toml never pulls a newer torch (TORCH_INDEX_URL picks where the pin comes from; README).
# `make bench` adds the plots' extra and runs the quick benchmarks into out/; `make bench-serve` runs
# the serving comparison (PD 1P1D against colocated on 2 workers, one seeded workload, four rates)
# on the Bamba-style benchmark model, into out/bench_serve.json and out/bench_serve.png (README).
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_ARGS ?=

.PHONY: setup run test bench bench-extra bench-serve clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

run: setup
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m distpool run $(RUN_ARGS)

test: setup
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q

bench-extra: setup
	$(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"
	mkdir -p out

bench: bench-extra
	RAY_USAGE_STATS_ENABLED=0 $(PY) scripts/bench_pool.py --quick --json out/bench_pool.json
	RAY_USAGE_STATS_ENABLED=0 $(PY) scripts/bench_transfer.py --quick --json out/bench_transfer.json

BENCH_MODEL := distpool/model_impl/reference/configs/bench-bamba.json
BENCH_SERVE_ARGS ?= --request-rate 0.25,0.5,1,2 --num-prompts 10

bench-serve: bench-extra
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m distpool bench serve \
	    --compare "pd:--prefill 1 --decode 1" "colocated:--prefill 0 --decode 2" \
	    --launch-args "--model $(BENCH_MODEL) --model-impl transformers --load-format dummy --dtype float32 --memory-gib 0.25 --context-len 1024 --no-prefix-cache" \
	    --dataset random --input-len 512 --output-len 32 --seed 0 --goodput ttft:3000 tpot:300 \
	    --json out/bench_serve.json --plot out/bench_serve.png $(BENCH_SERVE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
