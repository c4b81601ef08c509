"""Plan a suite before it trains: per row, the smallest Δ it could see at its current seeds, the
seeds it needs to see a target Δ, and what those runs cost at the pace they were timed, on the
hosts named (experiments/provenance.py's `host`).

    python -m experiments plan SUITE [--detect 0.03] [--noise_from SUITE] [--steps N] [--out DIR]

The noise is the pooled σ of a finished suite's table (its own results.json, or `--noise_from`'s:
e.g. plan `ffn` at 4 M tokens with `ffn_tokens`'s noise and `--steps 2000`); a row that suite
set apart keeps its own paired std. Power is the noncentral t's at α 0.05 over the planned
table's tests (stats.seeds_needed). Run time is the mean wall time a step of the runs measured
(the planned suite's own where it has them, else the noise suite's; of those, the ones timed on
this machine where there are any, each host's pace printed), scaled by steps; tuning runs
are counted as the suite's results recorded them (a suite not run yet: each tuned row's grid on
its tuning seeds, a floor), scaled the same way. Noise from a suite whose models differ in shape
(SHAPE_KEYS: width, depth, heads, dtype, context, batch, corpus) is flagged, naming the keys.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys

from experiments import provenance, stats, verdicts
from experiments.run import resolve
from experiments.suite import Suite, load_suite

# What sets a table's seed-to-seed spread besides its rows: where the noise suite's models differ
# in one of these, its σ may not stand in (the three suites with 2 heads of 64 pooled σ 0.013,
# 0.032 and 0.073, those with 8 of 16 0.021-0.023).
SHAPE_KEYS = (
  'model.d_model',
  'model.n_layers',
  'model.n_heads',
  'model.n_kv_heads',
  'model.dtype',
  'data.seq_len',
  'data.batch_size',
  'data.source',
)


def _results(out: str, name: str) -> dict | None:
  path = os.path.join(out, name, 'results.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _timed(results: dict | None) -> list[dict]:
  return [r for r in (results or {}).get('runs', []) if r.get('wall_s') and r.get('steps')]


def _seconds_per_step(timed: list[dict]) -> float | None:
  return statistics.mean(r['wall_s'] / r['steps'] for r in timed) if timed else None


def _host(run: dict) -> str:
  return (run.get('provenance') or {}).get('host') or 'not recorded'


def _tuning_runs(suite: Suite) -> int:
  """The fewest tuning runs a suite not run yet needs: each tuned row's grid on its tuning seeds
  (a grid widens past an edge, so this is a floor)."""
  if suite.lr_from:
    return len(suite.retune_lr) * suite.retune_grid.points * suite.tune_seeds
  tuned = [v for v in suite.variants if v.tune and not v.starts_from]
  return len(tuned) * suite.lr_grid.points * suite.tune_seeds


def _shape(suite: Suite, preset: str) -> dict:
  """{key: value} of SHAPE_KEYS in the suite's baseline run at `preset`."""
  config = resolve(suite, suite.reference(suite.variants[0]), preset, seed=0)
  return {key: functools.reduce(getattr, key.split('.'), config) for key in SHAPE_KEYS}


def _differences(suite: Suite, noise_suite: Suite, preset: str) -> list[str]:
  """'key: noise suite's value there, this suite's here' for each shape key the two differ in."""
  if noise_suite.name == suite.name or preset not in suite.presets:
    return []
  here, there = _shape(suite, preset), _shape(noise_suite, preset)
  return [f'{k} {there[k]} there, {here[k]} here' for k in SHAPE_KEYS if here[k] != there[k]]


def plan(suite: Suite, *, detect: float, out: str, noise_from: str = '', steps: int | None = None):
  """{'rows': [...], 'sigma', 'df', 'm', 'steps', 'hours', ...}: the plan's numbers."""
  own = _results(out, suite.name)
  source = noise_from or suite.name
  noisy = own if source == suite.name else _results(out, source)
  if noisy is None:
    raise ValueError(
      f'suite {source!r} has no results.json under {out}; allowed: a finished suite '
      '(--noise_from names one whose noise stands in)'
    )
  noise_suite = load_suite(source)
  measured = {r['variant']: r for r in verdicts.measured_rows(noise_suite, noisy)}
  tested = [r for r in measured.values() if 'test' in r]
  if not tested:
    raise ValueError(f'suite {source!r} has no paired rows to measure noise from')
  pool = next((r['pool'] for r in tested if not r.get('noise')), tested[0]['pool'])
  names = [v.name for v in suite.variants]
  m = sum(1 for v in suite.variants if v is not suite.reference(v))
  run_steps = [r['steps'] for r in (own or noisy)['runs'] if r.get('steps')]
  steps = steps or (int(statistics.median(run_steps)) if run_steps else None)
  timed = _timed(own) or _timed(noisy)  # the planned suite's own runs where it has any
  # Another CPU's pace is not this one's (2,000 steps took 5-25 min on the 2-core EPYCs of
  # 2026-11-30..12-02): runs timed on this host price the plan where there are any.
  here = [r for r in timed if _host(r) == provenance.host()]
  per_step = _seconds_per_step(here or timed)
  seeds_now = (own or {}).get('seeds') or suite.seeds
  rows = []
  for variant in suite.variants:
    name = variant.name
    if variant is suite.reference(variant):
      rows.append({'variant': name, 'reference': True})
      continue
    row = measured.get(name, {})
    pooled = row.get('test') is None or row['test'].source == 'pooled'
    family = row.get('pool', pool)  # its noise family's (Variant.noise)
    sigma = family.sigma if pooled else row['test'].diff_std
    size = sum(1 for v in suite.variants if v.noise == variant.noise)  # the family's rows
    se, df = stats.planned_se(sigma, seeds_now, rows=size, pooled=pooled)
    rows.append(
      {
        'variant': name,
        'noise': 'pooled' if pooled else 'own',
        'sigma': sigma,
        'seen_now': stats.detectable_effect(se, df, alpha=verdicts.ALPHA / max(m, 1)),
        'seeds': stats.seeds_needed(
          detect, sigma=sigma, rows=size, m=max(m, 1), alpha=verdicts.ALPHA, pooled=pooled
        ),
      }
    )
  need = max((r['seeds'] or math.inf for r in rows if 'seeds' in r), default=seeds_now)
  tuning = sum(
    len(p['seeds']) for t in ((own or {}).get('tuning') or {}).values() for p in t['points']
  ) or _tuning_runs(suite)
  run_hours = None
  if per_step and steps and math.isfinite(need):
    run_hours = per_step * steps * (len(names) * need + tuning) / 3600
  return {
    'suite': suite.name,
    'source': source,
    'sigma': pool.sigma,
    'df': pool.df,
    'm': m,
    'steps': steps,
    'seeds_now': seeds_now,
    'need': need,
    'tuning_runs': tuning,
    'run_hours': run_hours,
    # Where the runs it prices from were timed: another CPU (or sharing) changes every hour.
    'timed_on': provenance.by_host(timed),
    'pace': {
      h: _seconds_per_step([r for r in timed if _host(r) == h]) for h in provenance.by_host(timed)
    },
    'this_host': provenance.host(),
    'differs': _differences(suite, noise_suite, noisy.get('preset', 'cpu')),
    'rows': rows,
  }


def text(p: dict, detect: float) -> str:
  lines = [
    f"Plan for `{p['suite']}`: {len(p['rows'])} rows, {p['m']} tests at α 0.05 / {p['m']}, "
    f"{p['steps']} steps a run; noise from `{p['source']}` (pooled σ {p['sigma']:.4f} on "
    f"{p['df']} df). Target: a Δ of {detect:g} at 80% power.",
    *(
      [
        f"Its models differ from this suite's ({'; '.join(p['differs'])}): that σ may not hold "
        "here; this suite's own first seeds measure it.",
      ]
      if p.get('differs')
      else []
    ),
    '',
    f"| row | noise | σ | could see at {p['seeds_now']} seeds | seeds to see {detect:g} |",
    '|---|---|---:|---:|---:|',
  ]
  for row in p['rows']:
    if row.get('reference'):
      lines.append(f"| {row['variant']} | (reference) | | | |")
      continue
    seeds = 'more than 1000' if row['seeds'] is None else str(row['seeds'])
    lines.append(
      f"| {row['variant']} | {row['noise']} | {row['sigma']:.4f} | ±{row['seen_now']:.3f} | {seeds} |"
    )
  lines.append('')
  if p['run_hours'] is None:
    lines.append(
      'Cost: unknown (no timed runs to scale from, or no seed count reaches the target).'
    )
  else:
    lines.append(
      f"Cost at {p['need']} seeds: {len(p['rows']) * p['need']} table runs"
      + (f" and {p['tuning_runs']} tuning runs" if p['tuning_runs'] else '')
      + f", {p['run_hours']:.1f} run-hours at the pace its runs were timed (about "
      f"{p['run_hours'] / 2:.1f} hours with --jobs=2 where they ran two at once); runs already "
      'finished at the same settings count against it.'
    )
    hosts, pace = p['timed_on'], p.get('pace', {})
    lines.append(
      'Timed on: '
      + '; '.join(
        provenance.hosts_phrase({h: n})
        + (f' ({pace[h]:.2f} s a step)' if pace.get(h) is not None else '')
        for h, n in hosts.items()
      )
      + '.'
      + (
        ' Priced at the pace of the runs on this machine.'
        if p['this_host'] in hosts
        else f" This machine is {p['this_host']}, on which none was timed: its hours may differ."
      )
    )
  return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m experiments plan',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('suite')
  parser.add_argument('--detect', type=float, default=0.03, help='the Δ to detect, in nats')
  parser.add_argument('--noise_from', default='', help='a finished suite whose noise stands in')
  parser.add_argument('--steps', type=int, default=None, help='steps a run (default: as run)')
  parser.add_argument('--out', default='experiments/results')
  args = parser.parse_args(argv)
  try:
    if not args.detect > 0:
      raise ValueError(f'--detect={args.detect}; allowed: a positive number of nats')
    if args.steps is not None and args.steps < 1:
      raise ValueError(f'--steps={args.steps}; allowed: a positive integer')
    suite = load_suite(args.suite)
    if not isinstance(suite, Suite):
      raise ValueError(f'suite {args.suite!r} is a benchmark suite; allowed: a training suite')
    if args.noise_from:
      load_suite(args.noise_from)
    found = plan(
      suite, detect=args.detect, out=args.out, noise_from=args.noise_from, steps=args.steps
    )
  except ValueError as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  print(text(found, args.detect), end='')
  return 0


if __name__ == '__main__':
  sys.exit(main())
