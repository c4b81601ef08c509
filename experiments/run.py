"""One run of a suite: its directory, named by the hash of its resolved config; training and
evaluation through the same `train` and `evaluate` as launch.py; the suite's measure; result.json.
A finished run of another suite with the same config is copied (`adopt`), not trained again.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import shutil
import time

import mllm
from experiments import provenance
from experiments.run_files import ERRORS_LOG, RESULT, WORKER_LOG
from experiments.suite import Suite, Variant
from mllm.config_versions import VERSION, VERSION_KEY, written_in, written_in_each
from mllm.paths import RunDir


@dataclasses.dataclass
class Job:
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
  # {older config version: its hash then}, by which ledger lines written under it name it
  older: dict = dataclasses.field(default_factory=dict)

  def identities(self) -> dict[int, str]:
    """{config version: this run's hash under it}: a ledger line of any of them is this run."""
    return {VERSION: self.hash, **self.older}

  def record(self) -> dict:
    return {
      'variant': self.variant.name,
      'seed': self.seed,
      'workdir': self.workdir,
      'hash': self.hash,
      **({'older': {str(v): h for v, h in self.older.items()}} if self.older else {}),
    }


SUITE_RATE = 'model.parametrization.standard.lr_base_d_model=none'


def resolve(suite: Suite, variant: Variant, preset: str, seed: int, extra: dict | None = None):
  """The validated config of one run."""
  if preset not in suite.presets:
    raise ValueError(f'--preset={preset!r}; allowed: {", ".join(suite.presets)}')
  # Every suite row's rate is its own (tuned, or set by the suite): the standard parametrization
  # takes it as given, as every committed run trained (config version 6 made the default config
  # scale it with the width). A variant that chooses so overrides it.
  spec = suite.base + (',' if ':' in suite.base else ':') + SUITE_RATE
  if variant.choices:
    spec += ',' + variant.choices
  overrides = {**suite.presets[preset], **variant.overrides, **(extra or {}), 'seed': seed}
  config = mllm.load_config(spec, overrides)
  if variant.derived is not None:
    config = mllm.load_config(spec, {**overrides, **variant.derived(config)})
  return config


# Keys added to configs/base.py after suites had finished runs, with the value that reproduces
# the code before them: at that value version 1's identity left them out, so those runs stayed
# valid. (Version 2's identity has every key.)
V1_ADDED_KEYS = {'model.embed_scale': 1.0, 'model.init': 'fixed', 'model.scan_unroll': 1}


def _digest(tree: dict, parent: str) -> str:
  text = json.dumps(tree, sort_keys=True) + (f'\nstarts from {parent}' if parent else '')
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def as_json(config) -> dict:
  """The config as JSON data (ml_collections' own encoder: placeholders, tuples, ...)."""
  return json.loads(config.to_json(sort_keys=True))


def config_hash(config, parent: str = '') -> str:
  """12 hex digits of the run's identity: its resolved config, every key explicit, with the
  schema's version (mllm/config_versions.py); a starts_from run adds its parent run's hash, so a
  changed parent is a new child run too."""
  return _digest({VERSION_KEY: VERSION, **as_json(config)}, parent)


def older_hashes(config, parents: dict[int, str] | None = None) -> dict[int, str]:
  """{version: the identity each older config version gave the same config} (`parents`: a
  starts_from run's parent's, by version): how the runs a suite recorded before are found."""
  parents = parents or {}
  shapes = written_in_each(as_json(config))
  out = {1: _v1_digest_of(shapes[1], parents.get(1, ''))}
  for version in range(2, VERSION):
    out[version] = _digest({VERSION_KEY: version, **shapes[version]}, parents.get(version, ''))
  return out


def v1_hash(config, parent: str = '') -> str:
  """The identity version 1 gave the same config (`parent`: the parent's version 1 hash): the
  config in version 1's shape without the keys version 1 left out at their old value."""
  return _v1_digest(as_json(config), parent)


def _v1_digest(tree: dict, parent: str) -> str:
  return _v1_digest_of(written_in(tree, 1), parent)


def _v1_digest_of(tree: dict, parent: str) -> str:
  """The version 1 identity of a config already in version 1's shape (`tree`, changed here)."""
  for path, neutral in V1_ADDED_KEYS.items():
    *where, key = path.split('.')
    node = tree
    for name in where:
      node = node[name]
    if key in node and node[key] == neutral:
      del node[key]
  return _digest(tree, parent)


def run_folder(runs: str, name: str, digest: str, older: dict | None = None) -> str:
  """The folder of run `name` (e.g. 'relu-s0') in a suite's `runs` folder: named by its hash, or
  by an older version's hash (`older`) where a run started under it left one to resume."""
  for h in (older or {}).values():
    if os.path.isdir(os.path.join(runs, f'{name}-{h}')):
      return os.path.join(runs, f'{name}-{h}')
  return os.path.join(runs, f'{name}-{digest}')


def run_dir(out: str, suite: Suite, variant: Variant, config, parent: str = '') -> str:
  """A table run's folder (`parent`: a starts_from run's parent hash)."""
  runs = os.path.join(out, suite.name, 'runs')
  return run_folder(runs, f'{variant.name}-s{config.seed}', config_hash(config, parent))


def run_one(
  config, workdir: str, *, progress: bool = True, measure=None, parent: dict | None = None
) -> dict:
  """Train and evaluate one run, then `measure(config, workdir)` if given; its result (also
  written to workdir/result.json).

  A run whose loss diverges is a result too: eval_loss NaN and the step it diverged at.
  parent: the finished run (its record) a starts_from variant begins with. With
  config.train.init_from set (trains=True) this run fine-tunes its parameters; without it the
  parent's checkpoint is only evaluated, and measured, under this config.
  """
  from mllm.train import TrainingDiverged, evaluate, train

  start = time.time()
  result = _counts(config)
  result['provenance'] = provenance.current()
  checkpoint, trained_eval = workdir, None
  if parent is not None and not config.train.init_from:  # evaluated only: nothing trained here
    checkpoint = parent['workdir']
    result.update(_parent_counts(parent))
  else:
    try:
      summary = train(config, workdir, progress=progress)
    except TrainingDiverged as err:  # a result, not a failure: the same seed diverges again
      result.update(_diverged(config, workdir, err.step, start))
      write_result(workdir, result)
      return result
    trained_eval = _add_training(result, config, workdir, summary, parent)
  # train() evaluated the parameters it saved at its last step, on the same batches: the same
  # numbers as evaluate(config, workdir) (a test holds them equal), without a second compile.
  result.update(_final_eval(trained_eval or evaluate(config, checkpoint)))
  if parent is not None:
    result['starts_from'] = parent['variant']
  if measure is not None:
    result.update(measure(config, checkpoint))
  # This call's seconds (a resumed run: since it resumed); kept in result.json, so a suite
  # continued later still reports what each run cost.
  result['wall_s'] = time.time() - start
  write_result(workdir, result)
  return result


def run_population(
  configs: list, workdirs: list[str], *, progress: bool = True, measure=None
) -> list[dict]:
  """Train runs that differ only in seed and learning rate as one population
  (mllm/train/population_loop.py), then record each as `run_one` records a run (its counts,
  provenance, curve, evaluation, measure, result.json): a suite's ledger and reports see
  ordinary runs."""
  from mllm.config import config_diff
  from mllm.train.population import Member
  from mllm.train.population_loop import train_population

  start = time.time()
  members = [Member(c.seed, c.train.learning_rate) for c in configs]
  base = configs[0]
  for config, member in zip(configs, members):
    differs = config_diff(config, member.config(base))
    if differs:
      key = next(iter(differs))
      raise ValueError(
        f'{key}={differs[key][1]!r}: the runs of a population differ in seed and '
        f'train.learning_rate only (the first run has {differs[key][0]!r})'
      )
  summaries = train_population(base, members, workdirs, progress=progress)
  results = []
  for config, workdir, summary in zip(configs, workdirs, summaries):
    result = _counts(config)
    result['provenance'] = provenance.current()
    if summary['diverged'] is not None:
      result.update(_diverged(config, workdir, summary['diverged']['step'], start))
    else:
      result.update(_final_eval(_add_training(result, config, workdir, summary, None)))
      if measure is not None:
        result.update(measure(config, workdir))
      result['wall_s'] = time.time() - start  # the population's: its members trained together
    write_result(workdir, result)
    results.append(result)
  return results


def _final_eval(final: dict) -> dict:
  """A result's keys of its final evaluation."""
  return dict(
    eval_loss=final['loss'],
    eval_perplexity=final['perplexity'],
    bits_per_byte=final['bits_per_byte'],
    # Wortsman et al. 2023's instability measures, at the end (a checkpoint evaluated by code
    # older than them has neither).
    eval_log_z=final.get('log_z'),
    max_attention_logit=final.get('max_attention_logit'),
  )


def _counts(config) -> dict:
  """The run's parameter and FLOP counts and its learning rate: a result's first keys."""
  counts = mllm.count_params(config)  # from an abstract model: nothing allocated
  return {
    'params': counts.total,
    'active_params': counts.active,
    'flops_per_token': mllm.training_flops_per_token(config, counts).total,
    'learning_rate': config.train.learning_rate,
  }


def _parent_counts(parent: dict) -> dict:
  """What a run that only evaluates its parent's parameters records of training: the parent's."""
  # .get: a parent finished by an older runner may lack these counts.
  return dict(
    steps=0,
    tokens=parent.get('tokens'),
    train_flops=parent.get('train_flops'),
    tokens_per_s=None,
    median_step_s=None,
    train_loss=None,
  )


def _diverged(config, workdir: str, step: int, start: float) -> dict:
  """The result keys of a run whose loss diverged at `step`."""
  return dict(
    diverged_at_step=step,
    eval_loss=math.nan,
    steps=step,
    tokens=step * config.data.batch_size * config.data.seq_len,
    train_flops=math.nan,
    tokens_per_s=None,
    median_step_s=None,
    train_loss=math.nan,
    curve=train_curve(RunDir(workdir).metrics),
    wall_s=time.time() - start,
  )


def _add_training(
  result: dict, config, workdir: str, summary: dict, parent: dict | None
) -> dict | None:
  """Add what train() reported and logged to `result`; its final evaluation."""
  if summary['interrupted']:
    raise KeyboardInterrupt(summary['interrupted'])
  tokens = summary['step'] * config.data.batch_size * config.data.seq_len
  result.update(
    steps=summary['step'],
    tokens=tokens,
    train_loss=summary['train_loss'],
    tokens_per_s=summary['tokens_per_s'],
    median_step_s=summary['median_step_s'],
    train_flops=result['flops_per_token'] * tokens + (parent['train_flops'] if parent else 0),
    curve=train_curve(RunDir(workdir).metrics),
  )
  evals = train_curve(RunDir(workdir).metrics, 'eval')
  if len(evals['step']) > 1:  # evaluated during training too (train.eval_every)
    result['eval_curve'] = evals
  return summary['eval']


def train_curve(metrics_path: str, split: str = 'train') -> dict:
  """{'step': [...], 'loss': [...]}: the run's logged train (or eval) losses."""
  from mllm.train.metrics import read_metrics

  records = [r for r in read_metrics(metrics_path) if r['split'] == split and 'loss' in r]
  return {'step': [r['step'] for r in records], 'loss': [r['loss'] for r in records]}


# What run_one itself records (a run adopted from another suite keeps these, not its measures).
TRAINED_KEYS = (
  'params',
  'active_params',
  'flops_per_token',
  'learning_rate',
  'steps',
  'tokens',
  'train_loss',
  'tokens_per_s',
  'median_step_s',
  'train_flops',
  'curve',
  'eval_curve',
  'eval_loss',
  'eval_perplexity',
  'bits_per_byte',
  'provenance',
)


def read_result(workdir: str) -> dict:
  with open(os.path.join(workdir, RESULT)) as f:
    result = json.load(f)
  metrics = RunDir(workdir).metrics
  if 'curve' not in result and os.path.exists(metrics):  # finished by an older runner
    result['curve'] = train_curve(metrics)
  if 'train_flops' not in result:  # finished by an older runner
    result['train_flops'] = (result.get('flops_per_token') or 0) * (result.get('tokens') or 0)
  return result


def write_result(workdir: str, result: dict) -> None:
  with open(os.path.join(workdir, RESULT + '.tmp'), 'w') as f:
    json.dump(result, f, indent=1)
  os.replace(os.path.join(workdir, RESULT + '.tmp'), os.path.join(workdir, RESULT))


def _same_runs(out: str, seed: int, digests) -> list[str]:
  """The run folders under `out` of this seed named by any of `digests` (a run's hashes under
  each config version), in order of the hashes, then of the folders."""
  return [
    folder
    for digest in digests
    for folder in sorted(glob.glob(os.path.join(out, '*', 'runs', f'*-s{seed}-{digest}')))
  ]


def same_run_elsewhere(out: str, seed: int, digests, workdir: str) -> str | None:
  """A finished run of another suite (or variant) with this exact config and seed (`digests`:
  its hashes under each config version)."""
  for other in _same_runs(out, seed, digests):
    if (
      os.path.abspath(other) != os.path.abspath(workdir)
      and os.path.exists(os.path.join(other, RESULT))
      and os.path.isdir(RunDir(other).checkpoints)
    ):
      return other
  return None


def same_run_in_progress(
  out: str, seed: int, digests, planned: set[str], fresh_s: float
) -> str | None:
  """An unfinished run of this exact config and seed outside `planned` (this plan's own run
  folders, absolute) whose folder changed in the last `fresh_s` seconds: another process is
  training it now (a run writes its metrics every few seconds; a killed one goes stale)."""
  now = time.time()
  for other in _same_runs(out, seed, digests):
    if os.path.abspath(other) in planned or os.path.exists(os.path.join(other, RESULT)):
      continue
    with os.scandir(other) as entries:
      newest = max((e.stat().st_mtime for e in entries), default=0.0)
    if now - newest < fresh_s:
      return other
  return None


def adopt(source: str, config, workdir: str, measure=None) -> dict:
  """Copy a finished identical run into `workdir` instead of training it again; run only this
  suite's measure on it."""
  shutil.copytree(
    source,
    workdir,
    dirs_exist_ok=True,
    ignore=shutil.ignore_patterns(RESULT + '*', ERRORS_LOG, WORKER_LOG),
  )
  result = {k: v for k, v in read_result(source).items() if k in TRAINED_KEYS}
  result['copied_from'] = source
  if measure is not None:
    result.update(measure(config, workdir))
  write_result(workdir, result)
  return result
