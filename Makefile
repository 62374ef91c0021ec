# grpo-kit: `make demo` runs the quickstart notebook on the offline tiny profile; `make test` runs the tests.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup models slurm test cluster-test demo bench lint clean

setup:
	@bash scripts/setup.sh

# the offline models the tests use, into the model cache once (tiny, tiny-tools: copied from grpo_kit/prebuilt/,
# GRPO_KIT_TINY_BUILD=1 pretrains them, ~6 and ~5.5 min; smollm2-135m: de-quantized, ~30 s)
models: setup
	$(PY) -m grpo_kit.models tiny tiny-tools smollm2-135m

# a single-node Slurm on this machine for the Slurm tests (root: installs slurm-wlm + munge with apt)
slurm:
	@bash scripts/slurm.sh up || { [ "$$(id -u)" != 0 ] && echo "make: no Slurm without root here; the Slurm tests will skip"; }

# the whole suite, the cluster tests included (what CI runs: .ci/run)
test: setup models slurm
	$(PY) -m pytest $(PYTEST_ARGS)

# only the kit on real clusters: Slurm, separately started dask scheduler/worker processes (plain
# and TLS), the pre-flight all-reduce sweep
CLUSTER_TESTS := tests/test_slurm.py tests/test_separate_workers.py tests/test_preflight.py
cluster-test: setup models slurm
	$(PY) -m pytest $(CLUSTER_TESTS) $(PYTEST_ARGS)

demo: setup
	$(PY) -m grpo_kit.demo

bench:
	@BENCH=1 bash scripts/setup.sh
	$(PY) bench/alignment.py
	$(PY) bench/engines.py
	$(PY) bench/pipelining.py
	$(PY) bench/packing.py
	$(PY) bench/vs_trl.py
	$(PY) bench/vs_trl.py --profile smol --repeats 1 --eval-every 5
	$(PY) bench/staleness.py
	$(PY) bench/algorithms.py --profiles tiny --engine hf --iterations 20
	$(PY) bench/real_model.py

lint: setup
	$(PY) -m ruff check grpo_kit tests bench
	$(PY) -m ruff format --check grpo_kit tests bench

clean:
	rm -rf runs .pytest_cache
