"""Populations against sequential runs: K members of one shape trained as one vmapped program
(mllm/train/population.py) against K solo runs one after another, at the suites' cpu preset shape.

    python -m benchmarks.population                   # K = 1, 4 (a CPU's sizes)
    python -m benchmarks.population --members=1,4,16,64 --out=benchmarks/results/population-gpu.md
    python -m benchmarks.population --members=1,auto  # auto: the size a suite's --population=auto
                                                        # picks on this device (fit_population)

Each row: K, the population step's median time, its tokens/s (K members × batch × seq_len per
step), the solo step's tokens/s (one member at a time: the sequential rate), and their ratio.
Steps are timed after a warm-up step, each blocked until its state is ready; compile time apart.
Members: seeds 0..K-1, learning rates spread over a factor-4 grid around the preset's rate.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import numpy as np

import mllm
from benchmarks.machine import describe
from experiments.suites._presets import CPU
from mllm import malloc
from mllm.train.population import AUTO, Member, Population, device_budget, fit_population
from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import setup
from mllm.train.step import make_train_step, synthetic_batch


def _timed(step, state, batch, steps: int) -> tuple[float, float]:
  """(compile + first step seconds, median step seconds of `steps` more)."""
  start = time.perf_counter()
  state, _ = step(state, batch)
  jax.block_until_ready(state)
  first = time.perf_counter() - start
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  return first, statistics.median(times)


def _sizes(members: str, config, mesh) -> list[int]:
  """--members' sizes, 'auto' as fit_population sizes the suites' populations on this device."""
  sizes = []
  for item in members.split(','):
    if item != AUTO:
      sizes.append(int(item))
      continue
    budget = device_budget()
    if budget is None:
      print('auto: no budget on a CPU (the suites train runs one by one there)', flush=True)
      continue
    k, used = fit_population(config, mesh, budget)
    print(f'auto: {k} members ({used / 2**30:.2f} of {budget / 2**30:.2f} GiB a step)', flush=True)
    sizes.append(k)
  return sizes


def main() -> None:
  malloc.keep_freed_memory()  # as launch.py does, before JAX's threads start
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--members', default='1,4', help="comma-separated population sizes K; 'auto': the device's fit"
  )
  parser.add_argument('--steps', type=int, default=5, help='timed steps per measurement')
  parser.add_argument('--out', help='also write the table (with the machine) as markdown here')
  args = parser.parse_args()
  config = mllm.load_config('configs/base.py', CPU)
  mesh = make_mesh(config.mesh)
  tokens = config.data.batch_size * config.data.seq_len
  batch = synthetic_batch(config)

  train_setup, init = setup(config, mesh)
  _, solo_s = _timed(make_train_step(train_setup), init(), global_batch(batch, mesh), args.steps)
  solo_rate = tokens / solo_s
  lines = [
    f'# Populations against sequential runs: {describe()}',
    '',
    f'The cpu preset (d_model {config.model.d_model}, {config.model.n_layers} layers, '
    f'{config.data.batch_size} × {config.data.seq_len} tokens a step); solo step '
    f'{solo_s * 1e3:.1f} ms, {solo_rate:,.0f} tokens/s.',
    '',
    '| K | compile + first step (s) | step (ms) | tokens/s | sequential tokens/s | ratio |',
    '|---|---|---|---|---|---|',
  ]
  print('\n'.join(lines), flush=True)
  for k in _sizes(args.members, config, mesh):
    rates = np.geomspace(0.5, 2.0, k) if k > 1 else [1.0]
    members = [Member(seed, float(r * config.train.learning_rate)) for seed, r in enumerate(rates)]
    population = Population(config, members, mesh)
    stacked = jax.tree.map(lambda x, k=k: np.stack([x] * k), batch)
    alive = np.ones(k, bool)
    step = functools.partial(population.step, alive_K=alive)
    first, step_s = _timed(step, population.init(), stacked, args.steps)
    rate = k * tokens / step_s
    line = (
      f'| {k} | {first:.1f} | {step_s * 1e3:.1f} | {rate:,.0f} | {solo_rate:,.0f} | '
      f'{rate / solo_rate:.2f}x |'
    )
    lines.append(line)
    print(line, flush=True)
  if args.out:
    with open(args.out, 'w', encoding='utf-8') as f:
      f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
  main()
