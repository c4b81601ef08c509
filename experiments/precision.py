"""Does a method change a suite's answers? A suite against its method check (a copy run in another
precision: `Suite.checks_method_of`), run for run: the same variant, seed and learning rate.

    python -m experiments.precision ffn_bf16      # writes experiments/results/ffn_bf16/precision.md

Three questions, each answered from the runs: how far each run's loss moves (bf16 − f32 per run:
a shift common to every row changes no comparison); whether a row's Δ to its reference moves
(the per-seed Δs paired across the two suites, a paired t per row, Bonferroni over the rows);
and whether any verdict changes (each table judged on its own, as its results.md does). The check
passes when no verdict changes and no row's Δ moves significantly.
"""

from __future__ import annotations

import argparse
import os
import sys

from experiments import overview, stats, verdicts
from experiments.suite import Suite

ALPHA = 0.05


def _load(out: str, name: str) -> tuple[Suite, dict]:
  found = overview.load(out, name)
  if found is None:
    path = os.path.join(out, name, 'results.json')
    raise SystemExit(f'error: {path}: no results; allowed: run `python -m experiments {name}`')
  return found


def compare(out: str, name: str) -> dict:
  """The comparison of suite `name` with the suite it checks, from their results.json."""
  check, check_results = _load(out, name)
  if not check.checks_method_of:
    raise SystemExit(f'error: suite {name!r} checks no other suite; allowed: a method check')
  return compare_results(*_load(out, check.checks_method_of), check, check_results)


def compare_results(base: Suite, base_results: dict, check: Suite, check_results: dict) -> dict:
  """The comparison of a suite's results with its method check's (see the module docstring)."""
  metric = base.metric
  base_runs = {(r['variant'], r['seed']): r for r in base_results['runs']}
  shifts = {
    key: run[metric] - base_runs[key][metric]
    for run in check_results['runs']
    if (key := (run['variant'], run['seed'])) in base_runs
  }
  base_rows = {r['variant']: r for r in verdicts.summarize(base, base_results)}
  check_rows = {r['variant']: r for r in verdicts.summarize(check, check_results)}
  tested = [v for v in check_rows if 'seed_diffs' in check_rows[v] and 'seed_diffs' in base_rows[v]]
  rows = []
  for variant in check_rows:
    a, b = base_rows[variant], check_rows[variant]
    row = {
      'variant': variant,
      'versus': b['versus'],
      'base_mean': a.get('mean'),
      'check_mean': b.get('mean'),
      'base_verdict': a.get('verdict', ''),
      'check_verdict': b.get('verdict', ''),
    }
    if variant in tested:
      seeds = sorted(set(a['seed_diffs']) & set(b['seed_diffs']))
      moved = stats.own_contrast([b['seed_diffs'][s] - a['seed_diffs'][s] for s in seeds])
      row.update(
        base_delta=a['test'].mean,
        base_ci=a['ci_all'],
        check_delta=b['test'].mean,
        check_ci=b['ci_all'],
        moved=moved,
        moved_ci=moved.ci(len(tested), ALPHA),
        seeds=len(seeds),
      )
    rows.append(row)
  same_verdicts = all(r['base_verdict'] == r['check_verdict'] for r in rows)
  moved = [
    r['variant'] for r in rows if 'moved' in r and r['moved'].significant(len(tested), ALPHA)
  ]
  values = list(shifts.values())
  mean, std = stats.mean_std(values) if values else (float('nan'), float('nan'))
  return {
    'suite': check.name,
    'of': base.name,
    'rows': rows,
    'runs': len(shifts),
    'planned': len(check_results['runs']) + len(check_results.get('pending', [])),
    'shift_mean': mean,
    'shift_std': std,
    'shift_max': max((abs(v) for v in values), default=float('nan')),
    'same_verdicts': same_verdicts,
    'moved': moved,
    'passes': same_verdicts and not moved and len(shifts) == len(base_runs),
  }


def _ci(ci: tuple[float, float]) -> str:
  return f'[{ci[0]:+.4f}, {ci[1]:+.4f}]'


def markdown(found: dict) -> str:
  m = sum('moved' in r for r in found['rows'])
  lines = [
    f'# Method check `{found["suite"]}` against `{found["of"]}`',
    '',
    f'{found["runs"]} runs paired with their twins in `{found["of"]}` (same variant, seed and '
    f'learning rate). Each run\'s loss moved by {found["shift_mean"]:+.4f} ± '
    f'{found["shift_std"]:.4f} on average (largest {found["shift_max"]:.4f}); a shift common to '
    "every row changes no comparison. Per row: its Δ to its reference in each table (each table's "
    'own simultaneous 95% CI), how far the Δ moved (check − original, paired by seed, a '
    f'simultaneous CI over the {m} rows), and each table\'s verdict.',
    '',
    '| variant | Δ in original [CI] | Δ in check [CI] | moved [CI] | verdict original | '
    'verdict check |',
    '|---|---:|---:|---:|---|---|',
  ]
  for r in found['rows']:
    if 'moved' not in r:
      lines.append(f'| {r["variant"]} | baseline | baseline | | | |')
      continue
    lines.append(
      f'| {r["variant"]} | {r["base_delta"]:+.4f} {_ci(r["base_ci"])} | '
      f'{r["check_delta"]:+.4f} {_ci(r["check_ci"])} | {r["moved"].mean:+.4f} '
      f'{_ci(r["moved_ci"])} | {r["base_verdict"]} | {r["check_verdict"]} |'
    )
  verdict = (
    'passes: no verdict changed and no row\'s Δ moved beyond its CI'
    if found['passes']
    else 'does not pass: '
    + '; '.join(
      part
      for part in (
        '' if found['same_verdicts'] else 'a verdict changed',
        f'Δ moved in {", ".join(found["moved"])}' if found['moved'] else '',
        f'{found["runs"]} of {found["planned"]} runs finished'
        if found['runs'] < found['planned']
        else '',
      )
      if part
    )
  )
  lines += ['', f'**The check {verdict}.**', '']
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m experiments.precision', description=__doc__)
  parser.add_argument('suite', help='a method-check suite, e.g. ffn_bf16')
  parser.add_argument('--out', default='experiments/results')
  args = parser.parse_args(argv)
  text = markdown(compare(args.out, args.suite))
  with open(os.path.join(args.out, args.suite, 'precision.md'), 'w') as f:
    f.write(text)
  print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
