# temoe: `make train` trains the DeepSeek-V3 smoke model with temoe; `make test` runs the suite.
# Both set up .venv themselves (Python 3.12, pinned packages from requirements.lock).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
RUN ?= deepseek3-smoke-$(shell date +%Y%m%d-%H%M%S)
CONFIG ?= configs/deepseek3-smoke.yml
UV_VERSION ?= 0.13.9
ARGS ?=

# MaxText needs Python 3.12: the first candidate that runs as 3.12 (PATH, then pyenv's versions;
# a pyenv shim for a version not selected exists but does not run).
PYTHON312 ?= $(shell for c in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3 2>/dev/null | sort -rV); do \
  "$$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v "$$c"; break; }; done)

.PHONY: train test docs venv clean image image-smoke image-test
venv: $(VENV)/.installed

$(VENV)/.installed: requirements.lock pyproject.toml
	@test -n "$(PYTHON312)" || { echo "temoe: Python 3.12 not found; set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	# maxtext declares no dependencies of its own: the lock pins everything it imports. uv (from PyPI, pinned)
	# fetches the 160 wheels side by side and writes their bytecode on every core: 30 s where pip took 62 here.
	# uv reads no pip configuration (a mirror in pip.conf, PIP_INDEX_URL): where it cannot install, pip does.
	$(PY) -m pip install -q uv==$(UV_VERSION) \
	  && $(VENV)/bin/uv pip install -q --python $(PY) --no-deps --compile-bytecode -r requirements.lock maxtext==0.2.5 \
	  || { echo "temoe: uv could not install requirements.lock (it reads no pip configuration); pip installs it" >&2; \
	       $(PY) -m pip install -q --no-compile --no-deps -r requirements.lock maxtext==0.2.5 \
	       && $(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null; }
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

train: venv
	$(VENV)/bin/temoe data --out runs/data/smoke-train.parquet
	$(VENV)/bin/temoe train $(CONFIG) base_output_directory=runs run_name=$(RUN) metrics_file=runs/$(RUN)/metrics.jsonl $(ARGS)
	$(PY) -m temoe.tools.summary runs/$(RUN)/metrics.jsonl

# One pytest worker per core plus one, at most 4: a worker waits on its training processes' start-up, files
# and signals part of the time, so on CI's 2 cores 3 workers ran the suite in 21 min against 28.7 with 2
# (one run each, this host, same tests: 3,653 against 3,380 test-seconds, all passed);
# --dist loadfile keeps a file's tests, and its module fixtures, on one worker; --no-loadscope-reorder hands
# the files out in tests/conftest.py's order (the longest first) instead of by their number of tests (which
# would start the few-test training files, the Slurm one included, last).
# --durations lists the 15 slowest tests, to keep the suite inside its time budget.
TEST_WORKERS ?= $(shell n=$$(( $$(nproc 2>/dev/null || echo 1) + 1 )); echo $$(( n < 4 ? n : 4 )))

# tests/image builds the image on a stand-in base and trains in the container where a container engine
# answers (docker, or podman's Docker API); where none does it is skipped with one line saying so.
test: venv
	$(VENV)/bin/ruff check plugin tests bench
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests
	$(MAKE) --no-print-directory docs

# The docs site (MkDocs), built strict: a broken link or a page missing from the nav fails.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir runs/site

clean:
	rm -rf $(VENV) runs .pytest_cache

IMAGE ?= temoe:dev
BASE_IMAGE ?= ghcr.io/nvidia/jax:maxtext-2026-09-10
BUILD_ARGS ?=  # e.g. --build-arg TE_VERSION=base, --build-arg TE_CUDA_MAJOR=12 (Dockerfile's header lists them)
image:   # needs a Docker engine (docker, or podman's Docker API: tests/image/engine.sh); the build ends with `temoe doctor --image`
	docker build --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg VCS_REF=$$(git rev-parse --short HEAD) $(BUILD_ARGS) -t $(IMAGE) .

image-test: venv   # the image test alone: stand-in base, `make image` on it, doctor, plan, train, SIGTERM
	$(PY) -m pytest -v tests/image

image-smoke: image   # a GPU host with the NVIDIA container toolkit
	launch/docker-run.sh $(IMAGE) doctor
	launch/docker-run.sh $(IMAGE) train /opt/temoe/configs/deepseek3-smoke.yml hardware=gpu dtype=bfloat16 weight_dtype=bfloat16 te_gmm_quantization=te_fp8_current base_output_directory=/tmp/runs steps=10
