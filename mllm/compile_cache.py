"""JAX's persistent compilation cache: a process that compiles shapes compiled before reads them.

Every run of a suite, and every relaunch of a config, compiles the same train and eval steps;
on 2 CPU cores that is ~5 s of a run (15 s with positions' five eval lengths). XLA's output is
keyed by the HLO, the compile options and the backend, so a hit loads the same executable and
the numbers do not change.
"""

from __future__ import annotations

import os

import jax

MIN_COMPILE_S = 0.5  # cheaper compiles are not worth a file each


def default_dir() -> str:
  """$MLLM_CACHE_DIR/jax, else ~/.cache/mllm/jax (beside the corpus cache)."""
  root = os.environ.get('MLLM_CACHE_DIR') or '~/.cache/mllm'
  return os.path.abspath(os.path.expanduser(os.path.join(root, 'jax')))


def enable(path: str | None = None) -> str | None:
  """Turn the cache on at `path` (default: default_dir()); returns the folder in use.

  A folder already set (JAX_COMPILATION_CACHE_DIR, or jax.config) is kept; MLLM_COMPILATION_CACHE=0
  turns the cache off (returns None).
  """
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  if os.environ.get('MLLM_COMPILATION_CACHE', '1') == '0':
    return None
  path = os.path.abspath(os.path.expanduser(path or default_dir()))
  jax.config.update('jax_compilation_cache_dir', path)
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_S)
  return path


# Hits and writes of the cache in this process, from JAX's monitoring events (counted from the
# first `counts()` call on): the first step's line says whether its compile came from disk.
_COUNTS = {'/jax/compilation_cache/cache_hits': 0, '/jax/compilation_cache/cache_misses': 0}


def _count(event: str, **_) -> None:
  if event in _COUNTS:
    _COUNTS[event] += 1


def counts() -> tuple[int, int]:
  """(programs read from the cache, programs compiled and written to it) so far."""
  if not getattr(_count, 'registered', False):
    jax.monitoring.register_event_listener(_count)
    _count.registered = True
  return (
    _COUNTS['/jax/compilation_cache/cache_hits'],
    _COUNTS['/jax/compilation_cache/cache_misses'],
  )
