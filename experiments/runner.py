"""Run a suite: every (variant, seed) through the same `train` and `evaluate` as launch.py.

- A run's directory is <out>/<suite>/runs/<variant>-s<seed>-<hash>, the hash of its resolved
  config (seed included), so a changed config never reuses an old run.
- A run with result.json is finished and skipped; a killed run resumes from its checkpoint
  (train() resumes its workdir); a failed run is retried once, then reported and left out.
- Paired seeds: seed index i sets config.seed = i for every variant, which fixes both the data
  order and the initialisation, so the variants' differences are paired.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import traceback

from tqdm import tqdm

import mllm
from experiments.measures import MEASURES
from experiments.suite import Suite, Variant


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


def config_hash(config) -> str:
  return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:12]


def run_dir(out: str, suite: Suite, variant: Variant, config) -> str:
  return os.path.join(out, suite.name, 'runs', f'{variant.name}-s{config.seed}-{config_hash(config)}')


def run_one(config, workdir: str, *, progress: bool = True, measure=None) -> dict:
  """Train and evaluate one run, then `measure(config, workdir)` if given; its result (also
  written to workdir/result.json)."""
  from mllm.train import evaluate, train
  summary = train(config, workdir, progress=progress)
  if summary['interrupted']:
    raise KeyboardInterrupt(summary['interrupted'])
  final = evaluate(config, workdir)
  counts = mllm.count_params(config)  # from an abstract model: nothing allocated
  result = {'eval_loss': final['loss'], 'eval_perplexity': final['perplexity'],
            'bits_per_byte': final['bits_per_byte'], 'train_loss': summary['train_loss'],
            'tokens_per_s': summary['tokens_per_s'], 'median_step_s': summary['median_step_s'],
            'params': counts.total, 'active_params': counts.active, 'steps': summary['step'],
            'flops_per_token': mllm.training_flops_per_token(config, counts=counts).total,
            'tokens': summary['step'] * config.data.batch_size * config.data.seq_len,
            'curve': train_curve(os.path.join(workdir, 'metrics.jsonl'))}
  if measure is not None:
    result.update(measure(config, workdir))
  with open(os.path.join(workdir, 'result.json.tmp'), 'w') as f:
    json.dump(result, f, indent=1)
  os.replace(os.path.join(workdir, 'result.json.tmp'), os.path.join(workdir, 'result.json'))
  return result


def train_curve(metrics_path: str) -> dict:
  """{'step': [...], 'loss': [...]}: the run's logged train losses."""
  from mllm.train.metrics import read_metrics
  records = [r for r in read_metrics(metrics_path) if r['split'] == 'train' and 'loss' in r]
  return {'step': [r['step'] for r in records], 'loss': [r['loss'] for r in records]}


def run_suite(suite: Suite, *, preset: str, seeds: int, out: str, extra: dict | None = None,
              progress: bool = True, run=run_one) -> dict:
  """{'runs': [...], 'failed': [...], 'pending': [...]} for every (variant, seed), finished ones
  read back. run=None runs nothing: a report of what has finished so far."""
  plan = [(variant, seed) for seed in range(seeds) for variant in suite.variants]
  configs = [resolve(suite, v, preset, s, extra) for v, s in plan]  # every config checked first
  runs, failed, pending = [], [], []
  measure = MEASURES[suite.extra_metrics] if suite.extra_metrics else None
  bar = tqdm(total=len(plan), desc=f'suite {suite.name}', unit='run', disable=not progress,
             position=0)
  for (variant, seed), config in zip(plan, configs):
    workdir = run_dir(out, suite, variant, config)
    done = os.path.join(workdir, 'result.json')
    record = {'variant': variant.name, 'seed': seed, 'workdir': workdir,
              'hash': config_hash(config)}
    if os.path.exists(done):
      with open(done) as f:
        result = json.load(f)
      metrics = os.path.join(workdir, 'metrics.jsonl')
      if 'curve' not in result and os.path.exists(metrics):  # finished by an older runner
        result['curve'] = train_curve(metrics)
      runs.append({**record, **result})
      bar.update(1)
      continue
    if run is None:
      pending.append(record)
      bar.update(1)
      continue
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'run_config.json'), 'w') as f:
      f.write(config.to_json(sort_keys=True, indent=1))
    errors = []
    for _ in range(2):  # a failed run is retried once (e.g. a transient I/O error)
      start = time.time()
      try:
        runs.append({**record, **run(config, workdir, progress=progress, measure=measure),
                     'wall_s': time.time() - start})
        break
      except KeyboardInterrupt:
        raise
      except Exception as err:  # pylint: disable=broad-except  (reported, the suite goes on)
        errors.append(f'{type(err).__name__}: {err}')
        with open(os.path.join(workdir, 'errors.log'), 'a') as f:
          f.write(traceback.format_exc() + '\n')
    else:
      failed.append({**record, 'errors': errors})
      bar.write(f'run {variant.name} seed {seed} failed twice: {errors[-1]}')
    bar.update(1)
  bar.close()
  return {'suite': suite.name, 'preset': preset, 'seeds': seeds, 'runs': runs, 'failed': failed,
          'pending': pending}
