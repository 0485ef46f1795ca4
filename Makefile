# kvscale: one-command set-up, run and test on a fresh machine (Python 3.11, no GPU).
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# The repo has a top-level operator/ folder (kvscale.operator): keep the current
# directory off sys.path for `python -m`/`-c`, or it would shadow the stdlib module.
export PYTHONSAFEPATH := 1

.PHONY: venv test serve lint e2e clean prometheus buildah cc images

venv: $(STAMP)

# torch first, pinned to the CPU wheel, or pip would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py requirements-dev.txt requirements-eval.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-eval.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: venv prometheus buildah cc
	$(BIN)/ruff check .
	$(BIN)/pytest -q

# The autoscaling tests run a real Prometheus server: Debian's package, installed when missing.
prometheus:
	@command -v prometheus >/dev/null || { \
		echo "installing the prometheus server (apt-get)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; \
	}

# The draft sidecar's C part (server/native_build.py) is built at first use; its tests
# expect a C compiler: Debian's gcc, installed when missing.
cc:
	@command -v gcc >/dev/null || command -v cc >/dev/null || { \
		echo "installing a C compiler (apt-get)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev; \
	}

# The image smoke tests (tests/images) build and run the images with buildah (no Docker
# daemon), on a Debian base made by mmdebstrap: Debian's packages, installed when missing.
buildah:
	@command -v buildah >/dev/null && command -v mmdebstrap >/dev/null || { \
		echo "installing buildah and mmdebstrap (apt-get)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah mmdebstrap; \
	}

# Both images with buildah: ghcr.io/kvscale/kvscale-{server,operator}:<version>.
# TORCH_VERSION=2.13.0 for a CPU test build; PYTHON_IMAGE=python:3.11.13-slim-bookworm with a registry.
images: buildah
	docker/build-images.sh

serve: venv
	$(BIN)/kvscale serve --model demo

e2e: venv
	$(BIN)/pytest -q e2e

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
