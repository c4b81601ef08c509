"""Why a row departs from the literature, as comparisons the report recomputes from runs.

A suite's `diagnoses` maps a contradicting row to a `Diagnosis`: the runs and metric it rests on,
and a function that recomputes its numbers from the suites' results and says whether they still
support its claim. The report writes the sentence from those numbers on every run, so a re-run
that changes them changes the sentence, and a claim they no longer support is flagged
('diagnosis not supported') in results.md and overview.md instead of printed as before.

`explains=False` marks an honest non-explanation: the checks that were ruled out (each recomputed)
and what was not; the row is then counted as 'contradicts, unexplained'.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable

from experiments import stats


@dataclasses.dataclass(frozen=True)
class Finding:
  supported: bool  # the recomputed numbers still support the claim
  text: str  # the sentence, written from those numbers
  pending: bool = False  # its runs are not there (yet): the row counts as not diagnosed


class MissingRuns(LookupError):
  """The runs a diagnosis rests on are not there (a suite not run yet, a variant removed)."""


class Evidence:
  """The finished results of every suite under `out` (each suite's results.json), the suite
  being reported taken from memory (`current`: its name and results)."""

  def __init__(self, out: str | None, current: tuple[str, dict] | None = None):
    self.out = out
    self._cache = dict([current]) if current else {}

  def results(self, suite: str) -> dict:
    if suite not in self._cache:
      path = os.path.join(self.out or '', suite, 'results.json')
      if self.out is None or not os.path.exists(path):
        raise MissingRuns(f'suite {suite!r} has no results.json')
      with open(path) as f:
        self._cache[suite] = json.load(f)
    return self._cache[suite]

  def runs(self, suite: str, variant: str) -> dict[int, dict]:
    """{seed: run} of a variant's finished table runs."""
    found = {r['seed']: r for r in self.results(suite)['runs'] if r['variant'] == variant}
    if not found:
      raise MissingRuns(f'suite {suite!r} has no finished run of {variant!r}')
    return found

  def tuning(self, suite: str, variant: str) -> dict:
    tuned = self.results(suite).get('tuning', {}).get(variant)
    if not tuned or tuned.get('best_lr') is None:
      raise MissingRuns(f'suite {suite!r} has no learning-rate tuning of {variant!r}')
    return tuned


@dataclasses.dataclass(frozen=True)
class Diagnosis:
  rests_on: str  # the runs and metric, e.g. 'positions_tokens: learned − rope eval loss per seed'
  finds: Callable[[Evidence, str], Finding]  # (evidence, the row's variant) -> the finding
  explains: bool = True  # False: what was ruled out and what was not (an unexplained row)

  def find(self, evidence: Evidence, variant: str) -> Finding:
    try:
      return self.finds(evidence, variant)
    except MissingRuns as err:
      return Finding(False, f'not recomputed: {err} ({self.rests_on})', pending=True)


def _gaps_per_seed(evidence: Evidence, suite: str, variant: str, baseline: str) -> dict:
  """{seed: (steps, variant − baseline eval loss at each evaluation)} over paired seeds."""
  ours, base = evidence.runs(suite, variant), evidence.runs(suite, baseline)
  gaps = {}
  for seed in sorted(set(ours) & set(base)):
    a, b = ours[seed].get('eval_curve'), base[seed].get('eval_curve')
    if not a or not b or a['step'] != b['step']:
      raise MissingRuns(f'suite {suite!r}: seed {seed} has no matching eval curves')
    gaps[seed] = (a['step'], [x - y for x, y in zip(a['loss'], b['loss'])])
  if len(gaps) < 2:
    raise MissingRuns(f'suite {suite!r}: fewer than 2 paired seeds of {variant!r}')
  return gaps


def _tokens(run: dict, step: int) -> str:
  per_step = run['tokens'] / run['steps']
  return f'{step * per_step / 1e6:.1f} M'


def budget_rule(
  slope: stats.PairedTest, end: stats.PairedTest, shrink: stats.PairedTest | None
) -> tuple[bool, bool]:
  """token_budget's rule, (still closing, closed): the late slope's CI below zero; or the shrink
  from the table's gap (None without one) with its CI above zero and the end gap's CI reaching
  zero. A function of the three tests alone, so the simulation in
  tests/test_experiment_stats.py runs this rule and not a copy."""
  closing = slope.ci_high < 0
  closed = shrink is not None and shrink.ci_low > 0 and end.ci_low <= 0
  return closing, closed


def token_budget(suite: str, baseline: str, *, of: str | None = None) -> Diagnosis:
  """The gap is a token-budget effect: in `suite` (the rows trained longer, evaluated during
  training) the variant's gap to `baseline` is still closing late in training (the slope of the
  gap over the last half of the curve, fitted per seed, has a CI across seeds on the side of
  zero opposite the end gap: stats.late_slope), or, given `of` (the table of the contradiction,
  the same rows trained to the end of a shorter schedule), it has closed: the per-seed gap
  shrank toward zero from `of`'s to `suite`'s end (paired by seed, the shrink's CI beyond zero)
  and `suite`'s end gap has a CI reaching zero. A row ahead of `baseline` is read as one behind
  with the signs turned (its lead, not its loss, must shrink). A flat or growing gap passes each
  at most at α/2, both at most at α (simulated in tests/test_experiment_stats.py), whatever its
  peak did earlier."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    gaps = _gaps_per_seed(evidence, suite, variant, baseline)
    run = next(iter(evidence.runs(suite, variant).values()))
    steps = next(iter(gaps.values()))[0]
    curves = {s: g for s, (_, g) in gaps.items()}
    mean_at = [stats.mean_std([g[i] for g in curves.values()])[0] for i in range(len(steps))]
    ours = [evidence.runs(suite, variant)[s]['eval_loss'] for s in gaps]
    theirs = [evidence.runs(suite, baseline)[s]['eval_loss'] for s in gaps]
    test = stats.paired_test(ours, theirs)
    slope = stats.late_slope(steps, curves)
    # The rule reads the gap as "behind": a row ahead (in `of`'s table where given, else at
    # `suite`'s end) has its curves, end and shrink negated.
    sign = -1.0 if test.mean < 0 else 1.0
    shrink, since = None, ''
    if of is not None:
      shrink, pairs = _shrink(evidence, of, suite, variant, baseline)
      sign = -1.0 if stats.mean_std([b for b, _ in pairs.values()])[0] < 0 else 1.0
      since = (
        f'; from {of} (a shorter schedule, run to its end) it shrank by {shrink.mean:+.3f} '
        f'[{shrink.ci_low:+.3f}, {shrink.ci_high:+.3f}] on the {len(pairs)} seeds both share'
      )
      if sign < 0:
        shrink = stats.paired_test([a for _, a in pairs.values()], [b for b, _ in pairs.values()])
    if sign < 0:
      rule_slope = stats.late_slope(steps, {s: [-x for x in g] for s, g in curves.items()})
      closing, closed = budget_rule(rule_slope, stats.paired_test(theirs, ours), shrink)
    else:
      closing, closed = budget_rule(slope, test, shrink)
    per_m = 1e6 / (run['tokens'] / run['steps'])  # steps per million tokens
    peak = max(range(len(steps)), key=lambda i: sign * mean_at[i])
    # How far "still closing" is from closed: a slowly closing gap passes the rule as a fast one
    # does, so the text says how many more tokens the mean late slope needs to reach zero.
    trained_m = run['tokens'] / 1e6
    to_close = -test.mean / (slope.mean * per_m) if closing and test.mean != 0 else None
    text = (
      f'token budget ({suite}, {len(gaps)} seeds): the mean gap to {baseline} peaks at '
      f'{mean_at[peak]:+.3f} {_tokens(run, steps[peak])} tokens in and ends at {test.mean:+.3f} '
      f'[{test.ci_low:+.3f}, {test.ci_high:+.3f}] at {_tokens(run, steps[-1])}{since}; over the '
      f'last half it changes by {slope.mean * per_m:+.3f} per M tokens '
      f'[{slope.ci_low * per_m:+.3f}, {slope.ci_high * per_m:+.3f}] (slope per seed, CI across '
      'seeds)'
      + (
        f', still closing (at that slope, level after about {to_close:.1f} M more tokens, '
        f'{to_close / trained_m:.1f}x this run)'
        if to_close is not None
        else ', still closing'
        if closing
        else f", closed: no longer {'behind' if sign > 0 else 'ahead'}"
        if closed
        else ', not shown to be closing'
      )
    )
    return Finding(closing or closed, text)

  return Diagnosis(f'{suite}: eval loss − {baseline} per seed along training', finds)


def rates_tuned(suite: str, baseline: str) -> Callable[[Evidence, str], Finding]:
  """Ruled out, the learning rate: both rows' rates were tuned and neither best sits at an edge
  of its grid."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    ours, base = evidence.tuning(suite, variant), evidence.tuning(suite, baseline)
    inside = ours.get('edge') is None and base.get('edge') is None
    return Finding(
      inside,
      f"the learning rate (tuned per variant in {suite}: {baseline} best at {base['best_lr']:.3g}, "
      f"{variant} at {ours['best_lr']:.3g}, "
      + ('neither at an edge of its grid)' if inside else 'one at an edge of its grid)'),
    )

  return finds


def budget_ruled_out(suite: str, baseline: str) -> Callable[[Evidence, str], Finding]:
  """Ruled out, the token budget: in `suite` (4x the tokens) the mean gap at the end keeps at
  least half of its size a quarter of the way in (1 M tokens of 4 M), or the row was level or
  ahead there and is behind at the end: it is not closing."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    gaps = _gaps_per_seed(evidence, suite, variant, baseline)
    steps = next(iter(gaps.values()))[0]
    quarter = min(range(len(steps)), key=lambda i: abs(steps[i] - steps[-1] / 4))
    run = next(iter(evidence.runs(suite, variant).values()))
    early = stats.mean_std([g[quarter] for _, g in gaps.values()])[0]
    late = [g[-1] for _, g in gaps.values()]
    mean_late = stats.mean_std(late)[0]
    grown = early <= 0 < mean_late
    return Finding(
      grown or (early > 0 and mean_late >= early / 2),
      f'the token budget ({suite}: the mean gap is {early:+.3f} '
      f'{_tokens(run, steps[quarter])} tokens in and {mean_late:+.3f} at '
      f"{_tokens(run, steps[-1])}, not closing "
      f"({'behind only later' if grown else 'at least half kept'}); per seed at the end "
      f"{', '.join(f'{x:+.3f}' for x in late)})",
    )

  return finds


def unexplained(
  *checks: Callable[[Evidence, str], Finding],
  not_ruled_out: str,
  rests_on: str,
  leads: tuple[Diagnosis, ...] = (),
) -> Diagnosis:
  """A contradiction left unexplained: the recomputed `checks` (each a cause ruled out; the
  record stands while every one still holds), the causes `not_ruled_out`, and `leads`: candidate
  diagnoses whose numbers are recomputed and reported but which do not (yet) explain the row,
  e.g. one that changes several things at once or whose test does not pass."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    found = [check(evidence, variant) for check in checks]
    opened = [lead.find(evidence, variant).text for lead in leads]
    ruled_out = '; '.join(f.text for f in found) or 'nothing yet'
    return Finding(
      all(f.supported for f in found),
      f'unexplained. Ruled out: {ruled_out}. Not ruled out: {not_ruled_out}'
      + (f". Leads, not a diagnosis: {'; '.join(opened)}" if opened else ''),
    )

  return Diagnosis(rests_on, finds, explains=False)


def rate_alone(suite: str, baseline: str) -> Callable[[Evidence, str], Finding]:
  """Ruled out, the learning rate as the whole story: the rows' tuned rates differ, and at the
  variant's own best rate the tuning seeds still put it behind the baseline at that same rate."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    ours, base = evidence.tuning(suite, variant), evidence.tuning(suite, baseline)

    def at(tuned: dict, lr: float) -> float:
      for point in tuned['points']:
        if math.isclose(point['lr'], lr) and point['eval_loss']:
          return stats.mean_std(point['eval_loss'])[0]
      raise MissingRuns(f'suite {suite!r}: no tuning run at lr {lr:.3g}')

    lr_ours, lr_base = ours['best_lr'], base['best_lr']
    gap_at = {lr: at(ours, lr) - at(base, lr) for lr in (lr_base, lr_ours)}
    return Finding(
      gap_at[lr_ours] > 0,
      f'the learning rate alone ({variant} is best at {lr_ours:.3g}, {baseline} at '
      f'{lr_base:.3g}; on the tuning seeds the gap is {gap_at[lr_base]:+.3f} at {lr_base:.3g} and '
      f'{gap_at[lr_ours]:+.3f} at {lr_ours:.3g}, so a gap remains at the same rate)',
    )

  return finds


def rate_at_budget(suite: str, baseline: str) -> Callable[[Evidence, str], Finding]:
  """Ruled out, a learning rate tuned for a shorter run: in `suite` (the rows trained longer)
  both rows' rates were tuned again at its budget, neither best at an edge of that grid, and at
  those rates the variant stays behind the baseline (the paired CI above zero)."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    ours, base = evidence.tuning(suite, variant), evidence.tuning(suite, baseline)
    inside = ours.get('edge') is None and base.get('edge') is None
    test, gap = _final_gap(evidence, suite, variant, baseline)
    return Finding(
      inside and test.ci_low > 0,
      f"a rate tuned for fewer tokens (tuned again in {suite}: {baseline} best at "
      f"{base['best_lr']:.3g}, {variant} at {ours['best_lr']:.3g}, "
      + ('neither at an edge' if inside else 'one at an edge of its grid')
      + f'; at those rates the gap is {gap})',
    )

  return finds


def stays_behind(
  suite: str,
  baseline: str,
  *,
  cause: str,
  where: str,
  retuned: bool = False,
  as_variant: str | None = None,
):
  """Ruled out, `cause`: in `suite`, which removes it (`where`, e.g. "at relu's hidden width"),
  the variant still stays behind the baseline (the paired CI above zero); with `retuned`, both
  rows' rates were tuned again in `suite` and neither best sits at an edge of its grid.
  `as_variant`: the row's name in `suite` where it is another's (the cause removed by a row of
  its own, e.g. norms_2024_tuned's `olmo2`, the output norm with QK-norm)."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    there = as_variant or variant
    test, gap = _final_gap(evidence, suite, there, baseline)
    inside, rates = True, ''
    if retuned:
      inside, rates = _retuned(evidence, suite, there, baseline)
      rates = f'; rates tuned again there: {rates}'
    return Finding(
      inside and test.ci_low > 0, f'{cause} (in {suite} {where} the gap is {gap}{rates})'
    )

  return finds


def elsewhere(suite: str, baseline: str, *, where: str, as_variant: str | None = None) -> Diagnosis:
  """A lead, not a cause: the row's gap to `baseline` in `suite` (`where`: what differs there,
  e.g. "with 64-dim heads"; `as_variant`: the row's name there where it is another's), reported
  beside the row's own so that a reader sees whether it replicates."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    _, gap = _final_gap(evidence, suite, as_variant or variant, baseline)
    return Finding(True, f'{where} ({suite}) the gap to {baseline} is {gap}')

  return Diagnosis(f'{suite}: eval loss − {baseline} per seed', finds)


def width_ruled_out(suite: str, baseline: str) -> Callable[[Evidence, str], Finding]:
  """Ruled out, a narrower hidden layer: in `suite` the variant keeps the baseline's hidden
  width (at more parameters) and still stays behind it."""
  return stays_behind(
    suite, baseline, cause='a narrower hidden layer', where=f"at {baseline}'s hidden width"
  )


def closes_in(
  suite: str,
  *ruled_out: Callable[[Evidence, str], Finding],
  of: str,
  baseline: str,
  cause: str,
) -> Diagnosis:
  """The gap is `cause`'s (e.g. a small width): in `suite`, which changes only that (both rates
  tuned again there, neither at an edge of its grid), the variant is no longer behind the baseline
  (the paired CI reaches zero) and its gap shrank from `of`'s (the per-seed gaps, paired by seed:
  the same data order, the difference's CI above zero). `ruled_out`: the checks of the causes
  excluded before, recomputed and listed too; the diagnosis stands while every one holds."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    _, before_text = _final_gap(evidence, of, variant, baseline)
    after, after_text = _final_gap(evidence, suite, variant, baseline)
    inside, rates = _retuned(evidence, suite, variant, baseline)
    shrink, pairs = _shrink(evidence, of, suite, variant, baseline)
    excluded = [check(evidence, variant) for check in ruled_out]
    return Finding(
      inside and after.ci_low <= 0 < shrink.ci_low and all(f.supported for f in excluded),
      f'{cause}: the gap to {baseline} is {before_text} in {of} and {after_text} in {suite} '
      f'(both rates tuned again there: {rates}); {_shrunk(shrink, pairs, excluded)}',
    )

  return Diagnosis(f'{of} and {suite}: eval loss − {baseline} per seed', finds)


def removed_at_the_same_rate(
  suite: str,
  *ruled_out: Callable[[Evidence, str], Finding],
  as_variant: str,
  of: str,
  baseline: str,
  cause: str,
) -> Diagnosis:
  """The gap is `cause`'s, for a claim made at a fixed rate (norms_2024's 4x rows, where tuning
  again would change the question): `as_variant` in `suite` is the row with `cause` removed,
  trained at the row's own rate in `of` on the same seeds (checked run by run: the same init and
  data order), and against `of`'s baseline it is no longer behind (the paired CI reaches zero)
  while the gap shrank from the row's (paired by seed, the shrink's CI above zero). `ruled_out`
  as in closes_in."""

  def finds(evidence: Evidence, variant: str) -> Finding:
    rows, fixed = evidence.runs(of, variant), evidence.runs(suite, as_variant)
    before = _gaps(evidence, of, variant, baseline)
    after = _gaps(evidence, suite, as_variant, baseline, baseline_suite=of)
    test, after_text = _gap_test(after, suite, as_variant)
    _, before_text = _gap_test(before, of, variant)
    shrink, pairs = _paired_shrink(before, after, of, suite, variant)
    rates = sorted({rows[s]['learning_rate'] for s in pairs})
    same_rate = all(
      math.isclose(rows[s]['learning_rate'], fixed[s]['learning_rate']) for s in pairs
    )
    excluded = [check(evidence, variant) for check in ruled_out]
    return Finding(
      same_rate and test.ci_low <= 0 < shrink.ci_low and all(f.supported for f in excluded),
      f'{cause}: the gap to {baseline} is {before_text} in {of} and, with it removed '
      f'({as_variant} in {suite}, '
      + (
        f"at the same rate, {', '.join(f'{r:.3g}' for r in rates)}"
        if same_rate
        else 'not at the same rate'
      )
      + f'), {after_text}; {_shrunk(shrink, pairs, excluded)}',
    )

  return Diagnosis(f'{of} and {suite}: eval loss − {of} {baseline} per seed', finds)


def _shrunk(shrink: stats.PairedTest, pairs: dict, excluded: list[Finding]) -> str:
  """'it shrinks by +m [lo, hi] on the n seeds both share, on k of them', and the causes ruled
  out first (closes_in, removed_at_the_same_rate)."""
  return (
    f'it shrinks by {shrink.mean:+.3f} [{shrink.ci_low:+.3f}, {shrink.ci_high:+.3f}] on the '
    f'{len(pairs)} seeds both share, on {sum(b > a for b, a in pairs.values())} of them'
    + (f". Ruled out first: {'; '.join(f.text for f in excluded)}" if excluded else '')
  )


def _retuned(evidence: Evidence, suite: str, variant: str, baseline: str) -> tuple[bool, str]:
  """Whether both rows' rates, tuned again in `suite`, are inside their grids, and
  '{baseline} best at x, {variant} at y, neither at an edge'."""
  ours, base = evidence.tuning(suite, variant), evidence.tuning(suite, baseline)
  inside = ours.get('edge') is None and base.get('edge') is None
  return inside, (
    f"{baseline} best at {base['best_lr']:.3g}, {variant} at {ours['best_lr']:.3g}, "
    + ('neither at an edge' if inside else 'one at an edge')
  )


def _gaps(
  evidence: Evidence, suite: str, variant: str, baseline: str, baseline_suite: str | None = None
) -> dict[int, float]:
  """{seed: variant − baseline final eval loss} over the seeds both rows finished, the variant
  from `suite` and the baseline from `baseline_suite` (default: the same suite)."""
  runs = evidence.runs(suite, variant)
  base_runs = evidence.runs(baseline_suite or suite, baseline)
  return {
    s: runs[s]['eval_loss'] - base_runs[s]['eval_loss'] for s in sorted(set(runs) & set(base_runs))
  }


def _shrink(evidence: Evidence, of: str, suite: str, variant: str, baseline: str):
  """How far the variant's final gap to `baseline` shrank from suite `of` to `suite`: the paired
  test of the per-seed gaps (same seed, same data order) and {seed: (gap in of, gap in suite)}
  over the seeds both finished."""
  before, after = (_gaps(evidence, name, variant, baseline) for name in (of, suite))
  return _paired_shrink(before, after, of, suite, variant)


def _paired_shrink(before: dict, after: dict, of: str, suite: str, variant: str):
  """The paired test of the per-seed gaps `before` minus `after`, and {seed: (before, after)}."""
  pairs = {s: (before[s], after[s]) for s in sorted(set(before) & set(after))}
  if len(pairs) < 2:
    raise MissingRuns(f'suites {of!r} and {suite!r} share fewer than 2 seeds of {variant!r}')
  test = stats.paired_test([b for b, _ in pairs.values()], [a for _, a in pairs.values()])
  return test, pairs


def _final_gap(evidence: Evidence, suite: str, variant: str, baseline: str):
  """The paired test of variant − baseline eval loss in `suite`, and '+m [lo, hi] over n seeds'."""
  return _gap_test(_gaps(evidence, suite, variant, baseline), suite, variant)


def _gap_test(gaps: dict[int, float], suite: str, variant: str):
  """The test of per-seed gaps against zero, and '+m [lo, hi] over n seeds'."""
  if len(gaps) < 2:
    raise MissingRuns(f'suite {suite!r}: fewer than 2 paired seeds of {variant!r}')
  test = stats.paired_test(list(gaps.values()), [0.0] * len(gaps))
  return test, f'{test.mean:+.3f} [{test.ci_low:+.3f}, {test.ci_high:+.3f}] over {len(gaps)} seeds'
