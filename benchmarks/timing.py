"""Compile a jitted function once, then time it: the loop every benchmark here shares."""

from __future__ import annotations

import statistics
import time

import jax


def compile_and_time(jitted, *args, repeats: int) -> dict:
  """{'compiled', 'compile_s', 'median_s'}: AOT-compiled for `args`, one warm-up call, then the
  median of `repeats` timed calls, each blocked until its result is ready."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(*args))  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return {'compiled': compiled, 'compile_s': compile_s, 'median_s': statistics.median(times)}
