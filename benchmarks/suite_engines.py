"""What a suite pays for its engine: the same tiny suite on the local pool and on Ray.

    python -m benchmarks.suite_engines [--runs=8] [--jobs=2]    # results/suite_engines-cpu.md

Protocol: one variant of configs/base.py at the tiny preset (6 steps, seconds of training), `--runs`
seeds, on a small text corpus built from this Python's standard library; each engine starts from an
empty --out and a warm compilation cache (a first pass, not timed, fills it). Rows: `--jobs`
processes of the local pool; Ray with a local instance this call starts (its start counted); and
Ray again on the instance already up. Overhead per run = (engine's wall - pool's wall) / runs.
Tiny runs make the overhead visible; on the cpu preset a run takes minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
import tempfile
import time


def _corpus(folder: str) -> str:
  stdlib = sysconfig.get_paths()['stdlib']
  names = sorted(n for n in os.listdir(stdlib) if n.endswith('.py'))
  picked = [n for n in names if 2_000 < os.path.getsize(os.path.join(stdlib, n)) < 30_000][:14]
  os.makedirs(folder, exist_ok=True)
  for name in picked:
    shutil.copy(os.path.join(stdlib, name), os.path.join(folder, name + '.txt'))
  return folder


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--runs', type=int, default=8)
  parser.add_argument('--jobs', type=int, default=2)
  parser.add_argument(
    '--out', default=os.path.join(os.path.dirname(__file__), 'results', 'suite_engines-cpu.md')
  )
  return parser.parse_args(argv)


def tiny_suite(tmp: str):
  """The one-variant suite and its config overrides: a byte-level corpus and caches under tmp."""
  from experiments.suite import Suite, Variant
  from experiments.suites._presets import PRESETS

  extra = {
    'data.source': 'text',
    'data.path': _corpus(os.path.join(tmp, 'corpus')),
    'data.tokenizer': 'byte',
    'model.vocab_size': 258,
    'data.val_fraction': 0.3,
    'data.cache_dir': os.path.join(tmp, 'cache'),
  }
  suite = Suite('bench', 'engine overhead', 'configs/base.py', (Variant('base'),), PRESETS)
  return suite, extra


def write_report(args, walls, load: float) -> None:
  """Print the table of (engine, wall s) rows, the local pool's first, and write it to --out."""
  from benchmarks.machine import describe

  pool = walls[0][1]
  lines = [
    f'# Suite engines: {args.runs} tiny runs, --jobs={args.jobs} ({describe()})',
    '',
    f'`python -m benchmarks.suite_engines --runs={args.runs} --jobs={args.jobs}`. '
    'Overhead per run: (wall - local pool wall) / runs. Load average when it started: '
    f'{load:.1f} on {os.cpu_count()} cores.',
    '',
    '| engine | wall s | s per run | overhead per run s |',
    '|---|---:|---:|---:|',
  ]
  lines += [
    f'| {name} | {wall:.1f} | {wall / args.runs:.2f} | {(wall - pool) / args.runs:+.2f} |'
    for name, wall in walls
  ]
  text = '\n'.join(lines) + '\n'
  print(text)
  with open(args.out, 'w') as f:
    f.write(text)


def main(argv=None) -> None:
  args = parse_args(argv)
  import ray

  from experiments.engines import init_ray
  from experiments.runner import SuiteRun, run_suite
  from mllm import compile_cache

  compile_cache.enable()
  tmp = tempfile.mkdtemp(prefix='suite-engines-')
  suite, extra = tiny_suite(tmp)

  def timed(engine: str, name: str) -> float:
    out = os.path.join(tmp, name)
    start = time.perf_counter()
    results = run_suite(
      suite,
      SuiteRun(
        preset='tiny',
        seeds=args.runs,
        out=out,
        extra=extra,
        progress=False,
        jobs=args.jobs,
        engine=engine,
      ),
    )
    wall = time.perf_counter() - start
    assert not results['failed'] and len(results['runs']) == args.runs, results['failed']
    return wall

  load = os.getloadavg()[0]  # other work on the machine slows every row alike
  timed('local', 'warm')  # fills the compilation cache and the corpus cache
  pool = timed('local', 'pool')
  ray_started = timed('ray', 'ray-start')  # starts and stops its own local Ray
  init_ray()
  try:
    ray_up = timed('ray', 'ray-up')
  finally:
    ray.shutdown()
  shutil.rmtree(tmp, ignore_errors=True)
  walls = [
    ('local pool', pool),
    ('Ray, local instance started by the suite', ray_started),
    ('Ray, instance already up', ray_up),
  ]
  write_report(args, walls, load)


if __name__ == '__main__':
  main()
