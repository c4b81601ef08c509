"""A suite's results: results.json and results.md (means ± std, each row's Δ to its reference with
the pooled noise of the whole table and a simultaneous CI, Bonferroni-adjusted p-values, the
smallest Δ each row could see, verdicts, the paper's numbers, parameter counts)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

from experiments import plots, provenance, reproduce, stats, tensorboard
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
  found, pool = stats.contrasts(table, pairs)
  for row in rows:
    if row['variant'] in found:
      row['test'] = found[row['variant']]
      row['pool'] = pool
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
      bound = PAPER_SAME * abs(_reference_mean(row, rows))
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
  diagnosis = suite.diagnoses.get(row['variant'])
  if diagnosis is None:
    return 'contradicts, undiagnosed', 'contradicts (no diagnosis yet)'
  finding = diagnosis.find(evidence, row['variant'])
  if not finding.supported:
    return (
      'contradicts, diagnosis not supported',
      f'contradicts; DIAGNOSIS NOT SUPPORTED by the runs now: {finding.text}',
    )
  if diagnosis.explains:
    return 'contradicts, diagnosed', f'contradicts: {finding.text}'
  return 'contradicts, unexplained', f'contradicts: {finding.text}'


def _reference_mean(row: dict, rows: list[dict]) -> float:
  return next(r for r in rows if r['variant'] == row['versus']).get('mean', 0.0)


def _cell(key: str, row: dict) -> str:
  if key not in row:
    return ''
  return 'n/a' if math.isnan(row[key]) else EXTRA_COLUMNS[key][1].format(row[key])


def _name(suite: Suite, name: str) -> str:
  """The row's label: a starts_from variant says where its parameters come from."""
  variant = next(v for v in suite.variants if v.name == name)
  if not variant.starts_from:
    return name
  return f"{name} ({'fine-tuned' if variant.trains else 'evaluated'} from {variant.starts_from})"


def cost(results: dict) -> dict:
  """What the suite's own runs cost: runs trained and runs only evaluated here (not copied from
  another suite), and the sum of their wall times from each run's result.json."""
  own = [r for r in results['runs'] if not r.get('copied_from')]
  timed = [r['wall_s'] for r in own if r.get('wall_s')]
  tuning = [
    w
    for t in results.get('tuning', {}).values()
    for p in t['points']
    for w in p.get('wall_s', [])
    if w
  ]
  return {
    'trained': sum(1 for r in own if r.get('steps')),
    'evaluated': sum(1 for r in own if not r.get('steps')),
    'untimed': len(own) - len(timed),
    'run_minutes': (sum(timed) + sum(tuning)) / 60,
    'tuning_runs': len(tuning),
    'copied': len(results['runs']) - len(own),
  }


def _cost_line(results: dict) -> str:
  c = cost(results)
  runs = (
    f"Cost: {c['trained']} runs trained and {c['evaluated']} only evaluated by this suite "
    f"({c['copied']} copied from other suites)"
    + (f" after {c['tuning_runs']} learning-rate tuning runs" if c['tuning_runs'] else '')
  )
  if c['untimed'] == c['trained'] + c['evaluated']:
    return runs + ": no recorded times (an older runner did not keep them)."
  return (
    runs
    + f", {c['run_minutes']:.0f} run-minutes (the sum of each run's wall time"
    + (f"; {c['untimed']} runs from an older runner have no recorded time" if c['untimed'] else '')
    + '). With `--jobs=2` two runs share the machine, so the suite takes about half that.'
  )


def markdown(suite: Suite, results: dict, rows: list[dict]) -> str:
  """results.md's text: what the suite compares, one table row per variant, notes below."""
  extras = [k for k in EXTRA_COLUMNS if k != suite.metric and any(k in row for row in rows)]
  lines = _preamble(suite, results)
  lines += [
    '| variant | params | tokens/param | lr | mean ± std | Δ [simultaneous 95% CI] | '
    'p (Bonferroni) | could see | verdict | paper | vs paper | train tokens/s |'
    + ''.join(f' {EXTRA_COLUMNS[k][0]} |' for k in extras),
    '|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|' + '---:|' * len(extras),
  ]
  lines += [_table_row(suite, row, extras) for row in rows]
  return '\n'.join(lines + _notes(suite, results, rows)) + '\n'


def _preamble(suite: Suite, results: dict) -> list[str]:
  """The lines above the table: the suite, how rows are compared, where the rates come from."""
  lines = [
    f'# Suite `{suite.name}`: {suite.description}',
    '',
    f"Preset `{results['preset']}`, {results['seeds']} paired seeds, metric "
    f'`{suite.metric}` (lower is better){_budget(results)}. Δ is variant − '
    f'`{suite.baseline.name}` (or the row it names) over the same seeds. Its noise comes from '
    'every row at once: a two-way additive model (rows × seeds; statsmodels OLS) whose '
    'residual σ has (rows − 1)(seeds − 1) degrees of freedom; a row whose own paired '
    'differences spread far beyond that σ (an F-test at level '
    f'{stats.APART_ALPHA}) keeps its own variance instead ("own" in the notes). One '
    "correction for tests and intervals, Bonferroni over the table's m tests: the CI holds "
    "for all rows at once, and a row is 'better' or 'worse' exactly when it excludes zero (p "
    f'< {ALPHA}). "Could see": the smallest Δ the row detects with 80% power at that level '
    '(noncentral t). The "vs paper" column: agrees (significant, the literature\'s '
    "direction, and its size where the paper gives one: the measured gap over the paper's "
    'gap as the same fraction of our reference row, with its simultaneous CI); direction, not '
    "size; rules out the paper's gap (no difference, and the CI excludes the paper's gap); "
    "cannot resolve (no difference, and the paper's gap is below what the row could see); no "
    'difference detected; contradicts (with its diagnosis, recomputed from the runs it rests '
    'on).',
    '',
  ]
  lines += _provenance_lines(results)
  if suite.paper_source:
    lines += [
      f'Paper column: {suite.paper_source}. Our runs are far smaller: compare the '
      'ordering, not the values.',
      '',
    ]
  if results.get('lr_from'):
    lines += [_borrowed_line(suite, results), '']
  elif results.get('tuning'):
    lines += [_tuning_line(suite, results), '']
  return lines


# How a tuned rate at an edge of its grid is marked.
EDGES = {'low': ' (lowest tried)', 'high': ' (highest tried)'}


def _borrowed_line(suite: Suite, results: dict) -> str:
  """Where an lr_from suite's rates come from, and which it tuned again at its own budget."""
  donor, rates = results['lr_from']['suite'], results['lr_from']['rates']
  tuning = results.get('tuning', {})
  kept = [name for name in rates if name not in tuning]
  line = 'Learning rates: '
  if kept:
    line += (
      f"each variant's tuned rate in suite `{donor}` ("
      + ', '.join(f'{name} {rates[name]:.3g}' for name in kept)
      + "), not tuned again at this suite's budget."
    )
  if tuning:
    grid = suite.retune_grid
    cells = [
      f"{name} {rates[name]:.3g} -> "
      + ('not finished' if t['best_lr'] is None else f"{t['best_lr']:.3g}")
      + EDGES.get(t.get('edge'), '')
      + _points(t['points'])
      for name, t in tuning.items()
    ]
    line += (
      (' ' if kept else '') + f"Tuned again at this suite's budget, on seeds "
      f"{', '.join(map(str, results['tune_seeds']))} (not the table's): the rate suite "
      f'`{donor}` chose and its neighbours a factor √{grid.ratio**2:g} apart, widened past an '
      f'edge where the best sat (up to {grid.max_widen} more per side), with each one\'s eval '
      'loss; the table runs at the new best: ' + '; '.join(cells) + '.'
    )
  return line


def _budget(results: dict) -> str:
  """', N tokens (early training: x tokens/param)' from the runs, where they say; below
  EARLY_TRAINING tokens per parameter a table is marked as early training."""
  runs = [r for r in results['runs'] if r.get('tokens') and r.get('active_params')]
  if not runs:
    return ''
  tokens = statistics.median(r['tokens'] for r in runs)
  per_param = [r['tokens'] / r['active_params'] for r in runs]
  low, high = min(per_param), max(per_param)
  span = f'{low:.2g}' if f'{low:.2g}' == f'{high:.2g}' else f'{low:.2g}-{high:.2g}'
  early = 'early training: ' if high < EARLY_TRAINING else ''
  return f', {tokens / 1e6:.2g} M training tokens ({early}{span} tokens/param)'


# Below this many training tokens per parameter a table is early training: its rankings may
# still change (ffn: SwiGLU level with ReLU at 1.2 tokens/param, 0.16 behind at 4.8).
EARLY_TRAINING = 4.0


def _table_row(suite: Suite, row: dict, extras: list[str]) -> str:
  """One variant's line of the table; a variant without a finished run says why."""
  if not row['n']:
    what = row.get('verdict', 'no finished run')
    return f"| {_name(suite, row['variant'])} | | | | {what} | | | | | | | |"
  params = f"{row['params']:,}"
  if row['active_params'] != row['params']:
    params += f" ({row['active_params']:,} active)"
  test = row.get('test')
  versus = '' if row['versus'] == suite.baseline.name else f"vs {row['versus']}: "
  own = ' (own σ)' if test and test.source == 'own' else ''
  delta = (
    f"{versus}{test.mean:+.4f} [{row['ci_all'][0]:+.4f}, {row['ci_all'][1]:+.4f}]{own}"
    if test
    else ('baseline' if row['variant'] == suite.baseline.name else '')
  )
  p = f"{row['p_adjusted']:.3g}" if test else ''
  seen = f"±{row['detectable']:.3f}" if test else ''
  paper = '' if row['paper'] is None else f"{row['paper']:.3f}"
  spread = f" ± {row['std']:.4f}" if row['n'] > 1 else ' (1 seed)'
  speed = '—' if row['tokens_per_s'] is None else f"{row['tokens_per_s']:,.0f}"
  per_param = f"{row['tokens'] / row['active_params']:.2f}" if row.get('tokens') else ''
  return (
    f"| {_name(suite, row['variant'])} | {params} | {per_param} | {_lr_cell(row)} | "
    f"{row['mean']:.4f}{spread} | {delta} | {p} | {seen} | {row.get('verdict', '')} | "
    f"{paper} | {row['agreement']} | {speed} |" + ''.join(f' {_cell(k, row)} |' for k in extras)
  )


def _notes(suite: Suite, results: dict, rows: list[dict]) -> list[str]:
  """The lines below the table: runs not run yet, power, cost and failed runs."""
  lines = []
  if results.get('pending'):
    lines += [
      '',
      f"Not run yet: {len(results['pending'])} of "
      f"{len(results['pending']) + len(results['runs']) + len(results['failed'])} runs "
      '(the suite resumes where it stopped).',
    ]
  noise = pool_line(rows)
  if noise:
    lines += ['', noise]
  for row in rows:
    if row.get('note'):
      lines += ['', f"{row['variant']}, elsewhere ({row['note']})."]
  power = _power_line(suite, rows)
  if power:
    lines += ['', power]
  apart = spread_line(rows)
  if apart:
    lines += ['', apart]
  lines += ['', _cost_line(results)]
  if results['failed']:
    lines += [
      '',
      'Failed runs (after one retry): '
      + '; '.join(f"{f['variant']} seed {f['seed']}: {f['errors'][-1]}" for f in results['failed']),
    ]
  return lines


# A row whose paired differences spread this many times the table's median spread is unlike the
# others: a seed that stalled or nearly diverged (norms' Post-LN with warm-up at 6e-3: 5.35 on one
# seed of three, 2.9 on the others: 65x), whose mean and CI then describe that spread, not the
# variant. In the committed tables every other row stays under 4.5x (MoE top-1: 4.3x).
SPREAD_APART = 10.0


def spread_line(rows: list[dict]) -> str:
  """'Seeds apart: ...' naming each row whose paired differences spread SPREAD_APART times the
  table's median spread or more, with each seed's difference; '' when none does."""
  tested = [r for r in rows if 'test' in r]
  if len(tested) < 3:
    return ''
  typical = statistics.median(r['test'].diff_std for r in tested)
  apart = [r for r in tested if typical > 0 and r['test'].diff_std >= SPREAD_APART * typical]
  if not apart:
    return ''
  return (
    'Seeds apart: '
    + '; '.join(
      f"{r['variant']}'s differences to {r['versus']} spread {r['test'].diff_std / typical:.0f}x the "
      f"table's median ({', '.join(f'seed {s}: {d:+.3f}' for s, d in sorted(r['seed_diffs'].items()))})"
      for r in apart
    )
    + f": {'its' if len(apart) == 1 else 'their'} mean, CI and verdict describe that spread; read "
    'the seeds.'
  )


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


def pool_line(rows: list[dict]) -> str:
  """'Noise: ...': the pooled σ, its degrees of freedom, and the rows set apart with their own."""
  tested = [r for r in rows if 'test' in r]
  if not tested:
    return ''
  pool = tested[0]['pool']
  line = 'Noise: '
  if pool.df:
    line += (
      f'pooled residual σ {pool.sigma:.4f} on {pool.df} df over {len(pool.rows)} rows (a paired '
      f'Δ\'s σ is √2 that: {pool.sigma * math.sqrt(2):.4f})'
    )
  else:
    line += 'no residual degrees of freedom to pool (each row keeps its own variance)'
  own = [r for r in tested if r['test'].source == 'own']
  if own:
    line += '; own variance (set apart from the pool, or its reference is): ' + ', '.join(
      f"{r['variant']} (paired std {r['test'].diff_std:.3f} on {r['test'].n - 1} df)" for r in own
    )
  return line + '.'


# The judgements of a row within noise that has not answered the paper: more seeds would.
UNRESOLVED = ('no difference detected', 'cannot resolve at this power')


def _power_line(suite: Suite, rows: list[dict]) -> str:
  """For each row within noise where the paper reports a gap: the seeds that would resolve it at
  the table's level and the same noise."""
  cells = []
  for row in rows:
    effect, test = paper_effect(suite, row, rows), row.get('test')
    if effect is None or row['judgement'] not in UNRESOLVED:
      continue
    if abs(effect) <= PAPER_SAME * abs(_reference_mean(row, rows)):
      continue  # the paper reports no difference: nothing to resolve
    pool, pooled = row['pool'], test.source == 'pooled'
    n = stats.seeds_needed(
      effect,
      sigma=pool.sigma if pooled else test.diff_std,
      rows=len(pool.rows),
      m=row['m'],
      alpha=ALPHA,
      pooled=pooled,
    )
    cells.append(f"{row['variant']} {'more than 1000' if n is None else n} (effect {effect:+.3f})")
  if not cells:
    return ''
  return (
    "Power: seeds a row within noise would need to resolve the paper's gap, taken as the "
    "same fraction of our reference row's loss (80% power at the table's level, "
    f"{ALPHA} / {rows_m(rows)} tests, the noise above): " + '; '.join(cells) + '.'
  )


def rows_m(rows: list[dict]) -> int:
  """The number of tests the rows' verdicts are corrected over."""
  return next((r['m'] for r in rows if 'm' in r), 0)


def _provenance_lines(results: dict) -> list[str]:
  """Which code, packages and device produced the table's runs: one line per group of runs that
  ran the same computation (experiments/provenance.py)."""
  groups = provenance.by_version(results['runs'])
  if not groups:
    return []
  cells = [
    f'{len(records)} runs: {provenance.label(records[0])}'
    for records in sorted(groups.values(), key=len, reverse=True)
  ]
  mixed = len(groups) > 1
  lines = [
    (
      'Provenance (MIXED: the runs come from more than one code version, package set or '
      'device; compare rows across them with care): '
      if mixed
      else 'Provenance: '
    )
    + '; '.join(cells)
    + '.'
  ]
  if results.get('reused_other_code'):
    lines[0] += ' This table was continued with --reuse_other_code.'
  # The latest check of each pair of versions (experiments/reproduce.py).
  checked = {
    frozenset((provenance.key(c['from']), provenance.key(c['under']))): c
    for c in results.get('reproduced', [])
  }
  if mixed and results.get('versions_pair'):
    lines[0] += ' ' + reproduce.pairing_sentence(results['versions_pair'])
  if mixed and checked:
    lines[0] += ' Checked: ' + ' '.join(reproduce.sentence(c) for c in checked.values())
  other = results.get('tuned_elsewhere')
  if other:
    lines[0] += (
      ' The learning rates were tuned on runs of other versions, not checked to draw as the '
      "table's do: " + '; '.join(f"{o['runs']} tuning runs: {o['label']}" for o in other) + '.'
    )
  return lines + ['']


def tuned_elsewhere(results: dict, checks: list[dict]) -> list[dict]:
  """The tuning and refining runs of versions that neither are one of the table's runs' nor are
  linked to one by `checks` (experiments/reproduce.py): [{'runs', 'label'}], by version."""
  root = reproduce.linker(checks)
  table = {root(k) for k in provenance.by_version(results['runs'])}
  found = {}
  for tuned in (results.get('tuning') or {}).values():
    points = tuned.get('points', []) + (tuned.get('refined') or {}).get('points', [])
    for point in points:
      for record in point.get('provenance', []):
        if root(provenance.key(record)) not in table:
          entry = found.setdefault(provenance.key(record), {'runs': 0})
          entry.update(runs=entry['runs'] + 1, label=provenance.label(record))
  return list(found.values())


def _lr_cell(row: dict) -> str:
  """The run's learning rate; a tuned rate at an edge of its grid says which (the best may
  lie beyond it)."""
  if row.get('lr') is None:
    return ''
  edge = EDGES.get(row.get('lr_edge'), '')
  return f"{row['lr']:.3g}{edge}"


def _tuning_line(suite: Suite, results: dict) -> str:
  tuning = results['tuning']
  runs = sum(len(p['seeds']) for t in tuning.values() for p in t['points'])
  grid = suite.lr_grid
  return (
    f"Learning rates: each variant's own, tuned first on seeds "
    f"{', '.join(map(str, results['tune_seeds']))} (not the table's): {grid.points} "
    f"log-spaced rates a factor {grid.ratio:g} apart around its configured rate, widened "
    f"past an edge where the best sat (up to {grid.max_widen} more per side); {runs} tuning "
    'runs, diverged runs counted as infinitely bad (lr_sensitivity.png). Tokens/param: '
    'training tokens per (active) parameter.' + _refined_line(suite, tuning)
  )


def _points(points: list[dict]) -> str:
  """' (rate: mean eval loss, ...)' of a tuning's points, by rate; '-' where none finished."""
  cells = [
    f"{p['lr']:.3g}: {stats.mean_std(p['eval_loss'])[0]:.4f}"
    if p['eval_loss']
    else f"{p['lr']:.3g}: -"
    for p in sorted(points, key=lambda p: p['lr'])
  ]
  return ' (' + ', '.join(cells) + ')'


def _refined_line(suite: Suite, tuning: dict) -> str:
  """The variants whose rate was refined on a half-step grid, and what it chose."""
  refined = {name: t['refined'] for name, t in tuning.items() if t.get('refined')}
  if not refined:
    return ''
  seeds = next(iter(refined.values()))['seeds']
  cells = [
    f"{name} {r['coarse_best_lr']:.3g} -> "
    + (
      f"not finished ({r.get('pending', 0)} runs to go)"
      if r['best_lr'] is None
      else f"{r['best_lr']:.3g}"
    )
    + _points(r['points'])
    for name, r in refined.items()
  ]
  return (
    f' Refined after tuning, on seeds {", ".join(map(str, seeds))}: the best rate, its half-step '
    f'neighbours (a factor √{suite.lr_grid.ratio:g}) and the mean eval loss of each; the table '
    'runs at the refined best: ' + '; '.join(cells) + '.'
  )


def write(suite: Suite, results: dict, out: str) -> str:
  """Write <out>/<suite>/results.json, results.md, the plots and the TensorBoard log; the
  markdown's path."""
  folder = os.path.join(out, suite.name)
  os.makedirs(folder, exist_ok=True)
  # Whether the table's code versions pair (experiments/reproduce.py), from every check.
  checks = reproduce.read_all(out) + reproduce.recorded(out)
  pairing = reproduce.pairing(results['runs'], checks)
  elsewhere = tuned_elsewhere(results, checks)
  checks = reproduce.relevant(results['runs'], checks)
  results = {**results, **({'reproduced': checks} if checks else {})}
  results = {**results, **({'tuned_elsewhere': elsewhere} if elsewhere else {})}
  results = {**results, **({'versions_pair': pairing} if pairing else {})}
  rows = summarize(suite, results, evidence=Evidence(out, (suite.name, results)))
  with open(os.path.join(folder, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  figures = plots.write_all(suite, results, rows, folder)
  tensorboard.write(suite, results, folder, final=('eval_loss', *EXTRA_COLUMNS))
  text = markdown(suite, results, rows)
  text += ''.join(f'\n![{os.path.basename(p)}]({os.path.basename(p)})\n' for p in figures)
  path = os.path.join(folder, 'results.md')
  with open(path, 'w') as f:
    f.write(text)
  return path
