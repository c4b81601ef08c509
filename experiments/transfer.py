"""Does the best learning rate transfer across widths? (Tensor Programs V, Yang et al. 2022,
Figure 1.) For a suite with `Suite.lr_transfer` ({family: {variant: width}}), results.md gets
each family's tuned best rate per width and the slope of log2(best rate) against log2(width),
fitted by least squares: about 0 where the rate transfers (µP), about −1 where it halves per
doubling (the standard parametrization under Adam, TP5 Sec. 1). A best rate at an edge of its
grid is marked: the true best lies beyond it and the slope is then a bound.

Each family with an expected slope (`Suite.lr_transfer_expect`: TP5's 0 under µP, −1 under the
standard parametrization) is a claim the overview counts (`claims`): the slope of the
interpolated best rates (the vertex of a parabola through each row's best grid point and its
neighbours) with its least-squares CI (t on n − 2 df, simultaneous over the suite's claims).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats as sps

from experiments import stats

# |slope| under this reads as flat: less than half a factor 2 per doubling of the width.
FLAT = 0.5


def slope(widths: list[int], rates: list[float]) -> float | None:
  """The least-squares slope of log2(rate) against log2(width); None below two widths."""
  if len(widths) < 2:
    return None
  return float(np.polyfit(np.log2(widths), np.log2(rates), 1)[0])


def lines(suite, results: dict) -> list[str]:
  tuning = results.get('tuning') or {}
  out = []
  for family, widths in suite.lr_transfer.items():
    found = [
      (width, tuning[name]['best_lr'], tuning[name].get('edge'))
      for name, width in sorted(widths.items(), key=lambda kv: kv[1])
      if name in tuning and tuning[name].get('best_lr') is not None
    ]
    if not found:
      continue
    fitted = slope([w for w, _, _ in found], [lr for _, lr, _ in found])
    cells = ', '.join(f"d{w}: {lr:.3g}{' (edge)' if edge else ''}" for w, lr, edge in found)
    if fitted is None:
      reading = 'one width so far'
    else:
      shape = 'flat' if abs(fitted) < FLAT else ('falls' if fitted < 0 else 'rises')
      reading = f'slope {fitted:+.2f} per doubling: {shape}'
    per_doubling = '' if fitted is None else f' (x{2**fitted:.2f} per doubling of the width)'
    out += ['', f'Best rate by width, {family}: {cells}; {reading}{per_doubling}.']
  return out


def best_log2_rate(points: list[dict]) -> tuple[float, bool] | None:
  """(log2 of a row's best rate, whether it sits at an edge of the grid) from its tuning
  points: inside the grid, the vertex of the parabola in log2(rate) through the best point and
  its two neighbours (kept between them), which a factor-2 grid alone would round; at an edge,
  the edge's rate. None without a finite loss."""
  curve = sorted(
    (p['lr'], float(np.mean(p['eval_loss'])))
    for p in points
    if p['eval_loss'] and all(x is not None and math.isfinite(x) for x in p['eval_loss'])
  )
  if not curve:
    return None
  x = np.log2([lr for lr, _ in curve])
  y = np.array([loss for _, loss in curve])
  i = int(np.argmin(y))
  if i in (0, len(curve) - 1):
    return float(x[i]), True
  a, b, _ = np.polyfit(x[i - 1 : i + 2], y[i - 1 : i + 2], 2)
  return float(np.clip(-b / (2 * a), x[i - 1], x[i + 1])), False


@dataclasses.dataclass(frozen=True)
class Claim:
  family: str
  expected: float  # the paper's slope of log2(best rate) per doubling of the width
  test: stats.Contrast | None  # the fitted slope (mean) and its standard error; None: not judged
  judgement: str  # a verdicts.CATEGORIES entry, or '' (not judged)
  cell: str

  @property
  def label(self) -> str:
    return f'{self.family}, best rate against width'


def _judge(test: stats.Contrast, m: int, expected: float) -> tuple[str, str]:
  """(category, cell) of a fitted slope against the paper's, from its CI at α / m. A flat claim
  (0) is an equivalence test: 'agrees' with the CI inside ±FLAT, 'contradicts' with it outside,
  else 'cannot resolve at this power'; a slope of e ≠ 0 is judged as a row's effect is
  (verdicts.judge_effect)."""
  from experiments import verdicts

  if expected != 0:
    category = verdicts.judge_effect(test, m, expected)
    return category, category
  low, high = test.ci(m, verdicts.ALPHA)
  if low >= -FLAT and high <= FLAT:
    return 'agrees', f'agrees (within ±{FLAT})'
  if high < -FLAT or low > FLAT:
    return 'contradicts', 'contradicts'
  return 'cannot resolve at this power', f'cannot resolve: the CI reaches past ±{FLAT}'


def claims(suite, results: dict, *, evidence=None, family: int | None = None) -> list[Claim]:
  """Each family of `suite.lr_transfer_expect`: its slope and CI at α / m over `family` tests
  (default: the suite's claims), judged against the paper's slope by `_judge`; a contradiction
  takes its diagnosis (`suite.diagnoses['family: slope']`, recomputed from `evidence`). A family
  with a best rate at an edge, or under three widths, is not judged."""
  from experiments import verdicts
  from experiments.diagnosis import Evidence

  tuning = results.get('tuning') or {}
  evidence = evidence or Evidence(None, (suite.name, results))
  read = []
  for name, expected in suite.lr_transfer_expect.items():
    widths = suite.lr_transfer[name]
    found = [
      (width, best)
      for variant, width in sorted(widths.items(), key=lambda kv: kv[1])
      if variant in tuning and (best := best_log2_rate(tuning[variant]['points'])) is not None
    ]
    why = (
      'under three widths'
      if len(found) < 3
      else 'a best rate at an edge of its grid'
      if any(edge for _, (_, edge) in found)
      else ''
    )
    read.append((name, expected, found, why))
  m = family or sum(not why for *_, why in read)
  out = []
  for name, expected, found, why in read:
    if why:
      out.append(Claim(name, expected, None, '', f'not judged: {why}'))
      continue
    fit = sps.linregress(np.log2([w for w, _ in found]), [x for _, (x, _) in found])
    df = len(found) - 2
    test = stats.Contrast(
      n=len(found), mean=fit.slope, se=fit.stderr, df=df, source='own', diff_std=math.nan
    )
    judgement, cell = _judge(test, m, expected)
    if judgement == 'contradicts':
      judgement, cell = verdicts.contradiction(suite, f'{name}: slope', evidence)
    out.append(Claim(name, expected, test, judgement, cell))
  return out


def claim_lines(suite, results: dict, *, evidence=None) -> list[str]:
  """results.md's list of the transfer claims (`claims`) with slope, CI and judgement."""
  from experiments import verdicts

  found = claims(suite, results, evidence=evidence)
  m = sum(c.test is not None for c in found)
  out = []
  for c in found:
    shown = ''
    if c.test is not None:
      low, high = c.test.ci(m, verdicts.ALPHA)
      shown = f' {c.test.mean:+.2f} [{low:+.2f}, {high:+.2f}] on {c.test.df:g} df;'
    out.append(f'- {c.family}: slope{shown} {c.cell} (the paper: {c.expected:+g})')
  if out:
    out = [
      '',
      'The paper\'s claims (Tensor Programs V, Fig. 1): the slope of log2(best rate) against '
      'log2(width), each row\'s best rate interpolated (a parabola through its best grid point '
      'and neighbours), with its least-squares CI simultaneous over the '
      f'{m} judged claims; a flat slope agrees with the CI inside ±{FLAT}, a falling one with '
      "the CI below 0 holding the paper's.",
      '',
    ] + out
  return out
