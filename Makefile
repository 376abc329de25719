# Two commands do everything on a fresh machine: `make study` and `make test`; CI runs `make test-all`.
# Both go through `make install`, which creates or reuses .venv and re-installs only when
# pyproject.toml or the lock (constraints.txt) changed (the stamp file records what was installed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_USAGE_STATS_ENABLED := 0
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: install lock study smoke test test-all lint clean mlflow-ui

install: $(STAMP)

# pip's -qq prints errors only: setuptools' notes on editable installs and pip's warnings about
# configured package locations that lack a package are noise here, and a failed install still
# prints its error and stops make. torch: the release the machine provides (local disk on the
# project's machines), never a newer one. Every version comes from the lock: pyproject.toml
# declares the ranges the project is tested on, constraints.txt the versions installed.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -qq --upgrade pip
	$(BIN)/pip install -qq -c constraints.txt torch torchvision
	$(BIN)/pip install -qq -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The lock after an upgrade inside the ranges: what .venv holds, less the project and pip.
lock: install
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --all --exclude-editable --exclude pip; } \
		> constraints.txt.new && mv constraints.txt.new constraints.txt

study: install
	$(BIN)/python -m studies.run ltd_bound

smoke: install
	$(BIN)/python -m studies.run ltd_bound --smoke

# `make test` is the contributor's loop: every test not marked slow. `make test-all` adds the slow
# end-to-end tests (Ray clusters on loopback, whole studies, the seeded chaos test); CI runs it.
# Two pytest workers (pytest-xdist), each taking whole test files so that a module's fixtures are
# built once.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

test-all: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: install
	$(BIN)/ruff check icr studies tests benchmarks

mlflow-ui: install
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$${ICR_WORKSPACE:-workspace}/mlflow.db --artifacts-destination $${ICR_WORKSPACE:-workspace}/mlartifacts --host 127.0.0.1 --port 5000

clean:
	rm -rf workspace reports .pytest_cache
