"""The statistics of a suite's table, from SciPy and statsmodels.

A suite is a blocked design: every row (variant) is trained on the same seeds, and seed s gives
every row the same data order and initialisation. So a final loss is modelled as
    y_rs = μ_r + β_s + ε_rs,   ε_rs ~ N(0, σ²)            (two-way additive model, rows × seeds)
and σ² is estimated from all rows at once, on (rows − 1)(seeds − 1) residual degrees of freedom
(Montgomery, Design and Analysis of Experiments, §4.1: the randomized complete block design),
instead of from each row's own 2-4 paired differences. A row's Δ to its reference is the
contrast μ_v − μ_ref of that fit (statsmodels' OLS and its t_test).

The pool assumes one σ for every row. A row whose own paired differences spread far more than
the pool allows (a seed that diverged, Post-LN without warm-up) is set apart: an F-test of its
paired-difference variance against 2σ² of the pool without it, at level APART_ALPHA; such a row
keeps its own variance (a plain paired t-test, n − 1 df) and the pool is fitted again without it.

One correction for tests and intervals (Bonferroni over the m tests of a family): a row is
significant exactly when its simultaneous CI, at level 1 − α/m, excludes zero, so a verdict and
its CI never disagree. Power is the noncentral t's (Cohen 1988, §2.3; SciPy's `nct`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import optimize
from scipy import stats as sps

# A row's own variance is set apart from the pool when its F-test against the pool rejects at
# this level: rare under one common σ (a simulation checks the family's error rate stays <= α).
APART_ALPHA = 0.01


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (n − 1; 0 for a single value)."""
  values = np.asarray(values, np.float64)
  if len(values) < 2:
    return float(values.mean()), 0.0
  return float(values.mean()), float(values.std(ddof=1))


@dataclasses.dataclass(frozen=True)
class Contrast:
  """variant − reference: the mean difference, its standard error on `df` degrees of freedom,
  and where the variance comes from ('pooled': the suite's additive model; 'own': the row's
  paired differences alone). `diff_std` is the row's own paired-difference std (for display)."""

  n: int  # paired seeds
  mean: float
  se: float
  df: float
  source: str
  diff_std: float

  @property
  def t(self) -> float:
    if self.se == 0.0:
      return 0.0 if self.mean == 0.0 else math.copysign(math.inf, self.mean)
    return self.mean / self.se

  @property
  def p(self) -> float:
    """The two-sided p-value of one test (no correction)."""
    return float(2.0 * sps.t.sf(abs(self.t), self.df))

  def p_adjusted(self, m: int) -> float:
    """Bonferroni's adjusted p over a family of m tests: min(1, m·p) (Dunn 1961)."""
    return min(1.0, m * self.p)

  def ci(self, m: int = 1, alpha: float = 0.05) -> tuple[float, float]:
    """The CI that holds jointly with m − 1 others at level 1 − alpha: mean ± t_{1−α/(2m), df}·se."""
    if m < 1:
      raise ValueError(f'm={m}: allowed a positive number of tests')
    half = float(sps.t.ppf(1.0 - alpha / (2.0 * m), self.df)) * self.se
    return self.mean - half, self.mean + half

  def significant(self, m: int = 1, alpha: float = 0.05) -> bool:
    """The test at level alpha/m rejects, which is the same as ci(m, alpha) excluding zero."""
    low, high = self.ci(m, alpha)
    return low > 0.0 or high < 0.0

  def detectable(self, m: int = 1, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference this test (at level alpha/m) detects with `power`."""
    return detectable_effect(self.se, self.df, alpha=alpha / m, power=power)


def power_of(effect: float, se: float, df: float, *, alpha: float = 0.05) -> float:
  """P(two-sided t-test at level alpha rejects) when the true difference is `effect` and the
  estimate has standard error se on df degrees of freedom: the noncentral t with λ = effect/se,
      P(|T_{df, λ}| > t_{1−α/2, df})."""
  if se <= 0.0:
    return 1.0 if effect else alpha
  crit = sps.t.ppf(1.0 - alpha / 2.0, df)
  nc = abs(effect) / se
  # The far tail (a rejection of the wrong sign) is tiny where SciPy's nct returns NaN for it.
  wrong_sign = float(np.nan_to_num(sps.nct.cdf(-crit, df, nc)))
  return float(sps.nct.sf(crit, df, nc)) + wrong_sign


def detectable_effect(se: float, df: float, *, alpha: float = 0.05, power: float = 0.8) -> float:
  """The minimum detectable effect: the difference at which a two-sided t-test at level alpha,
  with standard error se on df degrees of freedom, has the given power (noncentral t, solved
  for its noncentrality by Brent's method)."""
  if se <= 0.0:
    return 0.0
  if df < 1:
    return math.inf
  gap = lambda lam: power_of(lam, 1.0, df, alpha=alpha) - power  # noqa: E731
  high = 2.0
  while gap(high) < 0.0:
    high *= 2.0
  return optimize.brentq(gap, 0.0, high) * se


@dataclasses.dataclass(frozen=True)
class PairedTest:
  """variant − baseline over paired seeds: the mean difference, its CI and the t-test."""

  n: int
  mean: float
  std: float
  ci_low: float
  ci_high: float
  t: float
  p: float


def paired_test(
  variant: Sequence[float], baseline: Sequence[float], confidence: float = 0.95
) -> PairedTest:
  """Paired t-test of variant against baseline (same seeds, same order; scipy.stats.ttest_rel).
  Needs n >= 2 pairs."""
  if len(variant) != len(baseline):
    raise ValueError(f'{len(variant)} variant values but {len(baseline)} baseline values')
  diffs = np.asarray(variant, np.float64) - np.asarray(baseline, np.float64)
  n = len(diffs)
  if n < 2:
    raise ValueError(f'a paired t-test needs at least 2 seeds, got {n}')
  mean, std = mean_std(diffs)
  if std == 0.0:  # identical differences: no spread to test against
    t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    return PairedTest(n, mean, std, mean, mean, t, 1.0 if mean == 0.0 else 0.0)
  result = sps.ttest_rel(np.asarray(variant, np.float64), np.asarray(baseline, np.float64))
  low, high = result.confidence_interval(confidence)
  return PairedTest(
    n, mean, std, float(low), float(high), float(result.statistic), float(result.pvalue)
  )


def own_contrast(diffs: Sequence[float]) -> Contrast:
  """A row's Δ from its own paired differences alone (the paired t-test's standard error)."""
  n = len(diffs)
  mean, std = mean_std(diffs)
  return Contrast(n, mean, std / math.sqrt(n), n - 1, 'own', std)


Table = Mapping[str, Mapping[int, float]]  # row -> {seed: value}


@dataclasses.dataclass(frozen=True)
class Pool:
  """The additive model fitted to the pooled rows: residual std, its df, and the rows set apart."""

  sigma: float
  df: int
  rows: tuple[str, ...]
  apart: tuple[str, ...]


def _fit(table: Table, rows: Sequence[str]):
  """statsmodels OLS of y ~ row + seed (treatment coding: the first row and seed absorbed in the
  intercept) over the cells of `rows`; (fit, row names, seed list) or None without residual df."""
  import statsmodels.api as sm

  cells = [(r, s, table[r][s]) for r in rows for s in sorted(table[r])]
  if not cells:
    return None
  seeds = sorted({s for _, s, _ in cells})
  X = np.zeros((len(cells), len(rows) + len(seeds) - 1))
  X[:, 0] = 1.0
  for i, (r, s, _) in enumerate(cells):
    k = rows.index(r)
    if k:
      X[i, k] = 1.0
    j = seeds.index(s)
    if j:
      X[i, len(rows) - 1 + j] = 1.0
  y = np.array([v for _, _, v in cells])
  if len(y) <= np.linalg.matrix_rank(X):
    return None
  return sm.OLS(y, X).fit(), list(rows), seeds


def _paired_diffs(table: Table, variant: str, reference: str) -> list[float]:
  seeds = sorted(set(table[variant]) & set(table[reference]))
  return [table[variant][s] - table[reference][s] for s in seeds]


def pool_rows(table: Table, pairs: Sequence[tuple[str, str]], apart_alpha: float = APART_ALPHA):
  """The rows whose variance is pooled: every row of `table`, less those set apart one at a time
  (the most extreme first) while a variant's paired-difference variance s² over its reference's
  is too large for the pool fitted without it: P(F_{n−1, df} > s² / 2σ²) < apart_alpha. Returns
  the Pool and the final fit (None when no residual df is left)."""
  rows = [r for r in table if len(table[r]) >= 1]
  apart: list[str] = []
  while True:
    worst, worst_p = None, apart_alpha
    for variant, reference in pairs:
      if variant in apart or reference not in rows or variant not in rows:
        continue
      diffs = _paired_diffs(table, variant, reference)
      if len(diffs) < 2:
        continue
      others = [r for r in rows if r != variant]
      fitted = _fit(table, others)
      if fitted is None:
        continue
      fit = fitted[0]
      ratio = mean_std(diffs)[1] ** 2 / (2.0 * fit.scale)
      p = float(sps.f.sf(ratio, len(diffs) - 1, fit.df_resid))
      if p < worst_p:
        worst, worst_p = variant, p
    if worst is None:
      break
    apart.append(worst)
    rows.remove(worst)
  fitted = _fit(table, rows)
  if fitted is None:
    return Pool(math.nan, 0, tuple(rows), tuple(apart)), None
  fit = fitted[0]
  return Pool(math.sqrt(fit.scale), int(fit.df_resid), tuple(rows), tuple(apart)), fitted


def contrasts(
  table: Table,
  pairs: Sequence[tuple[str, str]],
  apart_alpha: float = APART_ALPHA,
  families: Mapping[str, str] | None = None,
) -> tuple[dict[str, Contrast], dict[str, Pool]]:
  """Each (variant, reference) pair's Δ: from its noise family's pooled additive model, or for a
  row set apart (or whose reference is), from its own paired differences. `families` (row ->
  family; default one family, '') keeps measurements of another kind apart: each family is
  pooled on its own (e.g. losses at 4x the training context, which spread more across seeds
  than those at it), and a pair across two families takes its own differences. Pairs with fewer
  than 2 paired seeds get none. Returns the contrasts and each family's Pool (always one for
  the default family '')."""
  family = {row: (families or {}).get(row, '') for row in table}
  fits = {}
  for name in dict.fromkeys(['', *family.values()]):
    rows = {r: v for r, v in table.items() if family[r] == name}
    inside = [(v, r) for v, r in pairs if family.get(v) == name and family.get(r) == name]
    fits[name] = pool_rows(rows, inside, apart_alpha)
  out = {}
  for variant, reference in pairs:
    diffs = _paired_diffs(table, variant, reference)
    if len(diffs) < 2:
      continue
    own_std = mean_std(diffs)[1]
    pool, fitted = fits[family[variant]]
    if (
      fitted is None
      or family[reference] != family[variant]
      or variant not in pool.rows
      or reference not in pool.rows
    ):
      out[variant] = own_contrast(diffs)
      continue
    fit, rows, _ = fitted
    vector = np.zeros(fit.params.shape[0])
    for name, sign in ((variant, 1.0), (reference, -1.0)):
      k = rows.index(name)
      if k:
        vector[k] += sign
    result = fit.t_test(vector)
    out[variant] = Contrast(
      len(diffs),
      float(np.squeeze(result.effect)),
      float(np.squeeze(result.sd)),
      float(fit.df_resid),
      'pooled',
      own_std,
    )
  return out, {name: pool for name, (pool, _) in fits.items()}


def verdict(contrast: Contrast, m: int, *, lower_is_better: bool = True, alpha: float = 0.05):
  """'better', 'worse' or 'within noise' for variant vs reference, at level alpha over m tests
  (the simultaneous CI excludes zero, or not)."""
  if not contrast.significant(m, alpha):
    return 'within noise'
  improved = contrast.mean < 0 if lower_is_better else contrast.mean > 0
  return 'better' if improved else 'worse'


def seeds_needed(
  effect: float,
  *,
  sigma: float,
  rows: int,
  m: int,
  alpha: float = 0.05,
  power: float = 0.8,
  pooled: bool = True,
  max_n: int = 1000,
) -> int | None:
  """The fewest paired seeds n at which a row's Δ of `effect` is detected with `power` at level
  alpha/m, with the standard error `planned_se` gives. None past max_n."""
  if effect == 0.0:
    return None
  for n in range(2, max_n + 1):
    se, df = planned_se(sigma, n, rows=rows, pooled=pooled)
    if power_of(effect, se, df, alpha=alpha / m) >= power:
      return n
  return None


def planned_se(sigma: float, n: int, *, rows: int, pooled: bool = True) -> tuple[float, float]:
  """(standard error, df) of a row's Δ over n complete seeds: pooled over `rows` rows with
  residual σ, σ·√(2/n) on (rows − 1)(n − 1) df; or from the row's own paired differences of std
  σ, σ/√n on n − 1 df."""
  if pooled:
    return sigma * math.sqrt(2.0 / n), (rows - 1) * (n - 1)
  return sigma / math.sqrt(n), n - 1


def late_slope(steps: Sequence[float], gaps: Mapping[int, Sequence[float]]) -> PairedTest:
  """Whether a gap is still closing late in training: per seed, the least-squares slope of the
  gap over the last half of the curve (steps >= half the last step; scipy.stats.linregress),
  and the one-sample t-test of those slopes across seeds (its CI, 95%). A closing gap has a CI
  below zero; a flat or growing one reaches or passes zero (a simulation checks it passes at
  most at α/2). Slopes are per step."""
  steps = np.asarray(steps, np.float64)
  late = steps >= steps[-1] / 2.0
  if late.sum() < 3:
    raise ValueError(f'{int(late.sum())} evaluations in the last half; allowed: at least 3')
  slopes = [
    sps.linregress(steps[late], np.asarray(g, np.float64)[late]).slope for g in gaps.values()
  ]
  return paired_test(slopes, [0.0] * len(slopes))
