# grpo-kit: `make demo` runs the quickstart notebook on the offline tiny profile; `make test` runs the tests.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench lint clean

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(PY) -m grpo_kit.demo

bench:
	@BENCH=1 bash scripts/setup.sh
	$(PY) bench/alignment.py
	$(PY) bench/engines.py
	$(PY) bench/pipelining.py
	$(PY) bench/vs_trl.py

lint: setup
	$(PY) -m ruff check grpo_kit tests bench
	$(PY) -m ruff format --check grpo_kit tests bench

clean:
	rm -rf runs .pytest_cache
