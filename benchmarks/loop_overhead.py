"""What the training loop costs beyond its jitted step: `train()` for --steps steps against the bare
step (`mllm.train.step.benchmark_step`, blocked on each), same config, same process, repeated.

    python -m benchmarks.loop_overhead                     # the suites' cpu preset, 60 steps x 3
    python -m benchmarks.loop_overhead --steps=40 --repeats=2 --out=table.md

Both time steps after the first (which compiles); the loop's median_step_s is its own summary's
(each step from the previous step's metrics to this one's, batches read and placed by the loop),
the bare step's the median of `step(state, batch)` blocked on each. Run it under two commits
(PYTHONPATH=<a worktree>) to compare loops; benchmarks/results/loop-cpu.md holds one comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bare_median(config, steps: int) -> float:
  import jax

  from mllm.train.step import benchmark_step

  step, state, batch = benchmark_step(config)
  state, metrics = step(state, batch)  # compiles
  jax.block_until_ready(metrics['loss'])
  times = []
  for _ in range(steps - 1):
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics['loss'])
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def loop_median(config) -> float:
  from mllm.train import train

  with tempfile.TemporaryDirectory() as workdir:
    return train(config, workdir, progress=False)['median_step_s']


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--out', default=None, help='also write the table (markdown) here')
  args = parser.parse_args(argv)
  sys.path.insert(0, ROOT)
  import mllm
  from experiments.suites._presets import CPU

  overrides = {
    **CPU,
    'train.steps': args.steps,
    'train.log_every': 10,
    'train.warmup_steps': min(10, args.steps // 2),
    'train.checkpoint_every': args.steps,
    'train.async_checkpoint': False,
  }
  config = mllm.load_config(os.path.join(ROOT, 'configs', 'base.py'), overrides)
  rows = []
  for repeat in range(args.repeats):
    loop = loop_median(config)
    bare = bare_median(config, args.steps)
    rows.append((repeat, bare, loop))
    print(
      f'repeat {repeat}: bare step {bare * 1e3:.1f} ms, loop step {loop * 1e3:.1f} ms', flush=True
    )
  lines = [
    f'mllm at {mllm.__file__}; cpu preset (d 128, 2,048 tokens a step), {args.steps} steps',
    '',
    '| repeat | bare step (ms) | loop step (ms) | loop - bare (ms) |',
    '|---:|---:|---:|---:|',
    *(f'| {r} | {b * 1e3:.1f} | {lp * 1e3:.1f} | {(lp - b) * 1e3:+.1f} |' for r, b, lp in rows),
  ]
  bare_m = statistics.median(b for _, b, _ in rows)
  loop_m = statistics.median(lp for _, _, lp in rows)
  lines.append(
    f'| median | {bare_m * 1e3:.1f} | {loop_m * 1e3:.1f} | {(loop_m - bare_m) * 1e3:+.1f} |'
  )
  print('\n'.join(lines))
  if args.out:
    with open(args.out, 'w') as f:
      f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
  main()
