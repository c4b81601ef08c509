"""python -m experiments.reproduce SUITE [--steps=30] [--out=experiments/results]

Whether a table that mixes code versions still pairs its rows: for each code version in the
suite's results other than this process's, its first run is trained again here for its first
`steps` steps (same config and seed: the same initial weights and batches if the two versions
compute the same thing) and its logged train losses are compared with the recorded ones. Each
check is appended to <out>/<suite>/reproduced.jsonl; the report's provenance line states it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from experiments import provenance
from experiments.run import config_hash, resolve, train_curve
from experiments.suite import Suite, load_suite
from mllm.paths import RunDir

CHECKS = 'reproduced.jsonl'
# Logged losses carry 5-6 significant digits; a different draw differs by ~1e-2 at step 10.
TOLERANCE = 1e-3


def check(suite: Suite, results: dict, out: str, steps: int, extra: dict | None = None) -> list:
  """Train each older code version's first run of `results` again for `steps` steps under this
  code: one record per version ({'run', 'from', 'under', 'steps', 'max_abs_diff', 'same'} or,
  where the run's config no longer resolves to its hash, 'error'), appended to CHECKS."""
  from mllm.train import train

  here = provenance.current()
  variants = {v.name: v for v in suite.variants}
  checks = []
  for key, records in provenance.by_version(results['runs']).items():
    if key == provenance.key(here):
      continue
    run = next(
      r
      for r in results['runs']
      if provenance.key(r.get('provenance')) == key and not variants[r['variant']].starts_from
    )
    config = resolve(
      suite,
      variants[run['variant']],
      results['preset'],
      run['seed'],
      {**(extra or {}), 'train.learning_rate': run['learning_rate']},
    )
    record = {
      'run': f"{run['variant']} seed {run['seed']}",
      'from': records[0],
      'from_key': list(key),
      'under': here,
      'under_key': list(provenance.key(here)),
    }
    if config_hash(config) != run['hash']:
      record['error'] = f"its config no longer resolves to hash {run['hash']}"
    else:
      with tempfile.TemporaryDirectory() as workdir:
        train(config, workdir, stop_after=steps, progress=False)
        again = train_curve(RunDir(workdir).metrics)
      recorded = dict(zip(run['curve']['step'], run['curve']['loss']))
      diffs = {
        s: abs(x - recorded[s]) for s, x in zip(again['step'], again['loss']) if s in recorded
      }
      if not diffs:
        record['error'] = f'no logged step in the first {steps} to compare'
      else:
        worst = max(diffs, key=diffs.get)
        record.update(
          steps=sorted(diffs),
          max_abs_diff=diffs[worst],
          at_step=worst,
          same=diffs[worst] <= TOLERANCE,
        )
    checks.append(record)
  os.makedirs(os.path.join(out, suite.name), exist_ok=True)
  with open(os.path.join(out, suite.name, CHECKS), 'a') as f:
    f.writelines(json.dumps(c) + '\n' for c in checks)
  return checks


def read(folder: str) -> list[dict]:
  """The checks recorded in a suite's folder (none if it has no CHECKS file)."""
  path = os.path.join(folder, CHECKS)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def sentence(record: dict) -> str:
  """One check, as the report's provenance line states it."""
  older, newer = provenance.label(record['from']), provenance.label(record['under'])
  if 'error' in record:
    return f"{record['run']} of {older} could not be checked under {newer}: {record['error']}."
  steps = f"steps {record['steps'][0]}-{record['steps'][-1]}"
  if record['same']:
    return (
      f"{record['run']} of {older}, trained again under {newer}, logs the same train loss at "
      f"{steps} (largest difference {record['max_abs_diff']:.5f}): the same initial weights and "
      'batches, so its runs pair with that version\'s.'
    )
  return (
    f"{record['run']} of {older}, trained again under {newer}, logs a different train loss "
    f"(by {record['max_abs_diff']:.4f} at step {record['at_step']}): the two versions draw "
    'differently, so rows across them are not paired.'
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m experiments.reproduce', description=__doc__)
  parser.add_argument('suite')
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--out', default='experiments/results')
  args = parser.parse_args(argv)
  try:
    if args.steps < 1:
      raise ValueError(f'--steps={args.steps}; allowed: a positive integer')
    suite = load_suite(args.suite)
    path = os.path.join(args.out, args.suite, 'results.json')
    if not os.path.exists(path):
      raise ValueError(f'suite {args.suite!r} has no results ({path}); allowed: a suite that ran')
    with open(path) as f:
      results = json.load(f)
  except ValueError as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  checks = check(suite, results, args.out, args.steps)
  for record in checks:
    print(sentence(record))
  if not checks:
    print(f'suite {args.suite!r}: every run comes from this code version; nothing to check')
  return 0


if __name__ == '__main__':
  sys.exit(main())
