"""The suite statistics against published worked examples (Student's sleep data; Montgomery's
randomized complete block example), against SciPy's own paired t-test, and by simulation with the
noise the suites measured: the family's false-positive rate on null rows, the power the formula
names, and the late-slope test of a token-budget diagnosis on flat, growing and closing gaps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from experiments import stats

DRUG1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
DRUG2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]

# Montgomery, Design and Analysis of Experiments (5th ed.), Example 4.1: vascular graft yield at
# four extrusion pressures (rows) in six batches of resin (blocks). Table 4.4: SS_treatments
# 178.17, SS_blocks 192.25, SS_E 109.89 on 15 df, MS_E 7.33, F0 = 8.11.
GRAFT = {
  '8500': [90.3, 89.2, 98.2, 93.9, 87.4, 97.9],
  '8700': [92.5, 89.5, 90.6, 94.7, 87.0, 95.8],
  '8900': [85.5, 90.8, 89.6, 86.2, 88.0, 93.4],
  '9100': [82.5, 89.5, 85.6, 87.4, 78.9, 90.7],
}

# The noise the `ffn` table measured (9 rows x 5 seeds at 1 M tokens): residual σ 0.0133.
SIGMA = 0.0133


def _table(rows: dict) -> dict:
  return {name: dict(enumerate(values)) for name, values in rows.items()}


def test_paired_test_on_the_sleep_data():
  """Extra hours of sleep with two drugs on the same 10 patients (Cushny & Peebles 1905).
  R: t = -4.0621, df = 9, p-value = 0.002833, 95% CI -2.4598858 -0.7001142, mean diff -1.58."""
  test = stats.paired_test(DRUG1, DRUG2)
  assert test.n == 10 and test.mean == pytest.approx(-1.58)
  assert test.t == pytest.approx(-4.0621, abs=1e-4)
  assert test.p == pytest.approx(0.002833, abs=1e-6)
  assert test.ci_low == pytest.approx(-2.4598858, abs=1e-6)
  assert test.ci_high == pytest.approx(-0.7001142, abs=1e-6)


def test_the_block_model_reproduces_montgomerys_anova():
  """The pooled residual variance is the ANOVA's MS_E (7.33 on 15 df, F0 = 8.11 for the
  treatments' MS 178.17 / 3), and a contrast's standard error is √(2·MS_E / blocks)."""
  table = _table(GRAFT)
  pairs = [(name, '8500') for name in ('8700', '8900', '9100')]
  found, pools = stats.contrasts(table, pairs)
  pool = pools['']
  assert pool.df == 15 and pool.apart == ()
  assert pool.sigma**2 == pytest.approx(109.89 / 15, abs=5e-3)
  assert (178.17 / 3) / pool.sigma**2 == pytest.approx(8.11, abs=5e-3)
  low = found['9100']
  assert low.mean == pytest.approx(np.mean(GRAFT['9100']) - np.mean(GRAFT['8500']))
  assert low.se == pytest.approx(math.sqrt(2 * pool.sigma**2 / 6))
  assert low.df == 15 and low.source == 'pooled'
  assert low.p == pytest.approx(2 * sps.t.sf(abs(low.mean) / low.se, 15))


def test_two_rows_pool_to_scipys_paired_t_test():
  """With one variant and its reference, the additive model is the paired t-test: the same t, p
  and 95% CI as scipy.stats.ttest_rel, on n − 1 df."""
  found, pools = stats.contrasts(_table({'b': DRUG2, 'a': DRUG1}), [('a', 'b')])
  pool = pools['']
  reference = sps.ttest_rel(DRUG1, DRUG2)
  contrast = found['a']
  assert pool.df == 9
  assert contrast.t == pytest.approx(reference.statistic, rel=1e-10)
  assert contrast.p == pytest.approx(reference.pvalue, rel=1e-8)
  assert contrast.ci() == pytest.approx(tuple(reference.confidence_interval()), rel=1e-10)


def test_a_test_and_its_interval_never_disagree():
  """Bonferroni over m: p·m < α exactly when the CI at 1 − α/m excludes zero, at every m."""
  rng = np.random.default_rng(3)
  for _ in range(200):
    contrast = stats.Contrast(5, float(rng.normal(0, 0.03)), 0.01, 32.0, 'pooled', 0.02)
    for m in (1, 8, 86):
      assert (contrast.p_adjusted(m) < 0.05) == contrast.significant(m)
      assert (stats.verdict(contrast, m) != 'within noise') == contrast.significant(m)
  with pytest.raises(ValueError, match='m=0'):
    contrast.ci(0)


def test_a_row_with_a_diverging_seed_keeps_its_own_variance():
  """norms' Post-LN with warm-up: one seed of three at +2.4, the others near the baseline. It is
  set apart (its own paired t, 2 df); the other rows pool without it."""
  rng = np.random.default_rng(0)
  base = rng.normal(3.0, 0.05, 3)
  rows = {'base': base} | {f'r{i}': base + rng.normal(0.01 * i, SIGMA, 3) for i in range(6)}
  rows['stalled'] = base + np.array([0.02, 2.4, 0.03])
  found, pools = stats.contrasts(_table(rows), [(r, 'base') for r in rows if r != 'base'])
  pool = pools['']
  assert pool.apart == ('stalled',) and 'stalled' not in pool.rows
  assert found['stalled'].source == 'own' and found['stalled'].df == 2
  own = stats.paired_test(rows['stalled'], base)
  assert found['stalled'].ci() == pytest.approx((own.ci_low, own.ci_high))
  assert all(found[f'r{i}'].source == 'pooled' and found[f'r{i}'].df == 12 for i in range(6))
  assert pool.sigma < 3 * SIGMA


def _simulate(effects: list[float], seeds: int, trials: int, seed: int, m: int):
  """Rejections per row over `trials` simulated suites: rows × seeds of the additive model
  with the measured σ, seed effects of 0.05 (they cancel in the pairing), row i shifted by
  effects[i] from the baseline; each row tested at α 0.05 / m."""
  rng = np.random.default_rng(seed)
  names = [f'r{i}' for i in range(len(effects))]
  pairs = [(n, 'base') for n in names]
  rejected = np.zeros((trials, len(effects)), bool)
  for trial in range(trials):
    block = rng.normal(3.0, 0.05, seeds)
    rows = {'base': block + rng.normal(0, SIGMA, seeds)}
    for name, effect in zip(names, effects):
      rows[name] = block + effect + rng.normal(0, SIGMA, seeds)
    found, _ = stats.contrasts(_table(rows), pairs)
    rejected[trial] = [found[n].significant(m) for n in names]
  return rejected


def test_null_rows_reject_at_most_alpha_over_the_family():
  """8 null rows x 5 seeds (ffn's shape): the family-wise false-positive rate, with the apart
  test in the loop, stays at or under α = 0.05 (600 simulated suites; 3 standard errors of slack)."""
  rejected = _simulate([0.0] * 8, seeds=5, trials=600, seed=11, m=8)
  rate = rejected.any(axis=1).mean()
  assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 600)


def test_a_noisier_kind_of_measurement_is_pooled_apart():
  """positions_2024's shape: 4 rows at the training context (paired std ~0.02) and, evaluated
  at 4x it, 4 rows whose seeds spread 4x as far, each 4x row against the 4x reference, 3 seeds,
  every row null. Pooled together, the quiet rows' σ narrows the 4x rows' CIs and they reject far
  above α (the apart test, on 2 df, rarely catches them); pooled per family (Variant.noise) the
  family-wise rate of the 4x rows stays at α; a pair across the two families takes its own
  paired differences."""
  rng = np.random.default_rng(5)
  quiet, loud = SIGMA, 4 * SIGMA
  names = [f'r{i}' for i in range(3)]
  pairs = [(n, 'base') for n in names] + [(f'{n}-4x', 'base-4x') for n in names]
  families = {n: '4x' for n in ('base-4x', *(f'{n}-4x' for n in names))}
  together, apart, trials = [], [], 400
  for _ in range(trials):
    block = rng.normal(3.0, 0.05, 3)
    rows = {n: block + rng.normal(0, quiet, 3) for n in ('base', *names)}
    rows |= {f'{n}-4x': block + 0.5 + rng.normal(0, loud, 3) for n in ('base', *names)}
    one, _ = stats.contrasts(_table(rows), pairs)
    two, pools = stats.contrasts(_table(rows), pairs, families=families)
    together.append(any(one[f'{n}-4x'].significant(6) for n in names))
    apart.append(any(two[f'{n}-4x'].significant(6) for n in names))
  slack = 3 * math.sqrt(0.05 * 0.95 / trials)
  assert np.mean(together) > 0.05 + slack  # the single pool's false positives
  assert np.mean(apart) <= 0.05 + slack
  assert set(pools) == {'', '4x'} and pools['4x'].rows == ('base-4x', 'r0-4x', 'r1-4x', 'r2-4x')
  assert pools['4x'].df == 6 and pools[''].df == 6  # (4 rows − 1)(3 seeds − 1) each
  # Across families (the 4x reference against the training-context one): its own differences.
  across, _ = stats.contrasts(_table(rows), [('base-4x', 'base')], families=families)
  own = stats.paired_test(rows['base-4x'], rows['base'])
  assert across['base-4x'].source == 'own'
  assert across['base-4x'].ci() == pytest.approx((own.ci_low, own.ci_high))


def test_power_at_the_detectable_effect_matches_the_formula():
  """A row at the detectable effect the formula names for ffn's shape is found in about 80% of
  simulated suites (the others null): 600 trials, 3 standard errors of slack."""
  se, df = SIGMA * math.sqrt(2 / 5), 8 * 4
  effect = stats.detectable_effect(se, df, alpha=0.05 / 8)
  assert effect == pytest.approx(0.032, abs=1e-3)  # the figure for ffn, by SciPy
  rejected = _simulate([effect] + [0.0] * 7, seeds=5, trials=600, seed=12, m=8)
  assert rejected[:, 0].mean() == pytest.approx(0.8, abs=3 * math.sqrt(0.8 * 0.2 / 600))


def test_power_of_is_the_noncentral_t_and_detectable_effect_its_inverse():
  """power_of against a Monte Carlo of the t statistic itself, and detectable_effect solving it."""
  rng = np.random.default_rng(5)
  se, df, effect = 1.0, 6, 3.0
  t = (effect + rng.normal(0, se, 200_000)) / (se * np.sqrt(rng.chisquare(df, 200_000) / df))
  simulated = np.mean(np.abs(t) > sps.t.ppf(0.975, df))
  assert stats.power_of(effect, se, df) == pytest.approx(simulated, abs=0.005)
  found = stats.detectable_effect(0.01, 12, alpha=0.001, power=0.9)
  assert stats.power_of(found, 0.01, 12, alpha=0.001) == pytest.approx(0.9, abs=1e-6)
  assert stats.detectable_effect(0.0, 12) == 0.0


@pytest.mark.parametrize('pooled', [True, False])
def test_seeds_needed_is_the_fewest_that_reach_the_power(pooled):
  n = stats.seeds_needed(0.03, sigma=0.018, rows=9, m=8, pooled=pooled)

  def power(k):
    se = 0.018 * math.sqrt(2 / k) if pooled else 0.018 / math.sqrt(k)
    return stats.power_of(0.03, se, 8 * (k - 1) if pooled else k - 1, alpha=0.05 / 8)

  assert power(n) >= 0.8 > power(n - 1)
  assert stats.seeds_needed(0.0, sigma=0.01, rows=2, m=1) is None
  assert stats.seeds_needed(1e-4, sigma=1.0, rows=2, m=1, max_n=20) is None


def _curves(slope: float, seeds: int, rng, level: float = 0.1) -> dict:
  """Gap curves at 8 evaluations (steps 250..2000): a level, `slope` per step, and noise of the
  size the 4 M-token suites' gaps show between evaluations (0.01)."""
  steps = np.arange(250, 2001, 250)
  return {s: level + slope * steps + rng.normal(0, 0.01, len(steps)) for s in range(seeds)}


def _token_budget(steps, curves: dict, table: dict) -> tuple[bool, bool]:
  """diagnosis.token_budget's rule (diagnosis.budget_rule) on simulated gaps, (the late slope
  alone, the whole rule); `table`: the shorter run's end gap per seed, paired by seed."""
  from experiments import diagnosis

  slope = stats.late_slope(steps, curves)
  shrink = stats.paired_test([table[s] for s in curves], [g[-1] for g in curves.values()])
  end = stats.paired_test([g[-1] for g in curves.values()], [0.0] * len(curves))
  closing, closed = diagnosis.budget_rule(slope, end, shrink)
  return closing, closing or closed


@pytest.mark.parametrize('level,slope', [(0.0, 0.0), (0.1, 2e-5)])
def test_the_token_budget_rule_passes_flat_and_growing_gaps_at_most_at_alpha(level, slope):
  """The token-budget test on gaps that do not close: a flat one passes in at most α of 1,000
  simulated 3-seed suites, the late slope alone at most α/2, a growing one less (the table's own
  gap: the level, with the same noise). Flat at zero is the hard case: the late slope does not
  depend on the level, and a gap flat above zero fails the closed path's end-gap CI."""
  rng = np.random.default_rng(7)
  steps = np.arange(250, 2001, 250)
  closing, passes = np.mean(
    [
      _token_budget(
        steps, _curves(slope, 3, rng, level), dict(enumerate(level + rng.normal(0, 0.01, 3)))
      )
      for _ in range(1000)
    ],
    axis=0,
  )
  band = 3 * math.sqrt(0.025 * 0.975 / 1000)
  assert closing <= 0.025 + band and passes <= 0.05 + 2 * band


def test_the_token_budget_rule_finds_a_gap_that_closed():
  """stability's QK-norm: +0.05 behind at the end of its 1 M-token table, level at the end of 4 M
  (and the curve flat over its last half). The late slope cannot see it; the shrink from the
  table's gap does in 4 of 5 simulated 3-seed suites (t on 2 df needs a shrink of 0.035 at this
  noise); a gap that shrinks as much but stays 0.05 behind is not passed."""
  rng = np.random.default_rng(9)
  steps = np.arange(250, 2001, 250)

  def draw(end):
    curves = {s: end + rng.normal(0, 0.01, len(steps)) for s in range(3)}
    return curves, dict(enumerate(end + 0.05 + rng.normal(0, 0.01, 3)))

  closing, passes = np.mean([_token_budget(steps, *draw(0.0)) for _ in range(300)], axis=0)
  assert closing < 0.1 and passes > 0.7
  behind = np.mean([_token_budget(steps, *draw(0.05))[1] for _ in range(300)])
  assert behind <= 0.05


def test_the_late_slope_finds_a_gap_that_is_still_closing():
  """ffn_tokens' GLU closes by 0.04 per M tokens late in training (2,048 tokens a step): with 3
  seeds and that noise the test passes in nearly every simulated suite; fewer than 3 late
  evaluations is an error."""
  rng = np.random.default_rng(8)
  steps = np.arange(250, 2001, 250)
  slope = -0.04 * 2048 / 1e6
  passed = np.mean(
    [stats.late_slope(steps, _curves(slope, 3, rng)).ci_high < 0 for _ in range(300)]
  )
  assert passed > 0.9
  with pytest.raises(ValueError, match='2 evaluations in the last half'):
    stats.late_slope([1, 2, 4], {0: [1.0, 1.0, 1.0], 1: [1.0, 1.0, 1.1]})


def test_degenerate_and_bad_inputs():
  same = stats.paired_test([1.0, 2.0], [1.0, 2.0])
  assert same.mean == 0.0 and same.p == 1.0
  shifted = stats.paired_test([2.0, 3.0], [1.0, 2.0])  # every difference exactly 1
  assert shifted.p == 0.0 and shifted.ci_low == shifted.ci_high == 1.0
  with pytest.raises(ValueError, match='at least 2 seeds'):
    stats.paired_test([1.0], [2.0])
  with pytest.raises(ValueError, match='3 variant values but 2'):
    stats.paired_test([1.0, 2.0, 3.0], [1.0, 2.0])
  assert stats.mean_std([3.0]) == (3.0, 0.0)
  assert stats.mean_std([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1.0))
  found, pools = stats.contrasts({'a': {0: 1.0}, 'b': {0: 2.0}}, [('b', 'a')])
  assert found == {} and pools[''].df == 0
  found, pools = stats.contrasts({}, [])  # a suite whose every run failed
  assert found == {} and pools[''].df == 0 and pools[''].rows == ()
