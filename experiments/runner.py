"""Run a suite: every (variant, seed) through the same `train` and `evaluate` as launch.py.

- A run's directory is <out>/<suite>/runs/<variant>-s<seed>-<hash>, the hash of its resolved
  config (seed included), so a changed config never reuses an old run.
- A run with result.json is finished and skipped; a killed run resumes from its checkpoint
  (train() resumes its workdir); a failed run is retried once, then reported and left out.
- Paired seeds: seed index i sets config.seed = i for every variant, which fixes both the data
  order and the initialisation, so the variants' differences are paired.
- A starts_from variant begins from its parent variant's run of the same seed: it fine-tunes
  those parameters (train.init_from) or, with trains=False, only evaluates them under its config.
"""

from __future__ import annotations

import dataclasses
import json
import os

# The library's modules that runs and measures use, imported now rather than on first use: a
# suite's process lives for hours, and a module imported after the code on disk changed would mix
# two versions in it (2026-11-26: a new mllm.train.loop, imported into a process that held the old
# mllm.layers.moe, raised ImportError between a suite's tuning and its table). Workers are new
# processes and load one version each.
import mllm.generation
import mllm.train  # noqa: F401 (this and the line above: for the reason above)
from experiments import provenance, tune_runs
from experiments.engines import LocalPool, RayEngine, check_out_for_ray, parse_resources
from experiments.run import Job, config_hash, older_hashes, resolve, run_folder, run_one
from experiments.scheduler import run_plan
from experiments.suite import BenchmarkSuite, Suite, Variant
from experiments.tuning import (
  TUNING_SEED_BASE,
  tuning_seeds,
)
from mllm.train.population import AUTO


@dataclasses.dataclass(frozen=True)
class SuiteRun:
  """How to run a suite (`python -m experiments`'s flags): which preset and table seeds, where,
  whether and how to tune the learning rates first, and on what.

  tune_lr: first tune every variant's learning rate (experiments/tuning.py) on `tune_seeds`
  tuning seeds (1000, 1001, ...), then run the table's seeds 0..seeds-1 at each variant's best
  rate (a starts_from variant at its parent's).
  refine_lr: after tuning, refine these variants' best rate on a half-step grid over
  `refine_seeds` tuning seeds (experiments/tuning.py); the table runs at the refined rate. The
  suite's own `refine_lr` rows are refined too, so a report regenerated without the flag shows
  the same table.
  remeasure: run the suite's measure again on every finished run (e.g. decode speed, on a quiet
  machine) and update its result.json.
  population > 1 trains up to that many runs of one shape (a row's seeds, tuning points) as one
  vmapped program (mllm/train/population_loop.py) in this process, each recorded as a run; with
  jobs = 1 (a CPU gains nothing: benchmarks/population.py; for accelerators). 'auto' (the
  default): on a GPU or TPU with jobs = 1 and the local engine, as many as fit in the device's
  memory, per shape; otherwise one (runs one by one, or the jobs' processes).
  jobs > 1 runs that many runs at once, each in its own process (`experiments.worker`); a
  starts_from run waits for its parent. Two runs on 2 cores finish in about 0.7 of the time one
  after the other takes, but each one's tokens/s is then that of a shared machine.
  engine='ray' submits every run as a Ray task (experiments/engines.py) with `resources` (JSON;
  default this machine's cores over `jobs`) to the cluster at `ray_address`, or to a local Ray
  started here without one.
  reuse_other_code: keep finished runs (this suite's, or identical ones of others) whose
  provenance (experiments/provenance.py) differs from this checkout's; without it a suite with
  such runs stops with ValueError before running anything, and other suites' are not copied.
  """

  preset: str
  seeds: int
  out: str
  extra: dict = dataclasses.field(default_factory=dict)  # dotted overrides for every run
  tune_lr: bool = False
  tune_seeds: int = 1
  refine_lr: tuple[str, ...] = ()
  refine_seeds: int = 2
  jobs: int = 1
  population: int | str = 'auto'
  engine: str = 'local'
  ray_address: str | None = None
  resources: str | None = None
  remeasure: bool = False
  reuse_other_code: bool = False
  progress: bool = True


def run_suite(suite: Suite, how: SuiteRun, run=run_one) -> dict:
  """{'runs': [...], 'failed': [...], 'pending': [...], 'tuning': {...}} for every (variant,
  seed) of `suite` run as `how` says, finished ones read back. run=None runs nothing: a report of
  what has finished so far."""
  preset, seeds, out, jobs, engine = how.preset, how.seeds, how.out, how.jobs, how.engine
  tune_lr, tune_seeds, refine_lr = how.tune_lr, how.tune_seeds, how.refine_lr
  resources = how.resources
  _check_engine(jobs, engine, run, how.population)
  if engine == 'ray':
    check_out_for_ray(out)
    resources = parse_resources(resources, jobs)
  _check_tuning(tune_lr, tune_seeds, seeds)
  if tune_lr:  # (a subset of the variants, --variants, keeps those it holds)
    held = [v.name for v in suite.variants if v.name in suite.refine_lr]
    refine_lr = tuple(dict.fromkeys([*held, *refine_lr]))
  _check_refine(suite, refine_lr, how.refine_seeds, tune_lr)
  extra = dict(how.extra or {})
  order = [(variant, seed) for seed in range(seeds) for variant in suite.variants]
  for variant, seed in order:  # every config checked before anything runs
    resolve(suite, variant, preset, seed, extra)
  borrowed = _borrowed_rates(suite, out) if tune_lr and suite.lr_from else None
  where = _engine(run, engine, jobs, resources, how.ray_address)
  try:
    return _run_suite(
      suite,
      preset=preset,
      seeds=seeds,
      out=out,
      extra=extra,
      order=order,
      tune_lr=tune_lr,
      tune_seeds=tune_seeds,
      refine=dict(refine_lr=tuple(refine_lr), refine_seeds=how.refine_seeds),
      borrowed=borrowed,
      execute=dict(
        run=run,
        engine=where,
        progress=how.progress,
        remeasure=how.remeasure,
        reuse_other_code=how.reuse_other_code,
        population=how.population,
      ),
    )
  finally:
    if hasattr(where, 'close'):
      where.close()


def _check_engine(jobs: int, engine: str, run, population: int | str = 1) -> None:
  """Refuse (ValueError) a --jobs, --population or --engine that cannot run, or `run` where it
  cannot."""
  if jobs < 1:
    raise ValueError(f'--jobs={jobs}; allowed: a positive integer')
  if population != AUTO and (
    isinstance(population, bool)
    or not isinstance(population, int)
    or population < 1
    or (population > 1 and (jobs > 1 or engine != 'local'))
  ):
    raise ValueError(
      f'--population={population}; allowed: auto, or a positive integer, above 1 with --jobs=1 '
      'and --engine=local (a population trains in this process)'
    )
  if engine not in ('local', 'ray'):
    raise ValueError(f"--engine={engine!r}; allowed: 'local' (--jobs processes here), 'ray'")
  if (jobs > 1 or engine == 'ray') and run not in (run_one, None):
    raise ValueError(
      'jobs > 1 and --engine=ray run run_one in worker processes; a custom `run` needs jobs=1'
    )


def _check_tuning(tune_lr: bool, tune_seeds: int, seeds: int) -> None:
  """Refuse (ValueError) tuning seeds that are none, or table seeds that reach theirs."""
  if tune_lr and not tune_seeds >= 1:
    raise ValueError(f'--tune_seeds={tune_seeds}; allowed: a positive integer')
  if tune_lr and seeds > TUNING_SEED_BASE:
    raise ValueError(
      f'--seeds={seeds}; allowed with --tune_lr: at most {TUNING_SEED_BASE} '
      f'(tuning seeds start at {TUNING_SEED_BASE})'
    )


def _check_refine(suite: Suite, names, refine_seeds: int, tune_lr: bool) -> None:
  """Refuse (ValueError) a refinement of variants the suite does not tune, or without tuning."""
  if not names:
    return
  tuned = [v.name for v in suite.variants if v.tune and not v.starts_from]
  unknown = [n for n in names if n not in tuned]
  if unknown or not tune_lr or suite.lr_from or refine_seeds < 1:
    raise ValueError(
      f"--refine_lr={','.join(names)} --refine_seeds={refine_seeds}; allowed: variants this "
      f"suite tunes ({', '.join(tuned) or 'none'}), with --tune_lr, on a positive number of seeds"
    )


def _engine(run, engine: str, jobs: int, resources: dict | None, ray_address: str | None):
  """Where the runs execute (experiments/engines.py); None: one at a time in this process."""
  if run is None:  # a report of what has finished: nothing runs, no engine starts
    return None
  if engine == 'ray':
    return RayEngine(resources, ray_address)
  return LocalPool(jobs) if jobs > 1 else None


def _run_suite(
  suite: Suite,
  *,
  preset: str,
  seeds: int,
  out: str,
  extra: dict,
  order: list,
  tune_lr: bool,
  tune_seeds: int,
  refine: dict,
  borrowed: dict | None,
  execute: dict,
) -> dict:
  """Tune the learning rates if asked, then run the table's runs at them; run_suite's results."""
  run = execute['run']
  tuning, table_failed = {}, {}
  if tune_lr and (suite.retune_lr or not suite.lr_from):
    # An lr_from suite tunes only its retune_lr rows, around the borrowed rates, at its budget.
    again = (
      {'centers': {n: borrowed[n] for n in suite.retune_lr}, 'grid': suite.retune_grid}
      if suite.lr_from
      else {}
    )

    def table(rates: dict, waiting: set) -> list[Job]:
      """The table's jobs of every variant whose rate is known now."""
      known = [(v, seed) for v, seed in order if _root(suite, v).name not in waiting]
      tuned = {name: {'best_lr': lr} for name, lr in rates.items()}
      return _table_plan(suite, preset, out, extra, known, borrowed, tuned)[0]

    tuning, table_failed = tune_runs.tune(
      suite,
      preset=preset,
      extra=extra,
      tune_seeds=tune_seeds,
      out=out,
      **refine,
      **again,
      table=table,
      table_size=len(order),
      **{**execute, 'remeasure': False},
    )
  plan, blocked = _table_plan(suite, preset, out, extra, order, borrowed, tuning)
  finished, failed, pending = run_plan(
    plan, out=out, desc=f'suite {suite.name}', **execute, failed=table_failed
  )
  for job in blocked:  # its learning-rate tuning has not finished (or every run of it failed)
    if run is None:
      pending.append(job.record())
    else:
      failed[job.key] = {**job.record(), 'errors': ['its learning-rate tuning has no finished run']}
  keys = [(v.name, s) for v, s in order]
  return {
    'suite': suite.name,
    'preset': preset,
    'seeds': seeds,
    'runs': [finished[k] for k in keys if k in finished],
    'failed': [failed[k] for k in keys if k in failed],
    'pending': pending,
    **({'tuning': tuning, 'tune_seeds': tuning_seeds(tune_seeds)} if tuning else {}),
    **({'lr_from': {'suite': suite.lr_from, 'rates': borrowed}} if borrowed else {}),
    **({'reused_other_code': True} if _reused(suite, out, execute) else {}),
  }


def _reused(suite: Suite, out: str, execute: dict) -> bool:
  """Whether the table was continued with --reuse_other_code: this call's flag, or, for a report
  (nothing runs), the record of the results.json it rewrites, so that a report made without the
  flag keeps saying so."""
  if execute['reuse_other_code']:
    return True
  path = os.path.join(out, suite.name, 'results.json')
  if execute['run'] is not None or not os.path.exists(path):
    return False
  with open(path) as f:
    return bool(json.load(f).get('reused_other_code'))


def _table_plan(
  suite: Suite,
  preset: str,
  out: str,
  extra: dict,
  order: list,
  borrowed: dict | None,
  tuning: dict,
) -> tuple[list[Job], list[Job]]:
  """The table's jobs in `order`, each at its tuned rate; (those, the ones whose rate is not
  known yet)."""
  plan, hashes, older, blocked = [], {}, {}, []
  runs = os.path.join(out, suite.name, 'runs')
  for variant, seed in order:
    lr = _tuned_lr(suite, variant, borrowed, tuning)
    if lr is None:
      blocked.append(Job((variant.name, seed), variant, seed, None, '', ''))
      continue
    config = resolve(suite, variant, preset, seed, {**extra, **lr})
    key = variant.name, seed
    parent = (variant.starts_from, seed) if variant.starts_from else None
    hashes[key] = config_hash(config, hashes[parent] if parent else '')
    older[key] = older_hashes(config, older[parent] if parent else None)
    plan.append(
      Job(
        key,
        variant,
        seed,
        config,
        run_folder(runs, f'{variant.name}-s{seed}', hashes[key], older[key]),
        hashes[key],
        parent,
        suite.extra_metrics,
        older[key],
      )
    )
  return plan, blocked


def _tuned_lr(suite: Suite, variant: Variant, borrowed: dict | None, tuning: dict) -> dict | None:
  """The learning-rate override of `variant`: its root variant's tuned rate; {} untuned;
  None while that tuning has no answer."""
  variant = _root(suite, variant)
  if variant.name not in tuning:
    return {} if borrowed is None else {'train.learning_rate': borrowed[variant.name]}
  best = tuning[variant.name]['best_lr']
  return None if best is None else {'train.learning_rate': best}


def _root(suite: Suite, variant: Variant) -> Variant:
  """The variant whose learning rate `variant` runs at: itself, or its starts_from chain's
  first."""
  by_name = {v.name: v for v in suite.variants}
  while variant.starts_from:
    variant = by_name[variant.starts_from]
  return variant


def _borrowed_rates(suite: Suite, out: str) -> dict:
  """{variant: lr} from suite.lr_from's tuning (its results.json under `out`), for each of this
  suite's tuned variants, which must be there under the same names."""
  path = os.path.join(out, suite.lr_from, 'results.json')
  tuning = {}
  if os.path.exists(path):
    with open(path) as f:
      tuning = json.load(f).get('tuning', {})
  names = [v.name for v in suite.variants if v.tune and not v.starts_from]
  missing = [n for n in names if (tuning.get(n) or {}).get('best_lr') is None]
  if missing:
    raise ValueError(
      f'suite {suite.name!r} takes its learning rates from suite '
      f'{suite.lr_from!r}, whose tuning ({path}) has no best rate for '
      f'{", ".join(missing)}; allowed: run `python -m experiments {suite.lr_from}` '
      'first, or --no-tune_lr (every variant at its configured rate)'
    )
  return {n: tuning[n]['best_lr'] for n in names}


def run_benchmark(suite: BenchmarkSuite, preset: str, out: str) -> str:
  """Run a benchmark suite's module with the preset's arguments into <out>/<suite>/; the path of
  results.md (the paper's numbers first, then the benchmark's table)."""
  import importlib

  if preset not in suite.presets:
    raise ValueError(f'--preset={preset!r}; allowed: {", ".join(suite.presets)}')
  folder = os.path.join(out, suite.name)
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, 'results.md')
  importlib.import_module(suite.module).main(
    [*suite.presets[preset], f'--out={path}', f"--plot={os.path.join(folder, 'results.png')}"]
  )
  # The benchmark's numbers come from this process's code and packages, as a training run's do:
  # the same record, in results.json and on results.md's provenance line.
  record = provenance.current()
  json_path = os.path.join(folder, 'results.json')
  if os.path.exists(json_path):
    with open(json_path) as f:
      rows = json.load(f)
    with open(json_path, 'w') as f:
      json.dump({**rows, 'provenance': record}, f, indent=1)
  with open(path) as f:
    table = f.read()
  with open(path, 'w') as f:
    f.write(
      f'# Suite `{suite.name}`: {suite.description}\n\nPreset `{preset}`: `python -m '
      f"{suite.module} {' '.join(suite.presets[preset])}`.\n\n"
      f'Provenance: {provenance.label(record)}.\n\n'
      + (f'Paper: {suite.paper_source}.\n\n' if suite.paper_source else '')
      + ('#' + table if table.startswith('# ') else table)
      + '\n![results.png](results.png)\n'
    )
  return path
