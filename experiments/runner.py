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

import contextlib
import dataclasses
import glob
import json
import os
import signal
import threading
import traceback

from tqdm import tqdm

# The library's modules that runs and measures use, imported now rather than on first use: a
# suite's process lives for hours, and a module imported after the code on disk changed would mix
# two versions in it (2026-11-26: a new mllm.train.loop, imported into a process that held the old
# mllm.layers.moe, raised ImportError between a suite's tuning and its table). Workers are new
# processes and load one version each.
import mllm.generation
import mllm.train  # noqa: F401 (this and the line above: for the reason above)
from experiments.engines import (
  WORKER_LOG,
  LocalPool,
  RayEngine,
  check_out_for_ray,
  parse_resources,
)
from experiments.measures import MEASURES
from experiments.run import (
  ERRORS_LOG,
  RESULT,
  adopt,
  config_hash,
  read_result,
  resolve,
  run_dir,
  run_one,
  same_run_elsewhere,
  write_result,
)
from experiments.suite import BenchmarkSuite, Suite, Variant
from experiments.tuning import TUNING_SEED_BASE, choose, tuning_seeds
from mllm.paths import RunDir


@contextlib.contextmanager
def _sigterm_as_interrupt():
  """SIGTERM (a scheduler's preemption, `kill`) stops the suite as Ctrl-C does: the workers get
  SIGTERM in turn and save a checkpoint, and none is left running unsupervised (where a relaunch
  would start a second process on the same workdir)."""
  if threading.current_thread() is not threading.main_thread():  # only it may set handlers
    yield
    return

  def interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)

  previous = signal.signal(signal.SIGTERM, interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def _last_error(workdir: str) -> str:
  try:
    with open(os.path.join(workdir, WORKER_LOG)) as f:
      lines = [line.strip() for line in f if line.strip()]
  except OSError:
    return 'the worker left no log'
  errors = [
    line
    for line in lines
    if 'Error' in line.split(':')[0] or line.split(':')[0].endswith('Exception')
  ]
  return (errors or lines or ['the worker exited without output'])[-1]


@dataclasses.dataclass
class _Job:
  """One run to execute: a table run (key (variant, seed)) or a tuning run (key (variant, seed,
  k), k the learning-rate grid's exponent)."""

  key: tuple
  variant: Variant
  seed: int
  config: object
  workdir: str
  hash: str
  parent: tuple | None = None  # the key of the run a starts_from variant begins from
  measure: str | None = None  # a name in MEASURES

  def record(self) -> dict:
    return {
      'variant': self.variant.name,
      'seed': self.seed,
      'workdir': self.workdir,
      'hash': self.hash,
    }


def _execute(
  plan: list[_Job],
  *,
  out: str,
  run,
  engine,
  progress: bool,
  remeasure: bool,
  desc: str,
  finished: dict | None = None,
) -> tuple[dict, dict, list]:
  """Run what has not finished of `plan`: (finished {key: record + result}, failed {key: record +
  errors}, pending [records] (run=None)). Finished runs are read back (remeasured if asked); an
  identical finished run elsewhere under `out` is copied; a failed run is retried once; a
  starts_from run waits for its parent, whose record `finished` may already hold. engine: where
  the runs execute (experiments/engines.py); None: one at a time in this process."""
  finished = dict(finished or {})
  todo, pending, failed = [], [], {}
  _restore_from_ledgers(plan, out)
  for job in plan:
    measure = MEASURES[job.measure] if job.measure else None
    if os.path.exists(os.path.join(job.workdir, RESULT)):
      result = read_result(job.workdir)
      if (
        remeasure
        and measure is not None
        and 'diverged_at_step' not in result
        and (os.path.isdir(RunDir(job.workdir).checkpoints) or not job.variant.trains)
      ):
        source = (
          finished[job.parent]['workdir']
          if (job.parent and not job.variant.trains)
          else job.workdir
        )
        result.update(measure(job.config, source))
        write_result(job.workdir, result)
      finished[job.key] = {**job.record(), **result}
    elif run is None:
      pending.append(job.record())
    else:
      todo.append(job)
  bar = tqdm(
    total=len(plan),
    initial=len(plan) - len(todo),
    desc=desc,
    unit='run',
    disable=not progress or not todo,
    position=0,
  )

  def ready(job) -> bool | None:
    """True: it can start; None: it never can (its parent failed); False: not yet."""
    if job.parent is None:
      return True
    if job.parent in failed or 'diverged_at_step' in finished.get(job.parent, {}):
      return None
    return job.parent in finished

  def prepare(job) -> dict:
    kwargs = {}
    if job.parent is not None:
      kwargs['parent'] = finished[job.parent]
      if job.variant.trains:
        job.config.train.init_from = f"workdir:{kwargs['parent']['workdir']}"
    os.makedirs(job.workdir, exist_ok=True)
    with open(os.path.join(job.workdir, 'run_config.json'), 'w') as f:
      f.write(job.config.to_json(sort_keys=True, indent=1))
    return kwargs

  def done(job, result=None, errors=None):
    if result is not None:
      finished[job.key] = {**job.record(), **result}
      _append_ledger(job, result)
    else:
      failed[job.key] = {**job.record(), 'errors': errors}
      bar.write(f'run {job.variant.name} seed {job.seed} failed: {errors[-1]}')
    bar.update(1)

  def adopted(job) -> bool:
    """An identical finished run elsewhere under `out` is copied, not trained again."""
    if job.parent is not None or os.path.isdir(RunDir(job.workdir).checkpoints):
      return False  # a child depends on its parent's path; a started run resumes instead
    source = same_run_elsewhere(out, job.seed, job.hash, job.workdir)
    if source is None:
      return False
    bar.write(
      f'run {job.variant.name} seed {job.seed}: the same config and seed finished in '
      f'{source}; copied, not trained again'
    )
    done(
      job, adopt(source, job.config, job.workdir, MEASURES[job.measure] if job.measure else None)
    )
    return True

  running = {}  # the engine's handle -> (job, payload, attempt)

  def start(job, payload, attempt):
    running[engine.submit(payload, job.workdir)] = (job, payload, attempt)

  try:
    with _sigterm_as_interrupt():
      while todo or running:
        for job in [job for job in todo if ready(job) is None]:
          todo.remove(job)
          done(
            job,
            errors=[
              f'its starts_from run {job.variant.starts_from} seed {job.seed} did not finish'
            ],
          )
        startable = [job for job in todo if ready(job)]
        if startable and (engine is None or len(running) < engine.slots):
          job = startable[0]
          todo.remove(job)
          kwargs = prepare(job)
          if adopted(job):
            continue
          if engine is None:
            _run_here(job, run, kwargs, progress, done)
          else:
            start(job, {'config': job.config, 'measure': job.measure, **kwargs}, 1)
          continue
        if not running:
          break
        for handle, ok in engine.wait(1.0):
          job, payload, attempt = running.pop(handle)
          if ok and os.path.exists(os.path.join(job.workdir, RESULT)):
            done(job, read_result(job.workdir))
          elif attempt == 1:  # a failed (or killed) run is retried once: it resumes
            start(job, payload, 2)
          else:
            done(job, errors=[_last_error(job.workdir)])
  except KeyboardInterrupt:
    if running:  # the runs save a checkpoint: the next call resumes them
      engine.stop()
    raise
  finally:
    bar.close()
  return finished, failed, pending


# Each suite folder keeps a ledger of its finished runs, <out>/<suite>/finished.jsonl (committed
# with the results): a fresh clone, without the run directories, resumes a suite where it
# stopped instead of training its finished runs again.
LEDGER = 'finished.jsonl'


def _append_ledger(job: _Job, result: dict) -> None:
  suite_folder = os.path.dirname(os.path.dirname(job.workdir))
  with open(os.path.join(suite_folder, LEDGER), 'a') as f:
    f.write(
      json.dumps(
        {'hash': job.hash, 'seed': job.seed, 'run': os.path.basename(job.workdir), 'result': result}
      )
      + '\n'
    )


def _read_ledgers(out: str) -> dict:
  """{hash: [entry, ...]} of every suite's ledger under `out`, each with its suite folder."""
  entries = {}
  for path in sorted(glob.glob(os.path.join(out, '*', LEDGER))):
    with open(path) as f:
      for line in f:
        if line.strip():
          entry = json.loads(line)
          entries.setdefault(entry['hash'], []).append(
            {**entry, 'suite_folder': os.path.dirname(path)}
          )
  return entries


def _restore_from_ledgers(plan: list[_Job], out: str) -> None:
  """Give every unfinished job of `plan` that a ledger records its result.json back (without
  checkpoints), unless a child of it still has to run and needs its parameters. Its own suite's
  record wins (its latest); another suite's stands in only for a job without a measure, since
  that suite did not measure it (such a run is copied with its checkpoint and measured, or
  trained again)."""
  ledger = _read_ledgers(out)

  def record(job) -> dict | None:
    entries = ledger.get(job.hash, [])
    own = os.path.abspath(os.path.dirname(os.path.dirname(job.workdir)))
    mine = [e for e in entries if os.path.abspath(e['suite_folder']) == own]
    if mine:
      return mine[-1]
    return entries[-1] if entries and job.measure is None else None

  found = {
    job.key: record(job) for job in plan if not os.path.exists(os.path.join(job.workdir, RESULT))
  }
  restorable = {key for key, entry in found.items() if entry is not None}
  for job in plan:
    if job.parent in restorable and job.key not in restorable and job.key in found:
      restorable.discard(job.parent)
  for job in plan:
    if job.key not in restorable:
      continue
    entry = found[job.key]
    result = dict(entry['result'])
    if os.path.abspath(entry['suite_folder']) != os.path.abspath(
      os.path.dirname(os.path.dirname(job.workdir))
    ):
      result['copied_from'] = os.path.join(entry['suite_folder'], 'runs', entry['run'])
    os.makedirs(job.workdir, exist_ok=True)
    write_result(job.workdir, result)


def _tune(suite: Suite, *, preset: str, extra: dict, tune_seeds: int, out: str, **execute) -> dict:
  """Tune each tuned variant's learning rate on the tuning seeds, widening the grid past an edge
  where the best rate sits: {variant: {'center', 'points', 'best_lr', 'edge', 'complete'}}."""
  grid = suite.lr_grid
  tuned = [v for v in suite.variants if v.tune and not v.starts_from]
  centers = {v.name: resolve(suite, v, preset, 0, extra).train.learning_rate for v in tuned}
  steps = {v.name: grid.steps() for v in tuned}
  seeds = tuning_seeds(tune_seeds)

  def point(v: Variant, k: int) -> list[_Job]:
    lr = grid.lr(centers[v.name], k)
    jobs = []
    for seed in seeds:
      config = resolve(suite, v, preset, seed, {**extra, 'train.learning_rate': lr})
      digest = config_hash(config)
      workdir = os.path.join(out, suite.name, 'runs', f'{v.name}-lr{lr:.3g}-s{seed}-{digest}')
      jobs.append(_Job((v.name, seed, k), v, seed, config, workdir, digest))
    return jobs

  def widens(v: Variant, k: int) -> bool:
    """Training: always; a report of what finished (run=None): where that point finished."""
    return execute['run'] is not None or not _execute(point(v, k), out=out, desc='', **execute)[2]

  while True:
    plan = [job for v in tuned for k in steps[v.name] for job in point(v, k)]
    finished, failed, _ = _execute(plan, out=out, desc=f'suite {suite.name}: lr tuning', **execute)
    summary, grew = {}, False
    for v in tuned:
      losses, points, complete = {}, [], True
      for k in sorted(steps[v.name]):
        done = [finished[v.name, s, k] for s in seeds if (v.name, s, k) in finished]
        complete &= all((v.name, s, k) in finished or (v.name, s, k) in failed for s in seeds)
        if done:
          losses[k] = [r['eval_loss'] for r in done]
        points.append(
          {
            'lr': grid.lr(centers[v.name], k),
            'seeds': [r['seed'] for r in done],
            'eval_loss': [r['eval_loss'] for r in done],
            'diverged_at_step': [r.get('diverged_at_step') for r in done],
            'wall_s': [r.get('wall_s') for r in done if not r.get('copied_from')],
            'failed': sum((v.name, s, k) in failed for s in seeds),
          }
        )
      choice = choose(losses, grid) if complete else None
      if choice is not None and choice.widen is not None and widens(v, choice.widen):
        steps[v.name] = steps[v.name] + [choice.widen]
        grew = True
      summary[v.name] = {
        'center': centers[v.name],
        'points': points,
        'complete': complete,
        'best_lr': None
        if choice is None or choice.best is None
        else grid.lr(centers[v.name], choice.best),
        'edge': None if choice is None else choice.edge,
      }
    if not grew:
      return summary


def run_suite(
  suite: Suite,
  *,
  preset: str,
  seeds: int,
  out: str,
  extra: dict | None = None,
  progress: bool = True,
  run=run_one,
  jobs: int = 1,
  remeasure: bool = False,
  tune_lr: bool = False,
  tune_seeds: int = 1,
  engine: str = 'local',
  ray_address: str | None = None,
  resources: str | None = None,
) -> dict:
  """{'runs': [...], 'failed': [...], 'pending': [...], 'tuning': {...}} for every (variant,
  seed), finished ones read back. run=None runs nothing: a report of what has finished so far.

  tune_lr: first tune every variant's learning rate (experiments/tuning.py) on `tune_seeds`
  tuning seeds (1000, 1001, ...), then run the table's seeds 0..seeds-1 at each variant's best
  rate (a starts_from variant at its parent's).
  remeasure: run the suite's measure again on every finished run (e.g. decode speed, on a quiet
  machine) and update its result.json.
  jobs > 1 runs that many runs at once, each in its own process (`experiments.worker`); a
  starts_from run waits for its parent. Two runs on 2 cores finish in about 0.7 of the time one
  after the other takes, but each one's tokens/s is then that of a shared machine.
  engine='ray' submits every run as a Ray task (experiments/engines.py) with `resources` (JSON;
  default this machine's cores over `jobs`) to the cluster at `ray_address`, or to a local Ray
  started here without one.
  """
  if jobs < 1:
    raise ValueError(f'--jobs={jobs}; allowed: a positive integer')
  if engine not in ('local', 'ray'):
    raise ValueError(f"--engine={engine!r}; allowed: 'local' (--jobs processes here), 'ray'")
  if (jobs > 1 or engine == 'ray') and run not in (run_one, None):
    raise ValueError(
      'jobs > 1 and --engine=ray run run_one in worker processes; a custom `run` needs jobs=1'
    )
  if engine == 'ray':
    check_out_for_ray(out)
    resources = parse_resources(resources, jobs)
  if tune_lr and not tune_seeds >= 1:
    raise ValueError(f'--tune_seeds={tune_seeds}; allowed: a positive integer')
  if tune_lr and seeds > TUNING_SEED_BASE:
    raise ValueError(
      f'--seeds={seeds}; allowed with --tune_lr: at most {TUNING_SEED_BASE} '
      f'(tuning seeds start at {TUNING_SEED_BASE})'
    )
  extra = dict(extra or {})
  order = [(variant, seed) for seed in range(seeds) for variant in suite.variants]
  for variant, seed in order:  # every config checked before anything runs
    resolve(suite, variant, preset, seed, extra)
  borrowed = _borrowed_rates(suite, out) if tune_lr and suite.lr_from else None
  if run is None:  # a report of what has finished: nothing runs, no engine starts
    where = None
  elif engine == 'ray':
    where = RayEngine(resources, ray_address)
  else:
    where = LocalPool(jobs) if jobs > 1 else None
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
      borrowed=borrowed,
      execute=dict(run=run, engine=where, progress=progress, remeasure=remeasure),
    )
  finally:
    if hasattr(where, 'close'):
      where.close()


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
  borrowed: dict | None,
  execute: dict,
) -> dict:
  run = execute['run']
  tuning = (
    _tune(
      suite,
      preset=preset,
      extra=extra,
      tune_seeds=tune_seeds,
      out=out,
      **{**execute, 'remeasure': False},
    )
    if tune_lr and not suite.lr_from
    else {}
  )
  by_name = {v.name: v for v in suite.variants}

  def tuned_lr(variant: Variant) -> dict | None:
    """The learning-rate override of `variant`: its root variant's tuned rate; {} untuned;
    None while that tuning has no answer."""
    while variant.starts_from:
      variant = by_name[variant.starts_from]
    if borrowed is not None:
      return {'train.learning_rate': borrowed[variant.name]}
    if variant.name not in tuning:
      return {}
    best = tuning[variant.name]['best_lr']
    return None if best is None else {'train.learning_rate': best}

  plan, hashes, blocked = [], {}, []
  for variant, seed in order:
    lr = tuned_lr(variant)
    if lr is None:
      blocked.append(_Job((variant.name, seed), variant, seed, None, '', ''))
      continue
    config = resolve(suite, variant, preset, seed, {**extra, **lr})
    parent = (variant.starts_from, seed) if variant.starts_from else None
    hashes[variant.name, seed] = config_hash(config, hashes[parent] if parent else '')
    plan.append(
      _Job(
        (variant.name, seed),
        variant,
        seed,
        config,
        run_dir(out, suite, variant, config, hashes[parent] if parent else ''),
        hashes[variant.name, seed],
        parent,
        suite.extra_metrics,
      )
    )
  finished, failed, pending = _execute(plan, out=out, desc=f'suite {suite.name}', **execute)
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
    **(
      {'tuning': tuning, 'tune_seeds': tuning_seeds(tune_seeds)}
      if tune_lr and not suite.lr_from
      else {}
    ),
    **({'lr_from': {'suite': suite.lr_from, 'rates': borrowed}} if borrowed else {}),
  }


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


def _run_here(job: _Job, run, kwargs, progress, done) -> None:
  """One run in this process, retried once on an exception (e.g. a transient I/O error)."""
  measure = MEASURES[job.measure] if job.measure else None
  errors = []
  for _ in range(2):
    try:
      result = run(job.config, job.workdir, progress=progress, measure=measure, **kwargs)
      done(job, result)
      return
    except KeyboardInterrupt:
      raise
    except Exception as err:  # reported, the suite goes on
      errors.append(f'{type(err).__name__}: {err}')
      with open(os.path.join(job.workdir, ERRORS_LOG), 'a') as f:
        f.write(traceback.format_exc() + '\n')
  done(job, errors=errors)


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
  with open(path) as f:
    table = f.read()
  with open(path, 'w') as f:
    f.write(
      f'# Suite `{suite.name}`: {suite.description}\n\nPreset `{preset}`: `python -m '
      f"{suite.module} {' '.join(suite.presets[preset])}`.\n\n"
      + (f'Paper: {suite.paper_source}.\n\n' if suite.paper_source else '')
      + ('#' + table if table.startswith('# ') else table)
      + '\n![results.png](results.png)\n'
    )
  return path
