"""python -m experiments.reproduce SUITE [--steps=30] [--out=experiments/results]

Whether a table that mixes code versions still pairs its rows: for each code version in the
suite's results other than this process's, its first run is trained again here for its first
`steps` steps (same config and seed: the same initial weights and batches if the two versions
compute the same thing) and its logged train losses are compared with the recorded ones. Each
check is appended to <out>/<suite>/reproduced.jsonl; the report's provenance line states it.

--code_of=COMMIT trains them under that commit's code instead (a git worktree of it, its own
experiments/ resolving the config, this process's packages): versions that both reproduce under
one commit's code pair with each other, which links older versions that today's code draws
differently from. Run under another environment (another venv's python), it checks whether a
version is that environment's: the runs recorded before provenance was kept reproduce under
Python 3.11 and jax 0.10.2 (the Makefile's choice then), not under Python 3.13 and jax 0.12.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import json
import os
import subprocess
import sys
import tempfile

from experiments import ledger, provenance
from experiments.engines import pythonpath
from experiments.run import config_hash, older_hashes, resolve, train_curve
from experiments.suite import Suite, load_suite
from mllm.paths import RunDir

CHECKS = 'reproduced.jsonl'
# Logged losses carry 5-6 significant digits; a different draw differs by ~1e-2 at step 10.
TOLERANCE = 1e-3


def check(
  suite: Suite,
  results: dict,
  out: str,
  steps: int,
  extra: dict | None = None,
  code_of: str | None = None,
) -> list:
  """Train each older code version's first run of `results` again for `steps` steps under this
  code (or under commit `code_of`'s: every version's): one record per version ({'run', 'from',
  'under', 'steps', 'max_abs_diff', 'same', 'same_draw'} or, where the run's config no longer
  resolves to its hash or the training failed, 'error'), appended to CHECKS."""
  extra = extra or {}
  if code_of is None:
    here = provenance.current()
    trainer = _trainer_here(suite, results['preset'], extra, steps)
    return _check(suite, results, out, steps, here, trainer, skip=provenance.key(here))
  with _worktree(code_of) as root:
    code, sha = provenance.code_digest(root), os.path.basename(root)
    under = {**provenance.current(), 'code': code, 'commit': sha, 'dirty': False}
    trainer = _trainer_at(root, suite.name, results['preset'], extra, steps)
    return _check(suite, results, out, steps, under, trainer, skip=None)


def _check(suite: Suite, results: dict, out: str, steps: int, under: dict, trainer, skip) -> list:
  """check()'s loop: each version's (but `skip`'s) first run trained again by `trainer` (run ->
  (curve, None) or (None, why not)) and compared with its recorded curve."""
  checks = []
  for key, records in provenance.by_version(results['runs']).items():
    run = None if key == skip else _first_run(suite, results, key)
    if run is None:  # this code's own, only starts_from children, or from before curves were kept
      continue
    record = {'run': f"{run['variant']} seed {run['seed']}", 'from': records[0], 'under': under}
    curve, error = trainer(run)
    compared = curve is not None and _compare(curve, run['curve'])
    missing = {'error': f'no logged step in the first {steps} to compare'}
    record.update({'error': error} if error else compared or missing)
    checks.append(record)
  return _append(out, suite, checks)


def _trainer_here(suite: Suite, preset: str, extra: dict, steps: int):
  """Trains a run again in this process, under this code."""
  from mllm.train import train

  variants = {v.name: v for v in suite.variants}

  def trainer(run: dict):
    lr = {'train.learning_rate': run['learning_rate']}
    config = resolve(suite, variants[run['variant']], preset, run['seed'], {**extra, **lr})
    if run['hash'] not in {config_hash(config), *older_hashes(config).values()}:
      return None, f"its config no longer resolves to hash {run['hash']}"
    with tempfile.TemporaryDirectory() as workdir:
      train(config, workdir, stop_after=steps, progress=False)
      return train_curve(RunDir(workdir).metrics), None

  return trainer


def _append(out: str, suite: Suite, checks: list) -> list:
  os.makedirs(os.path.join(out, suite.name), exist_ok=True)
  with open(os.path.join(out, suite.name, CHECKS), 'a') as f:
    f.writelines(json.dumps(c) + '\n' for c in checks)
  return checks


def _first_run(suite: Suite, results: dict, key: tuple) -> dict | None:
  """The first table run (not a starts_from child) of the code version `key` that logged a train
  curve; None if it has none."""
  children = {v.name for v in suite.variants if v.starts_from}
  return next(
    (
      r
      for r in results['runs']
      if provenance.key(r.get('provenance')) == key
      and r['variant'] not in children
      and r.get('curve')
    ),
    None,
  )


# Run in a worktree of an older commit, with its own experiments/ and mllm/ first on sys.path:
# resolves the run's config as that code did, checks its hash, trains `steps` steps, prints the
# logged train losses. Written for every experiments/ layout since suites kept ledgers.
_AT_COMMIT = r"""
import json, os, sys, tempfile
job = json.loads(sys.argv[1])
import mllm
assert os.path.abspath(mllm.__file__).startswith(os.getcwd()), mllm.__file__
try:
  from experiments.run import config_hash, resolve
except ImportError:
  from experiments.runner import config_hash, resolve
from experiments.suite import load_suite
from mllm.train import train
suite = load_suite(job['suite'])
variant = next(v for v in suite.variants if v.name == job['variant'])
config = resolve(suite, variant, job['preset'], job['seed'], job['extra'])
if config_hash(config) not in job['hashes']:  # its identity under that commit's config version
  print('RESULT' + json.dumps({'error': f"its config resolves to hash {config_hash(config)} there"}))
  sys.exit(0)
with tempfile.TemporaryDirectory() as workdir:
  train(config, workdir, stop_after=job['steps'], progress=False)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if line.strip()]
train_rows = [r for r in rows if r.get('split') == 'train']
curve = {'step': [r['step'] for r in train_rows], 'loss': [r['loss'] for r in train_rows]}
print('RESULT' + json.dumps({'curve': curve}))
"""


@contextlib.contextmanager
def _worktree(commit: str):
  """A git worktree of `commit` in a temporary folder named by its 12-digit sha; removed after."""
  sha = provenance.git('rev-parse', '--verify', '--short=12', f'{commit}^{{commit}}')
  if not sha:
    raise ValueError(f'--code_of={commit}: not a commit of this repository')
  with tempfile.TemporaryDirectory() as parent:
    root = os.path.join(parent, sha)
    added = subprocess.run(
      ['git', '-C', provenance.ROOT, 'worktree', 'add', '--detach', root, sha],
      capture_output=True,
      text=True,
    )
    if added.returncode != 0:
      why = (added.stderr.strip().splitlines() or ['no output'])[-1]
      raise ValueError(f'--code_of={commit}: git could not check it out ({why})')
    try:
      yield root
    finally:
      subprocess.run(
        ['git', '-C', provenance.ROOT, 'worktree', 'remove', '--force', root], capture_output=True
      )
      subprocess.run(['git', '-C', provenance.ROOT, 'worktree', 'prune'], capture_output=True)


def _trainer_at(root: str, suite: str, preset: str, extra: dict, steps: int):
  """Trains a run again in a subprocess under the code of the worktree `root` (_AT_COMMIT)."""

  def trainer(run: dict):
    job = {
      'suite': suite,
      'variant': run['variant'],
      'preset': preset,
      'seed': run['seed'],
      'hashes': [run['hash'], *run.get('older', {}).values()],
      'steps': steps,
      'extra': {**extra, 'train.learning_rate': run['learning_rate']},
    }
    done = subprocess.run(
      [sys.executable, '-c', _AT_COMMIT, json.dumps(job)],
      cwd=root,
      # This process holds the device too (provenance.current()): no preallocation on a GPU.
      env={**os.environ, 'PYTHONPATH': pythonpath(root), 'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'},
      capture_output=True,
      text=True,
    )
    found = [line[6:] for line in done.stdout.splitlines() if line.startswith('RESULT')]
    if not found:
      tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
      return None, f'it failed under that code ({tail})'
    trained = json.loads(found[0])
    return trained.get('curve'), trained.get('error')

  return trainer


def _compare(curve: dict, reference: dict, first: int | None = None) -> dict | None:
  """Two train-loss curves ({'step', 'loss'}) at the steps both logged (the `first` of them):
  {'steps', 'max_abs_diff', 'at_step', 'same', 'same_draw'}; None if they share no step.
  same_draw: the first shared step agrees (the same initial weights and batches: another draw
  differs there by 0.1-0.3) even where later steps drift apart (numerics that differ a little,
  amplified by training), so the versions' rows still pair as draws."""
  losses = dict(zip(reference['step'], reference['loss']))
  diffs = {s: abs(x - losses[s]) for s, x in zip(curve['step'], curve['loss']) if s in losses}
  diffs = {s: diffs[s] for s in sorted(diffs)[:first]}
  if not diffs:
    return None
  worst = max(diffs, key=diffs.get)
  return {
    'steps': sorted(diffs),
    'max_abs_diff': diffs[worst],
    'at_step': worst,
    'same': diffs[worst] <= TOLERANCE,
    'same_draw': diffs[min(diffs)] <= TOLERANCE,
  }


def recorded(out: str) -> list[dict]:
  """Versions compared without training: each config and seed that the suites' ledgers under
  `out` hold from two code versions, their first three logged train losses compared (check's
  record fields, and 'suites': where each of the two ran)."""
  versions = {}  # (hash, seed) -> {version key: (suite, ledger entry)}
  for digest, entries in ledger.read_all(out).items():
    for entry in entries:
      if entry['result'].get('curve'):
        key = provenance.key(entry['result'].get('provenance'))
        suite = os.path.basename(entry['suite_folder'])
        versions.setdefault((digest, entry['seed']), {}).setdefault(key, (suite, entry))
  found = []
  for (_, seed), by_key in versions.items():
    for (suite_a, a), (suite_b, b) in itertools.combinations(by_key.values(), 2):
      compared = _compare(a['result']['curve'], b['result']['curve'], first=3)
      if compared:
        found.append(
          {
            'run': f"{a['run'].rsplit(f'-s{seed}-', 1)[0]} seed {seed}",
            'from': a['result'].get('provenance'),
            'under': b['result'].get('provenance'),
            'suites': [suite_a, suite_b],
            **compared,
          }
        )
  return found


def _same_draw(check: dict) -> bool | None:
  """Whether a check found the same draw (None: it could not compare). Records written before
  'same_draw' was kept count only as 'same'."""
  return check.get('same_draw', check.get('same'))


def linker(checks: list[dict]):
  """key -> the representative of the versions that `checks` found to draw the same as it (two
  versions are linked when their representatives are equal)."""
  parent = {}

  def root(key):
    while parent.get(key, key) != key:
      key = parent[key]
    return key

  for c in checks:
    if _same_draw(c):
      parent[root(provenance.key(c['from']))] = root(provenance.key(c['under']))
  return root


def pairing(runs: list[dict], checks: list[dict]) -> dict | None:
  """How a mixed table's code versions pair, from every check in the project (`checks`):
  versions linked by checks that found the same losses form a group (the link may pass through
  versions outside the table); {'groups': [[label, ...], ...] (the table's versions, one list
  per group), 'differ': whether every two groups are known to draw differently}; None for a
  table of one version."""
  keys = list(provenance.by_version(runs))
  if len(keys) < 2:
    return None
  root = linker(checks)
  labels = {
    provenance.key(r.get('provenance')): provenance.label(r.get('provenance')) for r in runs
  }
  groups = {}
  for key in keys:
    groups.setdefault(root(key), []).append(key)
  apart = {
    frozenset((root(provenance.key(c['from'])), root(provenance.key(c['under']))))
    for c in checks
    if _same_draw(c) is False
  }
  differ = all(frozenset(pair) in apart for pair in itertools.combinations(groups, 2))
  return {
    'groups': [[labels[k] for k in members] for members in groups.values()],
    'differ': differ,
  }


def pairing_sentence(found: dict) -> str:
  """`pairing`'s finding, as the report's provenance line states it."""
  if len(found['groups']) == 1:
    return (
      f"Its {len(found['groups'][0])} code versions pair: runs of one config and seed log the same "
      'first train losses under each (python -m experiments.reproduce; the evidence follows).'
    )
  named = '; '.join('[' + ', '.join(g) + ']' for g in found['groups'])
  across = (
    'and draw differently across them, so rows across the groups are not paired draws'
    if found['differ']
    else 'and are not all checked across them'
  )
  return f'Its code versions pair within each of these groups {across}: {named}.'


def relevant(runs: list[dict], checks: list[dict]) -> list[dict]:
  """The checks that speak to a table of `runs`: one trained again from one of its versions
  (under any code), or a recorded comparison of two of its versions."""
  keys = {tuple(k) for k in provenance.by_version(runs)}
  return [
    c
    for c in checks
    if provenance.key(c['from']) in keys
    and ('suites' not in c or provenance.key(c['under']) in keys)
  ]


def read_all(out: str) -> list[dict]:
  """The checks recorded in every suite's folder under `out`."""
  return [
    c
    for path in sorted(glob.glob(os.path.join(out, '*', CHECKS)))
    for c in read(os.path.dirname(path))
  ]


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
  steps = f"steps {record['steps'][0]}-{record['steps'][-1]}" if record.get('steps') else ''
  if 'suites' in record:
    both = (
      f"{record['run']} ran under {older} (in {record['suites'][0]}) and under {newer} (in "
      f"{record['suites'][1]})"
    )
    if record['same']:
      return f'{both} with the same train loss at {steps}: those versions pair.'
    if _same_draw(record):
      return (
        f"{both} with the same train loss at step {record['steps'][0]} and a drift of "
        f"{record['max_abs_diff']:.4f} by step {record['at_step']}: those versions pair as draws."
      )
    return (
      f"{both} with different train losses (by {record['max_abs_diff']:.4f} at step "
      f"{record['at_step']}): those versions draw differently."
    )
  if 'error' in record:
    return f"{record['run']} of {older} could not be checked under {newer}: {record['error']}."
  if record['same']:
    return (
      f"{record['run']} of {older}, trained again under {newer}, logs the same train loss at "
      f"{steps} (largest difference {record['max_abs_diff']:.5f}): the same initial weights and "
      'batches, so its runs pair with that version\'s.'
    )
  if _same_draw(record):
    return (
      f"{record['run']} of {older}, trained again under {newer}, logs the same train loss at "
      f"step {record['steps'][0]} and drifts by {record['max_abs_diff']:.4f} by step "
      f"{record['at_step']}: the same initial weights and batches computed with slightly "
      "different numerics, so its runs pair with that version's as draws."
    )
  return (
    f"{record['run']} of {older}, trained again under {newer}, logs a different train loss "
    f"(by {record['max_abs_diff']:.4f} at step {record['at_step']}): the two versions draw "
    'differently.'
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m experiments.reproduce', description=__doc__)
  parser.add_argument('suite')
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--out', default='experiments/results')
  parser.add_argument('--code_of', help="train under this commit's code (a git worktree of it)")
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
  try:
    checks = check(suite, results, args.out, args.steps, code_of=args.code_of)
  except ValueError as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  for record in checks:
    print(sentence(record))
  if not checks:
    print(f'suite {args.suite!r}: every run comes from this code version; nothing to check')
  return 0


if __name__ == '__main__':
  sys.exit(main())
