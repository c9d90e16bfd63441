# One command per developer task. `make help` lists them.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: help demo test test-core test-tf test-torch lint docs bench bench-all bench-cluster bench-torch stress stress-resume stress-bound failover clean

help:  ## list the commands
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Editable installs. setuptools prints an information note on each one ("Editable installation":
# our migrations/ folder maps into the package, so it installs an import hook); nothing to act on.
PIP_INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e

# Stamps: the package alone (demo, bench); with the test tools (test-core); with them and
# TensorFlow (test, test-tf); with them and PyTorch (lint, test, test-torch).
$(VENV)/.pkg: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) .
	touch $@

$(VENV)/.test: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) ".[test]"
	touch $@

$(VENV)/.tf: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) ".[test,tf,plot]"
	touch $@

# PyTorch, CPU only: the torch extra's range resolves to the CPU wheel kept on disk here.
$(VENV)/.torch: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) ".[test,torch]"
	touch $@

$(VENV)/.docs: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) ".[docs]"
	touch $@

demo: $(VENV)/.pkg  ## set up and run the multi-worker long-tail demo on SQLite
	$(BIN)/python examples/long_tail_demo.py

test: $(VENV)/.tf $(VENV)/.torch  ## set up and run every test (SQLite and PostgreSQL; core, TensorFlow, PyTorch)
	WQ_SQL_TEST_PG="$$(bash scripts/ensure-postgres.sh)" && export WQ_SQL_TEST_PG && \
	WQ_SQL_PGBOUNCER="$$(bash scripts/pgbouncer.sh || true)" && export WQ_SQL_PGBOUNCER && \
	WQ_SQL_CHROMIUM="$$(bash scripts/chromium.sh || true)" && export WQ_SQL_CHROMIUM && \
	$(BIN)/python -m pytest tests

test-core: $(VENV)/.test  ## the core suite only (no TensorFlow, no PyTorch)
	WQ_SQL_TEST_PG="$$(bash scripts/ensure-postgres.sh)" && export WQ_SQL_TEST_PG && \
	WQ_SQL_PGBOUNCER="$$(bash scripts/pgbouncer.sh || true)" && export WQ_SQL_PGBOUNCER && \
	WQ_SQL_CHROMIUM="$$(bash scripts/chromium.sh || true)" && export WQ_SQL_CHROMIUM && \
	$(BIN)/python -m pytest tests --ignore=tests/tf --ignore=tests/torch

test-tf: $(VENV)/.tf  ## the TensorFlow shim's tests only
	WQ_SQL_TEST_PG="$$(bash scripts/ensure-postgres.sh)" && export WQ_SQL_TEST_PG && \
	$(BIN)/python -m pytest tests/tf

test-torch: $(VENV)/.torch  ## the PyTorch shim's tests only
	WQ_SQL_TEST_PG="$$(bash scripts/ensure-postgres.sh)" && export WQ_SQL_TEST_PG && \
	$(BIN)/python -m pytest tests/torch

lint: $(VENV)/.torch $(VENV)/.docs  ## ruff, mypy (torch installed: wq_sql.torch is checked against it), the import contracts, the docs site
	$(BIN)/ruff check wq_sql tests examples migrations bench scripts docs
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(MAKE) --no-print-directory docs

# The site's source folder is the repository's root (docs/conf.py says why); warnings are errors.
docs: $(VENV)/.docs  ## build the docs site into docs/_build/html (Sphinx + MyST; warnings are errors)
	$(BIN)/sphinx-build -W --keep-going -q -b html -c docs . docs/_build/html

stress: stress-resume $(VENV)/.tf  ## the resume soak (below), then the end-of-data hang hunt: 2 TF workers beside 2 CPU burners, 40 runs per backend (45-75 min in all)
	WQ_SQL_TEST_PG="$$(bash scripts/ensure-postgres.sh)" && export WQ_SQL_TEST_PG && \
	$(BIN)/python tests/tf/stress_end_of_data.py --backend sqlite --runs 40 --burners 2 --hang 90 && \
	$(BIN)/python tests/tf/stress_end_of_data.py --backend postgresql --runs 40 --burners 2 --hang 90

# A PyTorch trainer and a TensorFlow trainer (consumed="checkpoint") SIGKILLed at random points,
# KILLS times each per backend, restarted from their checkpoints each time (CI runs a handful).
KILLS ?= 50
stress-resume: $(VENV)/.tf $(VENV)/.torch  ## the resume soak: PyTorch and TensorFlow trainers SIGKILLed 50 times each per backend (about 20 min)
	WQ_SQL_TEST_PG="$$(bash scripts/ensure-postgres.sh)" && export WQ_SQL_TEST_PG && \
	WQ_SQL_TEST_KILLS=$(KILLS) timeout 5400 $(BIN)/python -m pytest -q -p no:cacheprovider -s -o faulthandler_timeout=1800 \
	  tests/torch/test_torch_kill.py \
	  tests/tf/test_tf_resume_regressions.py::test_trainer_killed_at_random_points_loses_nothing

# The lease-ahead bound sampled while a consumer reads, on every backend, for the core, TF and
# torch, RUNS times beside two CPU burners (each burner and run bounded by timeout).
RUNS ?= 20
stress-bound: $(VENV)/.tf $(VENV)/.torch  ## the lease-ahead bound tests 20 times over beside 2 CPU burners (about 20 min)
	WQ_SQL_TEST_PG="$$(bash scripts/ensure-postgres.sh)" && export WQ_SQL_TEST_PG && \
	WQ_SQL_PGBOUNCER="$$(bash scripts/pgbouncer.sh)" && export WQ_SQL_PGBOUNCER && \
	burners=""; for b in 1 2; do timeout 3600 $(BIN)/python -c 'while True: pass' & burners="$$burners $$!"; done; \
	ok=0; for i in $$(seq $(RUNS)); do \
	  timeout 600 $(BIN)/python -m pytest -q -p no:cacheprovider tests/contract/test_lease_ahead_bound.py \
	    tests/tf/test_tf_lease_ahead.py tests/torch/test_torch_lease_ahead.py || ok=1; \
	done; kill $$burners 2>/dev/null; exit $$ok

failover: $(VENV)/.test  ## the failover drill on a real Patroni + etcd pair (installs patroni, etcd-server as root): 16 workers, primary killed, switchover, standby lost (about 3 min)
	$(BIN)/python bench/failover.py

# $WQ_SQL_BENCH_PG, when set, is the Postgres admin URL the benchmarks use; else ensure-postgres finds one.
bench: $(VENV)/.tf  ## the headline benchmarks (claims, long tail, TF, SQLite roll-over; 5-10 min) and their summary table
	WQ_SQL_BENCH_PG="$${WQ_SQL_BENCH_PG:-$$(bash scripts/ensure-postgres.sh)}" && export WQ_SQL_BENCH_PG && \
	$(BIN)/python bench/headline.py

bench-all: $(VENV)/.pkg  ## the long benchmark set of BENCHMARKS.md (about 2 hours; needs PostgreSQL and initdb)
	WQ_SQL_BENCH_PG="$${WQ_SQL_BENCH_PG:-$$(bash scripts/ensure-postgres.sh)}" && export WQ_SQL_BENCH_PG && \
	$(BIN)/python bench/claim_throughput.py && $(BIN)/python bench/long_tail.py && \
	$(BIN)/python bench/long_tail.py --backend postgresql && \
	$(BIN)/python bench/scale.py create --backend sqlite && $(BIN)/python bench/scale.py create --backend postgresql && \
	$(BIN)/python bench/scale.py drain --backend postgresql --cluster --n 1000000 && \
	$(BIN)/python bench/scale.py drain --backend postgresql --cluster --n 10000 --epochs 10 && \
	$(BIN)/python bench/scale.py rollover --backend postgresql --cluster && \
	$(BIN)/python bench/scale.py rollover --backend sqlite && \
	$(BIN)/python bench/scale.py memory --backend sqlite && $(BIN)/python bench/scale.py memory --backend postgresql && \
	$(BIN)/python bench/claim_throughput.py --backends postgresql --cluster --procs 16 && \
	$(BIN)/python bench/claim_throughput.py --backends postgresql --cluster --procs 8 --threads 32

bench-torch: $(VENV)/.torch  ## the PyTorch DataLoader benchmarks of BENCHMARKS.md (about 5 minutes; needs PostgreSQL)
	WQ_SQL_BENCH_PG="$${WQ_SQL_BENCH_PG:-$$(bash scripts/ensure-postgres.sh)}" && export WQ_SQL_BENCH_PG && \
	for b in sqlite postgresql; do \
	  $(BIN)/python bench/torch_loader.py throughput --backend $$b --runs 9 --lease-ahead 64 256 && \
	  $(BIN)/python bench/torch_loader.py throughput --backend $$b --runs 5 --lines 1000 --lease-ahead 64 256 && \
	  $(BIN)/python bench/torch_loader.py throughput --backend $$b --runs 5 --persistent --epochs 5 --lease-ahead 256 && \
	  $(BIN)/python bench/torch_loader.py long-tail --backend $$b --runs 3 || exit 1; \
	done

bench-cluster: $(VENV)/.pkg  ## 100, 500 and 2,000 workers through PgBouncer, and the long tail of 200 (about 15 min; needs initdb, pgbouncer)
	WQ_SQL_PGBOUNCER="$$(bash scripts/pgbouncer.sh)" && export WQ_SQL_PGBOUNCER && \
	$(BIN)/python bench/cluster_scale.py scale && $(BIN)/python bench/cluster_scale.py tail

clean:  ## remove the venv, local databases and the demo's timeline
	rm -rf $(VENV) *.db *.db-wal *.db-shm *.db-wqturns long_tail_demo.html docs/_build
