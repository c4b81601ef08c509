# Two commands set everything up on a fresh machine with python3 >= 3.11 and make:
#   make train   bootstrap .venv from pyproject.toml, then run the default config
#   make test    bootstrap .venv, then run the test suite (slow tests excluded)
#
# The Python: the newest tested one (3.13, 3.12) found on PATH or in pyenv's versions folder
# (pyenv's shims fail for a version that is not selected, so its folders are read directly); jax
# >= 0.11 needs Python >= 3.12. Without one, python3 (3.11) gets jax 0.10. `make PYTHON=...` picks
# another; `make python` prints the choice.
FIND_PYTHON = for p in python3.13 python3.12 \
    $$(ls -d "$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)"/versions/3.1[23].*/bin/python3 2>/dev/null); do \
    "$$p" -c 'import sys; assert sys.version_info[:2] in ((3, 12), (3, 13)); print(*sys.version_info[:3], sys.executable)' 2>/dev/null; \
  done | sort -n -k1 -k2 -k3 | tail -n 1 | cut -d' ' -f4
# `:=` searches once; `?=` would search again at every use of $(PYTHON).
ifndef PYTHON
PYTHON := $(or $(shell $(FIND_PYTHON)),python3)
endif
VENV := .venv
STAMP := $(VENV)/.installed-stamp
CONFIG ?= configs/rope_swiglu.py
ARGS ?=
# -n 2: two pytest workers (pytest-xdist), one per core of the CI machine; loadgroup keeps the
# tests of one xdist_group (the training runs sharing a module fixture) on one worker.
# --durations=20: every run ends with its 20 slowest tests, what to shorten next (under 7 min).
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=20

.PHONY: python install train summary lint format test test-slow test-gpu test-tpu ablate clean

# The venv $(1), made by $(PYTHON); one made by another Python version is replaced.
define make_venv
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "mllm needs python >= 3.11"'
	@echo "mllm: $(1) with $$($(PYTHON) -c 'import sys; print("Python", sys.version.split()[0], sys.executable)')"
	@test ! -x $(1)/bin/python || [ "$$($(1)/bin/python -c 'import sys; print(sys.version_info[:2])')" = "$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])')" ] || rm -rf $(1)
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
endef

# Re-created whenever pyproject.toml changes. uv installs the versions pip installs in about half
# its time (docs/testing.md has the measurements). --compile-bytecode, as pip does: where
# PYTHONDONTWRITEBYTECODE is set nothing else writes the .pyc files, and every process would compile
# jax from source. Where uv cannot be had or cannot install (pip's settings, a local wheel folder
# say, are pip's alone), pip installs as before; fetching uv gives up after 20 s without an answer.
UV ?= uv>=0.13,<0.14
$(STAMP): pyproject.toml
	$(call make_venv,$(VENV))
	@if $(VENV)/bin/python -m pip install --quiet --timeout 20 --retries 1 '$(UV)' >/dev/null 2>&1 && \
	    $(VENV)/bin/python -m uv pip install --quiet --compile-bytecode --python $(VENV)/bin/python -e '.[dev,cluster]'; then \
	  echo "mllm: installed with uv"; \
	else \
	  echo "mllm: uv could not be had or could not install; installing with pip"; \
	  $(VENV)/bin/python -m pip install --quiet --upgrade pip && \
	  $(VENV)/bin/python -m pip install --quiet -e '.[dev,cluster]'; \
	fi
	touch $(STAMP)

# data.source='kjv' (the King James Bible, mllm/data/bible.py) reads Debian's bible-kjv-text,
# unpacked here into the venv, once per venv: `apt-get download` needs no root, only Debian's
# package lists (`apt-get update` fills them, as root). Without apt this says so and goes on;
# the source then reads /usr/lib/bible.data or data.path.
KJV_STAMP := $(VENV)/.kjv-stamp
$(KJV_STAMP): $(STAMP)
	@mkdir -p $(VENV)/share/bible-kjv-text
	@cd $(VENV)/share && rm -f bible-kjv-text_*.deb && \
	  { apt-get download -qq bible-kjv-text 2>/dev/null || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get download -qq bible-kjv-text; }; } && \
	  dpkg-deb -x bible-kjv-text_*.deb bible-kjv-text && rm -f bible-kjv-text_*.deb && \
	  echo "mllm: the King James Bible (bible-kjv-text) unpacked into $(VENV)/share" || \
	  echo "mllm: no bible-kjv-text (needs Debian's apt-get); data.source='kjv' will read /usr/lib/bible.data or data.path"
	touch $@

python:
	@$(PYTHON) -c 'import sys; print("Python", sys.version.split()[0], sys.executable)'

install: $(STAMP) $(KJV_STAMP)

train: $(STAMP) $(KJV_STAMP)
	$(VENV)/bin/python launch.py --config=$(CONFIG) $(ARGS)
	@echo "--- a sample from the trained model (python launch.py --mode=generate ...):"
	$(VENV)/bin/python launch.py --config=$(CONFIG) --mode=generate --prompt='def ' \
		--max_new_tokens=80 --temperature=0.8 --top_k=40 $(ARGS)

summary: $(STAMP)
	$(VENV)/bin/python launch.py --config=$(CONFIG) --mode=summary $(ARGS)

# make ablate SUITE=ffn [PRESET=cpu] [SEEDS=N] [JOBS=1]: one ablation suite (python -m
# experiments); SEEDS defaults to the suite's own (3; 5 for noise and ffn); JOBS=2 runs two at
# once (the cpu preset's timings assume it on 2 cores).
SUITE ?= noise
PRESET ?= cpu
SEEDS ?=
JOBS ?= 1
ablate: $(STAMP) $(KJV_STAMP)
	$(VENV)/bin/python -m experiments $(SUITE) --preset=$(PRESET) $(if $(SEEDS),--seeds=$(SEEDS)) --jobs=$(JOBS) $(ARGS)

# ruff's checks and its formatter (configured in pyproject.toml); `make format` applies both fixes.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The tests compile ~2,000 tiny programs that then run for milliseconds: LLVM's optimisation of
# the CPU code is most of each compile and buys them nothing (pytest -16% on 2 cores from an empty
# cache, mean of 2 runs before and 3 after, 2026-11-27, docs/testing.md). Children inherit it; the caller's XLA_FLAGS come after and win.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0
test: $(STAMP) $(KJV_STAMP)
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests

test-slow: $(STAMP) $(KJV_STAMP)
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) -m slow tests

# The default suite on a GPU (jax[cuda] installed: `pip install -e '.[dev,cuda]'`). GPU_PYTHON=python3
# uses that Python as it is (no venv bootstrap: the offline GPU image); pytest-xdist and
# pytest-timeout are used when installed. Settings (docs/testing.md says why): no preallocation, as
# GPU_WORKERS processes share one GPU; float32 matmuls without TF32 (the float64-reference
# tolerances); deterministic GPU reductions (the bitwise resume tests); no GEMM autotuning (compile
# time). -rfE names the failures in the summary.
GPU_PYTHON ?= $(VENV)/bin/python
GPU_WORKERS ?= 6
GPU_TIMEOUT ?= 600
GPU_XLA_FLAGS ?= --xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0
GPU_ARGS ?=
test-gpu: $(if $(filter $(VENV)/bin/python,$(GPU_PYTHON)),$(STAMP))
	@$(GPU_PYTHON) -c 'import jax; print("test-gpu: jax", jax.__version__, "devices", jax.devices()); assert jax.default_backend() == "gpu", "no GPU backend: install jax[cuda] (the cuda extra)"'
	XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest \
	XLA_FLAGS="$(GPU_XLA_FLAGS) $$XLA_FLAGS" \
	$(GPU_PYTHON) -m pytest -q -rfE \
	  $$($(GPU_PYTHON) -c 'import xdist' 2>/dev/null && echo "-n $(GPU_WORKERS) --dist loadgroup") \
	  $$($(GPU_PYTHON) -c 'import pytest_timeout' 2>/dev/null && echo "--timeout=$(GPU_TIMEOUT)") \
	  $(GPU_ARGS) tests

# Compile the TPU kernels and whole train steps for TPU v4/v5e/v5p/v6e with libtpu, on this host
# (no TPU needed): a venv of its own, since libtpu makes JAX look for a TPU when it starts;
# ALLOW_MULTIPLE_LIBTPU_LOAD lets both pytest workers load it; a compile-only client cannot read
# the persistent compilation cache.
TPU_VENV := .venv-tpu
$(TPU_VENV)/.installed-stamp: pyproject.toml
	$(call make_venv,$(TPU_VENV))
	$(TPU_VENV)/bin/python -m pip install --quiet -e '.[dev,tpu]'
	touch $@

test-tpu: $(TPU_VENV)/.installed-stamp
	JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_ENABLE_COMPILATION_CACHE=false $(TPU_VENV)/bin/python -m pytest -q $(PYTEST_ARGS) -m tpu_compile tests

clean:
	rm -rf $(VENV) $(TPU_VENV) *.egg-info .pytest_cache
