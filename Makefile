# The two commands: `make train` (default CPU demo) and `make test` (the suite; `make test-fast` for a quick tier).
# Both create the virtual environment when missing and install everything pinned in pyproject.toml.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install system-deps train test test-fast test-all lint bench bench-envs appworld-venv clean

system-deps:
	bash scripts/system_deps.sh

$(STAMP): pyproject.toml
	bash scripts/system_deps.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: here it is the CPU wheel; unpinned, pip would pull a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[all]"
	# pip check, except its "not supported on this platform" notes: pip >= 26 says that of textworld's
	# manylinux1 wheel, which it installed and which runs; any real conflict still fails the install
	$(BIN)/python -m pip check > $(VENV)/pip-check.txt || true
	cat $(VENV)/pip-check.txt
	! grep -v -e "is not supported on this platform" -e "^No broken requirements found" $(VENV)/pip-check.txt
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: system-deps $(STAMP) appworld-venv
	$(BIN)/python -m pytest $(ARGS)

# ruff (pinned in the dev extra; rules in pyproject.toml [tool.ruff]); CI runs it before the tests
lint: $(STAMP)
	$(BIN)/ruff check .

# the contributor's fast tier, about a minute: the default suite without the tests marked `long`
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not gpu and not long" $(ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "" $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/sample_efficiency.py $(ARGS)

# AppWorld pins pydantic 1: it gets its own venv; the env runs there through cope.envs.runtime.remote.RemoteEnv.
# Its data needs a download on a machine with internet (docs/envs/appworld.md).
appworld-venv: .venv-appworld/.installed

.venv-appworld/.installed:
	$(PY) -m venv .venv-appworld
	.venv-appworld/bin/python -m pip install --quiet --upgrade pip
	.venv-appworld/bin/python -m pip install --quiet appworld==0.1.3.post1
	.venv-appworld/bin/appworld install
	.venv-appworld/bin/python -m pip install --quiet --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) outputs .pytest_cache
