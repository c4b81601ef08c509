"""Each row of a suite's table measured and judged: its mean, its Δ to its reference row from
the pooled noise of the whole table (experiments/stats.py), the verdict and simultaneous CI
under one Bonferroni correction, the smallest Δ it could see, and its judgement against the
literature (agrees, rules out the paper's effect, contradicts with its diagnosis recomputed...)."""

from __future__ import annotations

import dataclasses
import math

from experiments import stats
from experiments.diagnosis import Evidence
from experiments.suite import Suite

# Measurements shown as extra columns (mean over seeds) when a suite's runs have them.
EXTRA_COLUMNS = {
  'decode_tok_s': ('decode tok/s', '{:,.0f}'),
  'kv_bytes_per_token': ('KV bytes/token', '{:,.0f}'),
  'load_cv': ('load CV', '{:.3f}'),
  'max_over_mean': ('max/mean load', '{:.2f}'),
  'drop_rate': ('drop rate', '{:.3f}'),
  'dead_experts': ('dead experts, all layers', '{:.1f}'),
  **{f'loss_at_{k}L': (f'loss at {k}L', '{:.4f}') for k in (1, 2, 4, 8, 16)},
  'grad_ratio_init': ('FFN grad norm last/first layer, init', '{:.2f}'),
  'grad_ratio_final': ('same, trained', '{:.2f}'),
}


ALPHA = 0.05  # the family-wise error rate of every table's tests


# What a row with a literature expectation shows (experiments/overview.py counts these). The two
# "can't say" categories are apart from "no difference detected": a row that rules out the
# paper's gap has answered its question; one whose detectable effect exceeds the paper's gap
# could not have.
CATEGORIES = (
  'agrees',
  'agrees in direction, not size',
  "rules out the paper's effect",
  'no difference detected',
  'cannot resolve at this power',
  'contradicts, diagnosed',
  'contradicts, unexplained',
  'contradicts, diagnosis not supported',
  'contradicts, undiagnosed',
)


@dataclasses.dataclass(frozen=True)
class Family:
  """The m tests a row's verdict is corrected over (Bonferroni): one table's by default;
  overview.md passes the whole project's."""

  m: int


def summarize(
  suite: Suite, results: dict, *, evidence: Evidence | None = None, family: Family | None = None
) -> list[dict]:
  """One row per variant, in the suite's order: its Δ to its reference row (the baseline, or its
  `versus`) from the suite's pooled additive model (or the row's own variance where it is set
  apart), the verdict and simultaneous CI at α/m over `family` (default: this table's tests),
  the smallest Δ it could have detected, and its judgement against the literature (diagnoses
  recomputed from `evidence`; default: this suite's results alone)."""
  rows = measured_rows(suite, results)
  tested = [row for row in rows if 'test' in row]
  m = family.m if family is not None else len(tested)
  for row in tested:
    test = row['test']
    row['m'] = m
    row['ci_all'] = test.ci(m, ALPHA)
    row['p_adjusted'] = test.p_adjusted(m)
    row['detectable'] = test.detectable(m, ALPHA)
    row['verdict'] = stats.verdict(test, m, alpha=ALPHA)
  tuning = results.get('tuning', {})
  evidence = evidence or Evidence(None, (suite.name, results))
  for row in rows:
    if row['variant'] in tuning:
      row['lr_edge'] = tuning[row['variant']]['edge']
    row['judgement'], row['agreement'] = judge(suite, row, rows, evidence)
    if row['variant'] in suite.notes:
      noted = suite.notes[row['variant']]
      row['note'] = f"{noted.rests_on}: {noted.find(evidence, row['variant']).text}"
  return rows


def measured_rows(suite: Suite, results: dict) -> list[dict]:
  """Each variant's mean ± std and counts, and its Δ to its reference row (stats.contrasts over
  the rows without a diverged seed: pooled, or the row's own where set apart)."""
  metric = suite.metric
  by_variant = {v.name: {} for v in suite.variants}
  for run in results['runs']:
    by_variant[run['variant']][run['seed']] = run
  rows = []
  for variant in suite.variants:
    runs = by_variant[variant.name]
    values = [runs[s][metric] for s in sorted(runs) if math.isfinite(runs[s][metric])]
    reference = suite.reference(variant)
    row = {
      'variant': variant.name,
      'versus': reference.name,
      'n': len(values),
      'paper': variant.paper.get(metric),
      'diverged': sorted(s for s in runs if 'diverged_at_step' in runs[s]),
    }
    if values:
      row['mean'], row['std'] = stats.mean_std(values)
      first = runs[min(runs)]
      speeds = [r['tokens_per_s'] for r in runs.values() if r.get('tokens_per_s')]
      row.update(
        params=first['params'],
        active_params=first['active_params'],
        tokens_per_s=stats.mean_std(speeds)[0] if speeds else None,
        train_flops=first.get('train_flops'),
        tokens=first.get('tokens'),
        lr=first.get('learning_rate'),
      )
      for key in EXTRA_COLUMNS:
        if all(key in r for r in runs.values()):
          row[key] = stats.mean_std([r[key] for r in runs.values()])[0]
    if row['diverged']:
      row['verdict'] = f"diverged in {len(row['diverged'])} of {len(runs)} seeds"
    rows.append(row)
  # The pooled table: every row without a diverged seed, its finite values by seed.
  table = {
    row['variant']: {
      s: r[metric] for s, r in by_variant[row['variant']].items() if math.isfinite(r[metric])
    }
    for row in rows
    if not row['diverged'] and row['n']
  }
  pairs = [
    (row['variant'], row['versus'])
    for row in rows
    if row['variant'] != row['versus'] and row['variant'] in table and row['versus'] in table
  ]
  noise = {v.name: v.noise for v in suite.variants}
  found, pools = stats.contrasts(table, pairs, families=noise)
  for row in rows:
    if row['variant'] in found:
      row['test'] = found[row['variant']]
      row['pool'] = pools[noise[row['variant']]]
      row['noise'] = noise[row['variant']]
      ref = table[row['versus']]
      row['seed_diffs'] = {
        s: v - ref[s] for s, v in sorted(table[row['variant']].items()) if s in ref
      }
  return rows


# Paper numbers closer than this (relative to the baseline's) are read as "no difference": e.g.
# sinusoidal 20.05 vs rotary 20.07 ppl (Press et al. 2022) is no claim that either is better.
PAPER_SAME = 0.005


def expected_direction(suite: Suite, variant) -> str | None:
  """What the literature says of `variant` against its reference row: 'better', 'worse' or
  'same', from the paper's numbers when both rows have one, else the variant's `expect`."""
  reference = suite.reference(variant)
  ours, base = variant.paper.get(suite.metric), reference.paper.get(suite.metric)
  if ours is not None and base is not None and variant is not reference:
    if abs(ours - base) <= PAPER_SAME * abs(base):
      return 'same'
    return 'better' if ours < base else 'worse'
  return variant.expect or None


def judge(suite: Suite, row: dict, rows: list[dict], evidence: Evidence) -> tuple[str, str]:
  """(category, the "vs paper" cell) of a row against what the literature expects; ('', '')
  where it says nothing of the row or the row has no test. The categories (CATEGORIES):
  - agrees: significant, in the literature's direction (and, where the paper gives a size, the
    measured gap over the paper's, the same fraction of our reference's loss, has 1 in its
    simultaneous CI); where the literature expects no difference, a simultaneous CI inside
    ±PAPER_SAME of the reference's loss;
  - agrees in direction, not size: significant, that direction, that ratio's CI excludes 1;
  - rules out the paper's effect: not significant, and the simultaneous CI excludes the
    paper's gap (scaled to our reference's loss);
  - cannot resolve at this power: not significant, and the smallest gap the row could have
    seen (80% power at the family's α/m) is larger than the paper's;
  - no difference detected: not significant otherwise; the cell names that smallest gap;
  - contradicts: significant against the literature's direction, or a gap where it expects none,
    with its diagnosis recomputed (diagnosed, unexplained, not supported by the numbers now, or
    none yet)."""
  variant = next(v for v in suite.variants if v.name == row['variant'])
  expected, verdict, test = expected_direction(suite, variant), row.get('verdict'), row.get('test')
  if expected is None or test is None or verdict not in ('better', 'worse', 'within noise'):
    return '', ''
  low, high = row['ci_all']
  seen = row['detectable']
  if verdict == 'within noise':
    effect = paper_effect(suite, row, rows)
    if expected == 'same':
      bound = PAPER_SAME * abs(reference_mean(row, rows))
      if -bound <= low and high <= bound:
        return 'agrees', f'agrees: no difference, the CI within ±{bound:.3f}'
    elif effect is not None:
      if not low <= effect <= high:
        return (
          "rules out the paper's effect",
          f"rules out the paper's gap ({effect:+.3f}, outside the CI)",
        )
      if seen > abs(effect):
        return (
          'cannot resolve at this power',
          f"cannot resolve: could see ±{seen:.3f}, the paper's gap is {effect:+.3f}",
        )
    return 'no difference detected', f'no difference detected (could see ±{seen:.3f})'
  if verdict == expected:
    effect = paper_effect(suite, row, rows)
    if effect is None or expected == 'same':
      return 'agrees', 'agrees (direction; no size to compare)'
    ratios = sorted(bound / effect for bound in row['ci_all'])
    ratio = f"{test.mean / effect:.2g}x the paper's gap [{ratios[0]:.2g}, {ratios[1]:.2g}]"
    if ratios[0] <= 1.0 <= ratios[1]:
      return 'agrees', f'agrees ({ratio})'
    return 'agrees in direction, not size', f'direction, not size: {ratio}'
  return contradiction(suite, row['variant'], evidence)


def judge_effect(test: stats.Contrast, m: int, expected: float) -> str:
  """The category of a measured difference (`test`, at α/m) against the paper's non-zero one, as
  `judge` reads a row: its CI beyond 0 on the paper's side 'agrees' where it holds the paper's
  value, else 'agrees in direction, not size'; beyond 0 on the other side 'contradicts' (the
  caller looks up its diagnosis with `contradiction`); holding 0, "rules out the paper's effect"
  where it excludes the paper's value, 'cannot resolve at this power' where the smallest
  difference it could see (80% power) is larger, else 'no difference detected'."""
  low, high = test.ci(m, ALPHA)
  if (high < 0) if expected < 0 else (low > 0):
    return 'agrees' if low <= expected <= high else 'agrees in direction, not size'
  if (low > 0) if expected < 0 else (high < 0):
    return 'contradicts'
  if not low <= expected <= high:
    return "rules out the paper's effect"
  if test.detectable(m, ALPHA) > abs(expected):
    return 'cannot resolve at this power'
  return 'no difference detected'


def contradiction(suite: Suite, key: str, evidence: Evidence) -> tuple[str, str]:
  """(category, cell) of a result against the literature's direction: its diagnosis (the
  suite's `diagnoses[key]`: a row's variant, or a claim's 'variant: measure', 'family: slope' or
  'variant: steps', found for the part before the colon) recomputed from `evidence`; none yet,
  pending, not supported, diagnosed or unexplained."""
  diagnosis = suite.diagnoses.get(key)
  if diagnosis is None:
    return 'contradicts, undiagnosed', 'contradicts (no diagnosis yet)'
  variant = key.split(': ')[0]
  finding = diagnosis.find(evidence, variant)
  if finding.pending:  # a diagnosis suite not run yet: no claim made, none contradicted
    return 'contradicts, undiagnosed', f'contradicts (diagnosis pending: {finding.text})'
  if not finding.supported:
    return (
      'contradicts, diagnosis not supported',
      f'contradicts; DIAGNOSIS NOT SUPPORTED by the runs now: {finding.text}',
    )
  if diagnosis.explains:
    return 'contradicts, diagnosed', f'contradicts: {finding.text}'
  return 'contradicts, unexplained', f'contradicts: {finding.text}'


def reference_mean(row: dict, rows: list[dict]) -> float:
  return next(r for r in rows if r['variant'] == row['versus']).get('mean', 0.0)


def paper_effect(suite: Suite, row: dict, rows: list[dict]) -> float | None:
  """The paper's difference to the reference row as a fraction of that row's metric, applied to
  ours: the effect this suite would see if the paper's relative gap held at our scale."""
  variant = next(v for v in suite.variants if v.name == row['variant'])
  reference = suite.reference(variant)
  ours, base = variant.paper.get(suite.metric), reference.paper.get(suite.metric)
  reference_row = next(r for r in rows if r['variant'] == reference.name)
  if ours is None or base is None or variant is reference or 'mean' not in reference_row:
    return None
  return (ours - base) / base * reference_row['mean']


# The judgements of a row within noise that has not answered the paper: more seeds would.
UNRESOLVED = ('no difference detected', 'cannot resolve at this power')


def rows_m(rows: list[dict]) -> int:
  """The number of tests the rows' verdicts are corrected over."""
  return next((r['m'] for r in rows if 'm' in r), 0)
