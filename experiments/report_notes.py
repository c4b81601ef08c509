"""The lines of results.md above and below the table: how rows are compared, provenance, where
the learning rates come from, the noise, power, seeds set apart, cost and failed runs."""

from __future__ import annotations

import math
import statistics

from experiments import provenance, reproduce, stats, verdicts
from experiments.suite import Suite


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


def preamble(suite: Suite, results: dict) -> list[str]:
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
    f'< {verdicts.ALPHA}). "Could see": the smallest Δ the row detects with 80% power at that level '
    '(noncentral t). The "vs paper" column: agrees (significant, the literature\'s '
    "direction, and its size where the paper gives one: the measured gap over the paper's "
    'gap as the same fraction of our reference row, with its simultaneous CI); direction, not '
    "size; rules out the paper's gap (no difference, and the CI excludes the paper's gap); "
    "cannot resolve (no difference, and the paper's gap is below what the row could see); no "
    'difference detected; contradicts (with its diagnosis, recomputed from the runs it rests '
    'on).',
    '',
  ]
  lines += provenance_lines(results)
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
  """', N M training tokens (early training: x tokens/param)' from the runs, where they say."""
  runs = [r for r in results['runs'] if r.get('tokens') and r.get('active_params')]
  if not runs:
    return ''
  tokens = statistics.median(r['tokens'] for r in runs)
  per_param = [r['tokens'] / r['active_params'] for r in runs]
  return f', {tokens / 1e6:.2g} M training tokens ({tokens_per_param(per_param)})'


def tokens_per_param(per_param: list[float], *, short: bool = False) -> str:
  """The span of training tokens per parameter, marked as early training where any row is below
  EARLY_TRAINING: a table whose widths or budgets vary (mup_transfer 0.5-7.8) is early training
  in its smaller-budget rows even where its largest is not."""
  low, high = min(per_param), max(per_param)
  span = f'{low:.2g}' if f'{low:.2g}' == f'{high:.2g}' else f'{low:.2g}-{high:.2g}'
  if high < EARLY_TRAINING:
    return f'{span} (early training)' if short else f'early training: {span} tokens/param'
  if low < EARLY_TRAINING:
    below = f'early training below {EARLY_TRAINING:g}'
    return f'{span} ({below})' if short else f'{span} tokens/param; rows {below}'
  return span if short else f'{span} tokens/param'


# Below this many training tokens per parameter a table is early training: its rankings may
# still change (ffn: SwiGLU level with ReLU at 1.2 tokens/param, 0.16 behind at 4.8).
EARLY_TRAINING = 4.0


def below(suite: Suite, results: dict, rows: list[dict]) -> list[str]:
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


def pool_line(rows: list[dict]) -> str:
  """'Noise: ...': the pooled σ, its degrees of freedom, and the rows set apart with their own;
  a noise family of its own (Variant.noise) gets its own pool, named."""
  tested = [r for r in rows if 'test' in r]
  if not tested:
    return ''
  pools = {
    r.get('noise', ''): r['pool'] for r in sorted(tested, key=lambda r: bool(r.get('noise')))
  }
  cells = []
  for family, pool in pools.items():
    where = f'rows {family} (pooled apart): ' if family else ''
    if pool.df:
      cells.append(
        f'{where}pooled residual σ {pool.sigma:.4f} on {pool.df} df over {len(pool.rows)} rows '
        f'(a paired Δ\'s σ is √2 that: {pool.sigma * math.sqrt(2):.4f})'
      )
    else:
      cells.append(
        f'{where}no residual degrees of freedom to pool (each row keeps its own variance)'
      )
  line = 'Noise: ' + '; '.join(cells)
  own = [r for r in tested if r['test'].source == 'own']
  if own:
    across = ', or it is compared across two noise families' if len(pools) > 1 else ''
    line += f'; own variance (set apart from the pool, or its reference is{across}): ' + ', '.join(
      f"{r['variant']} (paired std {r['test'].diff_std:.3f} on {r['test'].n - 1} df)" for r in own
    )
  return line + '.'


def _power_line(suite: Suite, rows: list[dict]) -> str:
  """For each row within noise where the paper reports a gap: the seeds that would resolve it at
  the table's level and the same noise."""
  cells = []
  for row in rows:
    effect, test = verdicts.paper_effect(suite, row, rows), row.get('test')
    if effect is None or row['judgement'] not in verdicts.UNRESOLVED:
      continue
    if abs(effect) <= verdicts.PAPER_SAME * abs(verdicts.reference_mean(row, rows)):
      continue  # the paper reports no difference: nothing to resolve
    pool, pooled = row['pool'], test.source == 'pooled'
    n = stats.seeds_needed(
      effect,
      sigma=pool.sigma if pooled else test.diff_std,
      rows=len(pool.rows),
      m=row['m'],
      alpha=verdicts.ALPHA,
      pooled=pooled,
    )
    cells.append(f"{row['variant']} {'more than 1000' if n is None else n} (effect {effect:+.3f})")
  if not cells:
    return ''
  return (
    "Power: seeds a row within noise would need to resolve the paper's gap, taken as the "
    "same fraction of our reference row's loss (80% power at the table's level, "
    f"{verdicts.ALPHA} / {verdicts.rows_m(rows)} tests, the noise above): " + '; '.join(cells) + '.'
  )


def provenance_lines(results: dict) -> list[str]:
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
  hosts = provenance.by_host(results['runs'])
  if set(hosts) != {'not recorded'}:
    lines[0] += (
      (
        ' Hosts (not part of a run\'s identity: another CPU sums in another order, a perturbation '
        'like a new draw of noise): '
        if len(hosts) > 1
        else ' Host: '
      )
      + provenance.hosts_phrase(hosts)
      + '.'
    )
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
