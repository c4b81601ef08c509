"""python -m experiments SUITE [--preset=cpu|gpu|tiny] [--seeds=N] [--jobs=N | --population=K|auto]
[--out=experiments/results] [--tune_lr | --no-tune_lr] [--tune_seeds=N] [--variants=NAME,NAME]
[--steps=N] [--reuse_other_code]
[--refine_lr=VARIANT,... [--refine_seeds=N]]
[--engine=local|ray [--ray_address=auto|HOST:PORT] [--resources=JSON]]

python -m experiments plan SUITE [--detect 0.03] [--noise_from SUITE] [--steps N]: what a suite
could see and the seeds and CPU hours a target needs, before anything trains (experiments/plan.py).
python -m experiments coord_check [--widths ...]: µP's coordinate check (experiments/coord_check.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from experiments import report
from experiments.runner import SuiteRun, run_benchmark, run_one, run_suite
from experiments.suite import PRESETS, BenchmarkSuite, available, load_suite
from mllm import malloc
from mllm.train.population import AUTO


def main(argv=None) -> int:
  malloc.keep_freed_memory()  # before JAX's threads start (--jobs=1 runs here): buffers stay mapped
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] == 'coord_check':
    from experiments import coord_check

    return coord_check.main(argv[1:])
  if argv and argv[0] == 'plan':
    from experiments import plan

    return plan.main(argv[1:])
  args = _parser().parse_args(argv)
  if args.engine == 'local' and (args.ray_address or args.resources):
    print(
      'error: --ray_address and --resources go with --engine=ray; allowed with '
      '--engine=local: --jobs',
      file=sys.stderr,
    )
    return 2
  from mllm import compile_cache
  from mllm.checks import ConfigError

  compile_cache.enable()  # every seed of a variant compiles the same shapes (--jobs=1 runs here)
  try:
    if args.seeds is not None and args.seeds < 1:
      raise ValueError(f'--seeds={args.seeds}; allowed: a positive integer')
    suite = load_suite(args.suite)
    if isinstance(suite, BenchmarkSuite):
      if args.variants or args.steps:
        raise ValueError(
          f'--variants / --steps trim a training suite; {args.suite!r} is a benchmark suite'
        )
      if args.engine != 'local':
        raise ValueError(
          f'--engine={args.engine}; allowed for the benchmark suite '
          f'{args.suite!r}: local (it times kernels on this machine)'
        )
      print(Path(run_benchmark(suite, args.preset, args.out)).read_text())
      return 0
    suite = _only(suite, args.variants)
    results = run_suite(
      suite,
      SuiteRun(
        preset=args.preset,
        extra=None if args.steps is None else _steps(args.steps),
        seeds=suite.seeds if args.seeds is None else args.seeds,
        out=args.out,
        jobs=args.jobs,
        population=args.population,
        remeasure=args.remeasure,
        tune_lr=args.tune_lr,
        tune_seeds=suite.tune_seeds if args.tune_seeds is None else args.tune_seeds,
        engine=args.engine,
        ray_address=args.ray_address,
        resources=args.resources,
        reuse_other_code=args.reuse_other_code,
        refine_lr=tuple(args.refine_lr.split(',')) if args.refine_lr else (),
        refine_seeds=args.refine_seeds,
      ),
      run=None if args.report_only else run_one,
    )
  except (ValueError, ConfigError) as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the started runs saved their checkpoints
    print(
      'error: interrupted; finished runs are kept and started ones saved a checkpoint: run '
      'the same command again to resume',
      file=sys.stderr,
    )
    return 130
  path = report.write(suite, results, args.out)
  print(Path(path).read_text())
  return 1 if results['failed'] else 0


def _only(suite, variants: str | None):
  """The suite with only the named variants, in the suite's order (a smoke run of a big suite)."""
  if not variants:
    return suite
  names = [v.name for v in suite.variants]
  wanted = variants.split(',')
  unknown = [w for w in wanted if w not in names]
  if unknown:
    raise ValueError(
      f'--variants={variants}: no {unknown[0]!r} in {suite.name!r}; allowed: {", ".join(names)}'
    )
  # The rows' own annotations (diagnoses, rates to refine or tune again) go with the rows.
  return dataclasses.replace(
    suite,
    variants=tuple(v for v in suite.variants if v.name in wanted),
    diagnoses={k: d for k, d in suite.diagnoses.items() if k in wanted},
    refine_lr=tuple(n for n in suite.refine_lr if n in wanted),
    retune_lr=tuple(n for n in suite.retune_lr if n in wanted),
  )


def _steps(steps: int) -> dict:
  """Overrides of a shortened run: `steps` steps, warm-up and evaluation scaled to fit."""
  if steps < 2:
    raise ValueError(f'--steps={steps}; allowed: an integer >= 2')
  return {'train.steps': steps, 'train.warmup_steps': min(50, steps // 10), 'train.eval_every': 0}


def _population(text: str) -> int | str:
  """--population's value: 'auto' or a positive integer."""
  if text == AUTO:
    return AUTO
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f'{text!r}; allowed: auto, or a positive integer')
  return value


def _parser() -> argparse.ArgumentParser:
  """The command line's arguments."""
  parser = argparse.ArgumentParser(prog='python -m experiments', description=__doc__)
  parser.add_argument('suite', help='one of: ' + ', '.join(available()))
  parser.add_argument('--preset', default='cpu', choices=PRESETS)
  parser.add_argument(
    '--seeds', type=int, default=None, help="table seeds 0..N-1 (default: the suite's own, 3 or 5)"
  )
  parser.add_argument('--out', default='experiments/results')
  parser.add_argument(
    '--jobs',
    type=int,
    default=1,
    help='runs at once, each in its own process (2 on 2 cores: ~1.4x faster, '
    'but tokens/s is then a shared machine\'s)',
  )
  parser.add_argument(
    '--population',
    type=_population,
    default=AUTO,
    help='with --jobs=1: up to N runs of one shape (seeds, tuning points) trained as one vmapped '
    'program; auto (the default): on a GPU or TPU as many as fit in its memory, on a CPU one '
    '(it gains nothing there: benchmarks/population.py)',
  )
  parser.add_argument(
    '--engine',
    default='local',
    choices=('local', 'ray'),
    help="local: --jobs worker processes on this machine; ray: every run a Ray "
    "task (pip install -e '.[cluster]'), on --ray_address or a local Ray",
  )
  parser.add_argument(
    '--ray_address',
    default=None,
    help="with --engine=ray: the cluster ('auto': the one this node belongs "
    "to; HOST:PORT; ray://HOST:10001); none: a local Ray started here",
  )
  parser.add_argument(
    '--resources',
    default=None,
    help='with --engine=ray: Ray resources per run, JSON (e.g. \'{"GPU": 1}\' '
    "or '{\"CPU\": 8}'); default: this machine's cores over --jobs",
  )
  parser.add_argument(
    '--tune_lr',
    action=argparse.BooleanOptionalAction,
    default=True,
    help="tune each variant's learning rate first (a log grid on tuning seeds "
    "1000+, experiments/tuning.py), then run the table's seeds at each "
    "variant's best; --no-tune_lr: every variant at its configured rate",
  )
  parser.add_argument(
    '--tune_seeds',
    type=int,
    default=None,
    help="seeds per learning-rate grid point (1000, 1001, ...; default: the suite's own, 1 or 2)",
  )
  parser.add_argument(
    '--variants',
    default=None,
    help='comma-separated variant names: run only these (a smoke run; their results are '
    'stored like any run, under the shortened config\'s own hash)',
  )
  parser.add_argument(
    '--steps',
    type=int,
    default=None,
    help='train every run this many steps instead of the preset\'s (warm-up min(50, steps/10), '
    'evaluation at the end only): a smoke run, e.g. of the gpu preset in one short call',
  )
  parser.add_argument(
    '--report_only',
    action='store_true',
    help='run nothing: write the report of the runs finished so far',
  )
  parser.add_argument(
    '--refine_lr',
    default=None,
    help="comma-separated variants whose tuned rate is refined after tuning: best / √ratio, best, "
    'best · √ratio on --refine_seeds tuning seeds; the table runs at the refined best',
  )
  parser.add_argument(
    '--refine_seeds', type=int, default=2, help='tuning seeds of a refinement (1000, 1001, ...)'
  )
  parser.add_argument(
    '--reuse_other_code',
    action='store_true',
    help='keep this suite\'s finished runs whose code, jax/flax/optax or device differ from this '
    'checkout\'s (results.md lists the runs of each); without it such runs stop the suite before '
    'it starts. Another suite\'s such run is never copied: it is trained again',
  )
  parser.add_argument(
    '--remeasure',
    action='store_true',
    help="run the suite's measure (decode speed, ...) again on finished runs",
  )
  return parser


if __name__ == '__main__':
  sys.exit(main())
