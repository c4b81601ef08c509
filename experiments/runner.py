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
import glob
import hashlib
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

from tqdm import tqdm

import mllm
from experiments.measures import MEASURES
from experiments.suite import BenchmarkSuite, Suite, Variant


def resolve(suite: Suite, variant: Variant, preset: str, seed: int, extra: dict | None = None):
  """The validated config of one run."""
  if preset not in suite.presets:
    raise ValueError(f'--preset={preset!r}; allowed: {", ".join(suite.presets)}')
  spec = suite.base
  if variant.choices:
    spec += (',' if ':' in spec else ':') + variant.choices
  overrides = {**suite.presets[preset], **variant.overrides, **(extra or {}), 'seed': seed}
  config = mllm.load_config(spec, overrides)
  if variant.derived is not None:
    config = mllm.load_config(spec, {**overrides, **variant.derived(config)})
  return config


# Keys added to configs/base.py after suites had finished runs, with the value that reproduces
# the code before them: at that value they are left out of the hash, so those runs stay valid.
ADDED_KEYS = {'model.embed_scale': 1.0}


def config_hash(config, parent: str = '') -> str:
  """12 hex digits of the resolved config; a starts_from run adds its parent run's hash, so a
  changed parent is a new child run too."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for path, neutral in ADDED_KEYS.items():
      *where, key = path.split('.')
      node = config
      for name in where:
        node = node[name]
      if key in node and node[key] == neutral:
        del node[key]
  text = config.to_json(sort_keys=True) + (f'\nstarts from {parent}' if parent else '')
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_dir(out: str, suite: Suite, variant: Variant, config, parent: str = '') -> str:
  return os.path.join(out, suite.name, 'runs',
                      f'{variant.name}-s{config.seed}-{config_hash(config, parent)}')


def run_one(config, workdir: str, *, progress: bool = True, measure=None,
            parent: dict | None = None) -> dict:
  """Train and evaluate one run, then `measure(config, workdir)` if given; its result (also
  written to workdir/result.json).

  A run whose loss diverges is a result too: eval_loss NaN and the step it diverged at.
  parent: the finished run (its record) a starts_from variant begins with. With
  config.train.init_from set (trains=True) this run fine-tunes its parameters; without it the
  parent's checkpoint is only evaluated, and measured, under this config.
  """
  from mllm.train import TrainingDiverged, evaluate, train
  start = time.time()
  counts = mllm.count_params(config)  # from an abstract model: nothing allocated
  flops_per_token = mllm.training_flops_per_token(config, counts=counts).total
  result = {'params': counts.total, 'active_params': counts.active,
            'flops_per_token': flops_per_token}
  checkpoint, trained_eval = workdir, None
  if parent is not None and not config.train.init_from:  # evaluated only: nothing trained here
    checkpoint = parent['workdir']
    # .get: a parent finished by an older runner may lack these counts.
    result.update(steps=0, tokens=parent.get('tokens'), train_flops=parent.get('train_flops'),
                  tokens_per_s=None, median_step_s=None, train_loss=None)
  else:
    try:
      summary = train(config, workdir, progress=progress)
    except TrainingDiverged as err:  # a result, not a failure: the same seed diverges again
      result.update(diverged_at_step=err.step, eval_loss=math.nan, steps=err.step,
                    tokens=err.step * config.data.batch_size * config.data.seq_len,
                    train_flops=math.nan, tokens_per_s=None, median_step_s=None,
                    train_loss=math.nan, curve=train_curve(os.path.join(workdir, 'metrics.jsonl')),
                    wall_s=time.time() - start)
      _write_result(workdir, result)
      return result
    if summary['interrupted']:
      raise KeyboardInterrupt(summary['interrupted'])
    tokens = summary['step'] * config.data.batch_size * config.data.seq_len
    result.update(steps=summary['step'], tokens=tokens, train_loss=summary['train_loss'],
                  tokens_per_s=summary['tokens_per_s'], median_step_s=summary['median_step_s'],
                  train_flops=flops_per_token * tokens + (parent['train_flops'] if parent else 0),
                  curve=train_curve(os.path.join(workdir, 'metrics.jsonl')))
    trained_eval = summary['eval']
  # train() evaluated the parameters it saved at its last step, on the same batches: the same
  # numbers as evaluate(config, workdir) (a test holds them equal), without a second compile.
  final = trained_eval or evaluate(config, checkpoint)
  result.update(eval_loss=final['loss'], eval_perplexity=final['perplexity'],
                bits_per_byte=final['bits_per_byte'])
  if parent is not None:
    result['starts_from'] = parent['variant']
  if measure is not None:
    result.update(measure(config, checkpoint))
  # This call's seconds (a resumed run: since it resumed); kept in result.json, so a suite
  # continued later still reports what each run cost.
  result['wall_s'] = time.time() - start
  _write_result(workdir, result)
  return result


def train_curve(metrics_path: str) -> dict:
  """{'step': [...], 'loss': [...]}: the run's logged train losses."""
  from mllm.train.metrics import read_metrics
  records = [r for r in read_metrics(metrics_path) if r['split'] == 'train' and 'loss' in r]
  return {'step': [r['step'] for r in records], 'loss': [r['loss'] for r in records]}


# What run_one itself records (a run adopted from another suite keeps these, not its measures).
_TRAINED_KEYS = ('params', 'active_params', 'flops_per_token', 'steps', 'tokens', 'train_loss',
                 'tokens_per_s', 'median_step_s', 'train_flops', 'curve', 'eval_loss',
                 'eval_perplexity', 'bits_per_byte')


def _read_result(workdir: str) -> dict:
  with open(os.path.join(workdir, 'result.json')) as f:
    result = json.load(f)
  metrics = os.path.join(workdir, 'metrics.jsonl')
  if 'curve' not in result and os.path.exists(metrics):  # finished by an older runner
    result['curve'] = train_curve(metrics)
  if 'train_flops' not in result:  # finished by an older runner
    result['train_flops'] = (result.get('flops_per_token') or 0) * (result.get('tokens') or 0)
  return result


def _write_result(workdir: str, result: dict) -> None:
  with open(os.path.join(workdir, 'result.json.tmp'), 'w') as f:
    json.dump(result, f, indent=1)
  os.replace(os.path.join(workdir, 'result.json.tmp'), os.path.join(workdir, 'result.json'))


def _same_run_elsewhere(out: str, seed: int, digest: str, workdir: str) -> str | None:
  """A finished run of another suite (or variant) with this exact config and seed."""
  for other in sorted(glob.glob(os.path.join(out, '*', 'runs', f'*-s{seed}-{digest}'))):
    if os.path.abspath(other) != os.path.abspath(workdir) and os.path.exists(
        os.path.join(other, 'result.json')) and os.path.isdir(os.path.join(other, 'checkpoints')):
      return other
  return None


def adopt(source: str, config, workdir: str, measure=None) -> dict:
  """Copy a finished identical run into `workdir` instead of training it again; run only this
  suite's measure on it."""
  shutil.copytree(source, workdir, dirs_exist_ok=True,
                  ignore=shutil.ignore_patterns('result.json*', 'errors.log', 'worker.log'))
  result = {k: v for k, v in _read_result(source).items() if k in _TRAINED_KEYS}
  result['copied_from'] = source
  if measure is not None:
    result.update(measure(config, workdir))
  _write_result(workdir, result)
  return result


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


def _start_worker(job: dict, workdir: str) -> subprocess.Popen:
  """`python -m experiments.worker WORKDIR`: one run in its own process, its output in
  WORKDIR/worker.log."""
  with open(os.path.join(workdir, 'job.pkl'), 'wb') as f:
    pickle.dump(job, f)
  log = open(os.path.join(workdir, 'worker.log'), 'a')  # pylint: disable=consider-using-with
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
      [root] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p])}
  return subprocess.Popen([sys.executable, '-m', 'experiments.worker', workdir], stdout=log,
                          stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())


def _last_error(workdir: str) -> str:
  try:
    with open(os.path.join(workdir, 'worker.log')) as f:
      lines = [line.strip() for line in f if line.strip()]
  except OSError:
    return 'the worker left no log'
  errors = [line for line in lines if 'Error' in line.split(':')[0] or
            line.split(':')[0].endswith('Exception')]
  return (errors or lines or ['the worker exited without output'])[-1]


def run_suite(suite: Suite, *, preset: str, seeds: int, out: str, extra: dict | None = None,
              progress: bool = True, run=run_one, jobs: int = 1, remeasure: bool = False) -> dict:
  """{'runs': [...], 'failed': [...], 'pending': [...]} for every (variant, seed), finished ones
  read back. run=None runs nothing: a report of what has finished so far.

  remeasure: run the suite's measure again on every finished run (e.g. decode speed, on a quiet
  machine) and update its result.json.
  jobs > 1 runs that many runs at once, each in its own process (`experiments.worker`); a
  starts_from run waits for its parent. Two runs on 2 cores finish in about 0.7 of the time one
  after the other takes, but each one's tokens/s is then that of a shared machine.
  """
  if jobs < 1:
    raise ValueError(f'--jobs={jobs}; allowed: a positive integer')
  if jobs > 1 and run not in (run_one, None):
    raise ValueError('jobs > 1 runs run_one in worker processes; a custom `run` needs jobs=1')
  plan = [(variant, seed) for seed in range(seeds) for variant in suite.variants]
  configs = [resolve(suite, v, preset, s, extra) for v, s in plan]  # every config checked first
  measure = MEASURES[suite.extra_metrics] if suite.extra_metrics else None
  records, hashes, finished, todo, pending = {}, {}, {}, [], []
  for (variant, seed), config in zip(plan, configs):
    parent_hash = hashes[variant.starts_from, seed] if variant.starts_from else ''
    key = (variant.name, seed)
    hashes[key] = config_hash(config, parent_hash)
    workdir = run_dir(out, suite, variant, config, parent_hash)
    records[key] = {'variant': variant.name, 'seed': seed, 'workdir': workdir,
                    'hash': hashes[key]}
    if os.path.exists(os.path.join(workdir, 'result.json')):
      result = _read_result(workdir)
      if remeasure and measure is not None and 'diverged_at_step' not in result:
        source = finished[variant.starts_from, seed]['workdir'] if (
            variant.starts_from and not variant.trains) else workdir
        result.update(measure(config, source))
        _write_result(workdir, result)
      finished[key] = {**records[key], **result}
    elif run is None:
      pending.append(records[key])
    else:
      todo.append((variant, seed, config))
  failed: dict = {}
  bar = tqdm(total=len(plan), initial=len(plan) - len(todo), desc=f'suite {suite.name}',
             unit='run', disable=not progress, position=0)

  def ready(item) -> bool | None:
    """True: it can start; None: it never can (its parent failed); False: not yet."""
    variant, seed, _ = item
    if not variant.starts_from:
      return True
    parent = (variant.starts_from, seed)
    if parent in failed or 'diverged_at_step' in finished.get(parent, {}):
      return None
    return parent in finished

  def prepare(item) -> tuple[dict, dict]:
    variant, seed, config = item
    workdir = records[variant.name, seed]['workdir']
    kwargs = {}
    if variant.starts_from:
      kwargs['parent'] = finished[variant.starts_from, seed]
      if variant.trains:
        config.train.init_from = f"workdir:{kwargs['parent']['workdir']}"
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'run_config.json'), 'w') as f:
      f.write(config.to_json(sort_keys=True, indent=1))
    return kwargs

  def done(item, result=None, errors=None):
    variant, seed, _ = item
    key = (variant.name, seed)
    if result is not None:
      finished[key] = {**records[key], **result}
    else:
      failed[key] = {**records[key], 'errors': errors}
      bar.write(f'run {variant.name} seed {seed} failed: {errors[-1]}')
    bar.update(1)

  def adopted(item) -> bool:
    """An identical finished run elsewhere under `out` is copied, not trained again."""
    variant, seed, config = item
    workdir = records[variant.name, seed]['workdir']
    if variant.starts_from or os.path.isdir(os.path.join(workdir, 'checkpoints')):
      return False  # a child depends on its parent's path; a started run resumes instead
    source = _same_run_elsewhere(out, seed, hashes[variant.name, seed], workdir)
    if source is None:
      return False
    bar.write(f'run {variant.name} seed {seed}: the same config and seed finished in {source}; '
              'copied, not trained again')
    done(item, adopt(source, config, workdir, measure))
    return True

  running = {}  # Popen -> (item, job, attempt)
  try:
    with _sigterm_as_interrupt():
      while todo or running:
        blocked = [item for item in todo if ready(item) is None]
        for item in blocked:
          todo.remove(item)
          done(item, errors=[f'its starts_from run {item[0].starts_from} seed {item[1]} did not '
                             'finish'])
        startable = [item for item in todo if ready(item)]
        if startable and len(running) < jobs:
          item = startable[0]
          todo.remove(item)
          kwargs = prepare(item)
          if adopted(item):
            continue
          workdir = records[item[0].name, item[1]]['workdir']
          if jobs == 1:
            _run_here(item, workdir, run, kwargs, progress, measure, done)
          else:
            job = {'config': item[2], 'measure': suite.extra_metrics, **kwargs}
            running[_start_worker(job, workdir)] = (item, job, 1)
          continue
        if not running:
          break
        time.sleep(1)
        for proc in [p for p in running if p.poll() is not None]:
          item, job, attempt = running.pop(proc)
          workdir = records[item[0].name, item[1]]['workdir']
          if proc.returncode == 0 and os.path.exists(os.path.join(workdir, 'result.json')):
            done(item, _read_result(workdir))
          elif attempt == 1:  # a failed run is retried once
            running[_start_worker(job, workdir)] = (item, job, 2)
          else:
            done(item, errors=[_last_error(workdir)])
  except KeyboardInterrupt:
    for proc in running:  # train() saves a checkpoint on SIGTERM: the next call resumes it
      proc.terminate()
    for proc in running:
      proc.wait()
    raise
  finally:
    bar.close()
  order = [(v.name, s) for v, s in plan]
  return {'suite': suite.name, 'preset': preset, 'seeds': seeds,
          'runs': [finished[k] for k in order if k in finished],
          'failed': [failed[k] for k in order if k in failed], 'pending': pending}


def _run_here(item, workdir, run, kwargs, progress, measure, done) -> None:
  """One run in this process, retried once on an exception (e.g. a transient I/O error)."""
  config = item[2]
  errors = []
  for _ in range(2):
    try:
      result = run(config, workdir, progress=progress, measure=measure, **kwargs)
      done(item, result)
      return
    except KeyboardInterrupt:
      raise
    except Exception as err:  # pylint: disable=broad-except  (reported, the suite goes on)
      errors.append(f'{type(err).__name__}: {err}')
      with open(os.path.join(workdir, 'errors.log'), 'a') as f:
        f.write(traceback.format_exc() + '\n')
  done(item, errors=errors)


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
      [*suite.presets[preset], f'--out={path}', f"--plot={os.path.join(folder, 'results.png')}"])
  with open(path) as f:
    table = f.read()
  with open(path, 'w') as f:
    f.write(f'# Suite `{suite.name}`: {suite.description}\n\nPreset `{preset}`: `python -m '
            f"{suite.module} {' '.join(suite.presets[preset])}`.\n\n"
            + (f'Paper: {suite.paper_source}.\n\n' if suite.paper_source else '')
            + ('#' + table if table.startswith('# ') else table)
            + '\n![results.png](results.png)\n')
  return path
