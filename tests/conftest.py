"""Shared helpers: tiny configs that build and run in milliseconds on a CPU."""
from __future__ import annotations

import os
import tempfile

import pytest

# The training tests compile the same step in several runs and subprocesses (each train() call
# builds new jitted closures); JAX's persistent compilation cache, keyed by the HLO, lets every
# compile after the first be a disk read. Subprocesses inherit it through the environment.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                      os.path.join(tempfile.gettempdir(), f'mllm-tests-jax-cache-{os.getuid()}'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.5')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, 'configs', 'base.py')

TINY = {
    'model.vocab_size': 32, 'model.d_model': 16, 'model.n_layers': 2, 'model.n_heads': 4,
    'model.n_kv_heads': 2, 'model.max_seq_len': 16, 'data.seq_len': 16,
}


def tiny_config(choices: str = '', **overrides):
  """configs/base.py with `choices`, shrunk to TINY, then `overrides` (dotted keys as kwargs
  with '__' for '.', e.g. model__n_layers=1)."""
  import mllm
  spec = f'{BASE}:{choices}' if choices else BASE
  merged = dict(TINY)
  merged.update({k.replace('__', '.'): v for k, v in overrides.items()})
  return mllm.load_config(spec, merged)


@pytest.fixture
def tiny():
  return tiny_config
