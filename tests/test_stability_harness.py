"""The stability harness's and the optimizer suite's report pieces: Wortsman et al. 2023's LR
sensitivity (experiments/stability.py) and the steps a variant needs to reach the baseline's
final loss (experiments/speedup.py), against numbers worked by hand."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from experiments import speedup, stability
from experiments.run import resolve
from experiments.suite import load_suite

NAN = math.nan


def _point(lr, losses, logits=None, log_z=None):
  return {
    'lr': lr,
    'eval_loss': losses,
    'max_attention_logit': logits or [None] * len(losses),
    'eval_log_z': log_z or [None] * len(losses),
  }


def test_lr_sensitivity_is_the_mean_capped_loss_over_the_rates_minus_the_best():
  """Losses 3.0, 2.5, (2.6 and 2.8: 2.7), diverged; L0 = 2.9: capped 2.9, 2.5, 2.7, 2.9, mean
  2.75, best 2.5: 0.25."""
  points = [
    _point(1e-3, [3.0]),
    _point(3e-3, [2.5]),
    _point(1e-2, [2.6, 2.8]),
    _point(3e-2, [NAN]),
  ]
  assert stability.lr_sensitivity(points, 2.9) == pytest.approx(0.25)
  assert stability.lr_sensitivity(points[:1], 2.9) is None  # one rate: no curve
  assert stability.lr_sensitivity([_point(1e-3, [NAN]), _point(1e-2, [NAN])], 2.9) is None
  assert stability.initial_loss(4096) == pytest.approx(8.3178, abs=1e-4)


def test_the_stability_section_and_figure_show_every_rate(tmp_path):
  suite = load_suite('stability')
  results = {
    'tuning': {
      'baseline': {'points': [_point(1e-3, [3.0], [7.5], [1.2]), _point(1e-1, [NAN])]},
      'qk_norm': {'points': [_point(1e-3, [3.1], [4.0], [0.8]), _point(1e-1, [3.3], [5.0], [0.9])]},
    }
  }
  text = '\n'.join(stability.lines(suite, results, vocab_size=32))
  L0 = math.log(32)
  assert f'| baseline | {(3.0 + L0) / 2 - 3.0:.3f} | 1 of 2 |' in text
  assert '0.001: 3.000 / 7.5 / 1.20; 0.1: diverged / — / —' in text
  assert f'| qk_norm | {0.1:.3f} | 0 of 2 |' in text
  path = stability.curves(suite, results, str(tmp_path / 'stability.png'))
  assert os.path.getsize(path) > 10_000


def test_steps_to_reach_interpolates_between_evaluations():
  curve = {'step': [50, 100, 150, 200], 'loss': [4.0, 3.0, 2.0, 1.9]}
  assert speedup.steps_to_reach(curve, 2.5) == pytest.approx(125.0)
  assert speedup.steps_to_reach(curve, 4.5) == 50.0  # the first evaluation is already below
  assert speedup.steps_to_reach(curve, 1.0) is None


def test_the_ratio_is_per_seed_against_the_baselines_final_loss():
  def run(v, s, loss, curve):
    return {
      'variant': v,
      'seed': s,
      'eval_loss': loss,
      'steps': 200,
      'eval_curve': {'step': [100, 200], 'loss': curve},
    }

  results = {
    'runs': [
      run('adamw', 0, 2.0, [2.5, 2.0]),
      run('muon', 0, 1.8, [1.9, 1.8]),  # below 2.0 at its first evaluation: 100 / 200
      run('adamw', 1, 2.0, [2.5, 2.0]),
      run('muon', 1, 2.1, [2.4, 2.1]),  # never reaches 2.0
    ]
  }
  assert speedup.ratios(results, 'adamw', 'muon') == {0: 0.5, 1: None}
  suite = load_suite('optimizers')
  text = '\n'.join(speedup.lines(suite, results))
  assert 'reached on 1 of 2 seeds; by seed: 0.50, never' in text


def test_the_speed_up_claim_is_the_mean_ratio_with_its_paired_ci_against_the_papers():
  """Muon reaching AdamW's final loss at 0.76, 0.70, 0.64 of its steps (a curve crossing the
  target at that fraction): mean 0.70, CI mean ± t_{0.975, 2} · sd / √3 as the float64 formula
  gives it, which holds the paper's 0.65 (agrees); at 0.90, 0.86, 0.94 it lies below 1 without
  0.65 (direction, not size); one seed that never gets there: not judged."""
  from scipy import stats as sps

  suite = load_suite('optimizers')

  def results(fractions):
    runs = []
    for seed, f in enumerate(fractions):
      runs.append({'variant': 'adamw', 'seed': seed, 'eval_loss': 2.0, 'steps': 100})
      curve = {'step': [0, 100], 'loss': [2.0 + f / (1 - f), 1.0]} if f else None
      runs.append({'variant': 'muon', 'seed': seed, 'eval_loss': 1.0, 'steps': 100})
      runs[-1]['eval_curve'] = curve or {'step': [100], 'loss': [2.5]}
    return {'runs': runs}

  fast = [0.76, 0.70, 0.64]
  assert speedup.ratios(results(fast), 'adamw', 'muon') == pytest.approx(dict(enumerate(fast)))
  (claim,) = speedup.claims(suite, results(fast))
  half = sps.t.ppf(0.975, 2) * np.std(fast, ddof=1) / math.sqrt(3)
  assert claim.judgement == claim.cell == 'agrees'
  low, high = claim.test.ci(1)
  assert (1 + low, 1 + high) == (pytest.approx(0.70 - half), pytest.approx(0.70 + half))
  (claim,) = speedup.claims(suite, results([0.90, 0.86, 0.94]))
  assert claim.judgement == 'agrees in direction, not size'
  (claim,) = speedup.claims(suite, results([0.7, None, 0.7]))
  assert (claim.test, claim.cell) == (None, "not judged: a seed never reached the baseline's loss")
  text = '\n'.join(speedup.claim_lines(suite, results(fast)))
  shown = (
    f'- muon: 0.70x [{0.70 - half:.2f}, {0.70 + half:.2f}] the steps: agrees (the paper: 0.65x)'
  )
  assert shown in text


def test_the_transfer_line_fits_the_best_rates_slope_against_width():
  """Rates 8e-3, 4e-3, 2e-3 at widths 64, 128, 256: a slope of exactly −1 (halves per doubling);
  3e-3 at every width: 0 (flat)."""
  from experiments import transfer

  suite = load_suite('mup_transfer')
  tuning = {
    **{f'standard-d{w}': {'best_lr': lr} for w, lr in ((64, 8e-3), (128, 4e-3), (256, 2e-3))},
    **{f'mup-d{w}': {'best_lr': 3e-3, 'edge': 'high' if w == 64 else None} for w in (64, 128)},
  }
  text = '\n'.join(transfer.lines(suite, {'tuning': tuning}))
  assert 'standard: d64: 0.008, d128: 0.004, d256: 0.002; slope -1.00 per doubling: falls' in text
  assert 'mup: d64: 0.003 (edge), d128: 0.003; slope +0.00 per doubling: flat (x1.00' in text
  assert transfer.slope([64], [1e-3]) is None


# Table runs (each row at its best rate, 3 seeds): eval loss, log Z and largest attention logit.
TABLE = {
  'baseline': ([2.80, 2.81, 2.82], [8.50, 8.55, 8.60], [30.0, 33.0, 36.0]),
  'qk_norm': ([2.85, 2.85, 2.87], [8.40, 8.50, 8.45], [10.0, 10.5, 11.0]),
  'z_loss': ([2.80, 2.82, 2.81], [8.45, 8.40, 8.50], [35.0, 33.0, 34.0]),
}


def _stability_results(tuning: dict) -> dict:
  runs = [
    {
      'variant': name,
      'seed': s,
      'eval_loss': loss[s],
      'eval_log_z': z[s],
      'max_attention_logit': a[s],
      'params': 1000,
      'active_params': 1000,
    }
    for name, (loss, z, a) in TABLE.items()
    for s in range(3)
  ]
  tuning = {name: {'edge': None, **t} for name, t in tuning.items()}
  return {'preset': 'cpu', 'seeds': 3, 'runs': runs, 'tuning': tuning}


CLAIM_TUNING = {
  'baseline': {'points': [_point(1e-3, [3.0], [7.5], [1.2]), _point(1e-1, [3.3], [9.0], [-1.5])]},
  'qk_norm': {'points': [_point(1e-3, [3.1], [4.0], [0.8]), _point(1e-1, [3.3], [5.0], [0.9])]},
  'z_loss': {'points': [_point(1e-3, [3.0], [7.0], [0.1]), _point(1e-1, [3.2], [9.0], [2.0])]},
}


def test_each_claim_is_tested_on_the_table_seeds_noise_at_the_highest_rate_both_finished():
  """qk_norm's LR sensitivity 0.1 against the baseline's 0.15, z_loss's the same; at 1e-1 (the
  highest rate both finished) qk_norm's largest attention logit 5 against 9 (a log ratio) and
  z_loss's |log Z| 2.0 against 1.5. Each difference's CI: t_{1−α/(2·4), df} · se, σ the table
  seeds' spread pooled over rows (the mean of equal-n variances), se σ·√(1/2 + 1/2) for a
  sensitivity over 2 rates each and σ·√2 for a one-rate value."""
  from scipy import stats as sps

  suite = load_suite('stability')
  lines = stability.claim_lines(suite, _stability_results(CLAIM_TUNING), vocab_size=32)
  text = '\n'.join(lines)
  crit = sps.t.ppf(1 - 0.05 / 8, 6)  # 4 claims, 3 rows x 2 df
  sigma = {k: math.sqrt(np.mean([np.var(TABLE[r][k], ddof=1) for r in TABLE])) for k in (0, 1)}
  sigma[2] = math.sqrt(np.mean([np.var(np.log(TABLE[r][2]), ddof=1) for r in TABLE]))
  for variant, measure, diff, se, judged in [
    ('qk_norm', 'LR sensitivity', -0.05, sigma[0], 'agrees'),
    ('qk_norm', 'largest attention logit', math.log(5 / 9), sigma[2] * math.sqrt(2), 'agrees'),
    ('z_loss', 'LR sensitivity', -0.05, sigma[0], 'agrees'),
    ('z_loss', '|log Z|', 0.5, sigma[1] * math.sqrt(2), 'contradicts (no diagnosis yet)'),
  ]:
    line = next(ln for ln in lines if ln.startswith(f'- {variant}: {measure}'))
    ci = f'{diff:+.3f} [{diff - crit * se:+.3f}, {diff + crit * se:+.3f}]: {judged}'
    assert ci in line, (line, ci)
  assert "(at 0.1) 5.000 against baseline's 9.000; difference on a log scale" in text
  assert 'simultaneous 95% CIs over the 4 claims' in text
  assert f'eval loss σ {sigma[0]:.4f} (6 df)' in text


def test_a_claim_within_the_noise_is_no_difference_and_a_contradiction_takes_its_diagnosis():
  """z_loss's |log Z| 1.52 against 1.5 is inside its CI: no difference, with the smallest
  difference it could see (noncentral t); at 2.0 it contradicts, and a diagnosis keyed
  'z_loss: abs_log_z' judges it (here one that explains nothing: unexplained)."""
  import dataclasses

  from experiments.diagnosis import Diagnosis, Finding

  suite = load_suite('stability')
  near = {**CLAIM_TUNING}
  near['z_loss'] = {
    'points': [_point(1e-3, [3.0], [7.0], [0.1]), _point(1e-1, [3.2], [9.0], [1.52])]
  }
  found = {(c.variant, c.measure): c for c in stability.claims(suite, _stability_results(near), 32)}
  within = found['z_loss', 'abs_log_z']
  assert within.judgement == 'no difference detected'
  sigma = math.sqrt(np.mean([np.var(TABLE[r][1], ddof=1) for r in TABLE]))
  assert within.test.se == pytest.approx(sigma * math.sqrt(2))
  assert within.cell == f'no difference detected (could see ±{within.test.detectable(4):.3f})'
  said = Diagnosis('x', lambda e, v: Finding(True, 'ruled out: the decay'), explains=False)
  diagnosed = dataclasses.replace(suite, diagnoses={**suite.diagnoses, 'z_loss: abs_log_z': said})
  claim = next(
    c
    for c in stability.claims(diagnosed, _stability_results(CLAIM_TUNING), 32)
    if c.measure == 'abs_log_z'
  )
  assert (claim.judgement, claim.cell) == (
    'contradicts, unexplained',
    'contradicts: ruled out: the decay',
  )
  with pytest.raises(ValueError, match=r"diagnoses\['z_loss: max_attention_logit'\]"):
    dataclasses.replace(suite, diagnoses={'z_loss: max_attention_logit': said})
  no_seeds = {**_stability_results(CLAIM_TUNING), 'runs': []}
  assert {c.cell for c in stability.claims(suite, no_seeds, 32)} == {
    'not judged: no table seeds to measure the noise'
  }


def test_the_sensitivity_difference_spreads_as_its_standard_error_says():
  """Simulated sweeps (7 rates, a clear optimum, Gaussian noise σ on each final loss): the
  spread of the difference of two LR sensitivities matches sensitivity_se within 3%."""
  rng = np.random.default_rng(0)
  curve = np.array([0.5, 0.2, 0.0, 0.2, 0.6, 1.0, 1.5]) + 3.0
  sigma = 0.01

  def sensitivity():
    losses = curve + sigma * rng.standard_normal(curve.size)
    return stability.lr_sensitivity([_point(lr, [x]) for lr, x in enumerate(losses)], 6.0)

  diffs = [sensitivity() - sensitivity() for _ in range(8000)]
  assert np.std(diffs) == pytest.approx(stability.sensitivity_se(sigma, 7, 7), rel=0.03)


def test_the_overview_counts_the_stability_claims_with_the_rows():
  """The stability suite's 4 claims join its rows in the tally, the project family and the
  table's 'rows' column."""
  from experiments import overview, verdicts

  suite = load_suite('stability')
  results = _stability_results(CLAIM_TUNING)
  rows = [r for r in verdicts.measured_rows(suite, results) if 'test' in r]
  assert overview.project_family([(suite, results)]).m == len(rows) + 4
  tally = overview.tally(suite, results)
  assert tally['claims'] == 4 and tally['tests'] == len(rows) + 4
  assert tally['counts']['contradicts, undiagnosed'] >= 1
  assert any(
    'z_loss, |log Z| at the highest rate' in n for n in tally['notes']['contradicts, undiagnosed']
  )
  assert f"| {len(suite.variants)} + 4 claims |" in overview.markdown([tally])


def _sweep(best_log2: float, low: int = -10, high: int = -6) -> list[dict]:
  """A factor-2 grid of rates, 2^low to 2^high, whose final loss is a parabola in log2(rate)
  with its minimum at `best_log2`."""
  return [_point(2.0**x, [3.0 + 0.1 * (x - best_log2) ** 2]) for x in range(low, high + 1)]


def test_a_rows_best_rate_is_the_vertex_of_the_parabola_through_its_best_grid_points():
  from experiments import transfer

  assert transfer.best_log2_rate(_sweep(-8.3)) == (pytest.approx(-8.3), False)
  assert transfer.best_log2_rate(_sweep(-11.0)) == (-10.0, True)  # the grid's low edge


def test_each_transfer_claim_is_the_slope_of_the_best_rates_with_its_least_squares_ci():
  """Standard rows halving their best rate per doubling (with jitter): slope and CI as the
  float64 formulas give them, below 0 and holding −1 (agrees); falling by a factor 2^0.4 per
  doubling: below 0 without −1 (direction, not size); µP rows doubling it: outside ±0.5 of 0
  (contradicts); µP rows scattered: the CI reaches past ±0.5 (cannot resolve); a best rate at an
  edge: not judged."""
  from scipy import stats as sps

  from experiments import overview, transfer

  suite = load_suite('mup_transfer')
  widths = (64, 128, 256, 512)
  jitter = (0.05, -0.08, 0.02, 0.04)

  def results(std_best, mup_best):
    tuning = {
      f'{kind}-d{w}': {'points': _sweep(best(i), -13, -5), 'edge': None, 'best_lr': 2.0 ** best(i)}
      for kind, best in (('standard', std_best), ('mup', mup_best))
      for i, w in enumerate(widths)
    }
    return {'preset': 'cpu', 'seeds': 3, 'runs': [], 'tuning': tuning}

  falls = lambda i: -7.0 - i + jitter[i]  # noqa: E731
  doubles = lambda i: -9.5 + i + jitter[i]  # noqa: E731
  found = {c.family: c for c in transfer.claims(suite, results(falls, doubles))}
  x = np.log2(widths)
  y = np.array([falls(i) for i in range(4)])
  slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
  residual = y - y.mean() - slope * (x - x.mean())
  se = math.sqrt((residual**2).sum() / 2 / ((x - x.mean()) ** 2).sum())
  half = sps.t.ppf(1 - 0.05 / 4, 2) * se  # 2 claims
  standard = found['standard']
  assert (standard.test.mean, standard.test.se) == (pytest.approx(slope), pytest.approx(se))
  assert standard.judgement == 'agrees' and slope - half <= -1 <= slope + half < 0
  shallow = lambda i: -7.0 - 0.4 * i + jitter[i] / 10  # noqa: E731
  found = {c.family: c for c in transfer.claims(suite, results(shallow, doubles))}
  assert found['standard'].judgement == 'agrees in direction, not size'
  assert found['mup'].judgement == 'contradicts, undiagnosed'
  text = '\n'.join(transfer.claim_lines(suite, results(falls, doubles)))
  assert (
    f'- standard: slope {slope:+.2f} [{slope - half:+.2f}, {slope + half:+.2f}] on 2 df;' in text
  )
  scattered = lambda i: -8.0 + (0.0, 0.9, -0.9, 0.3)[i]  # noqa: E731
  found = {c.family: c for c in transfer.claims(suite, results(falls, scattered))}
  assert found['mup'].judgement == 'cannot resolve at this power'
  edge = lambda i: -14.0 if i == 0 else -8.0  # noqa: E731
  found = {c.family: c for c in transfer.claims(suite, results(falls, edge))}
  assert (found['mup'].judgement, found['mup'].cell) == (
    '',
    'not judged: a best rate at an edge of its grid',
  )
  tally = overview.tally(suite, results(falls, doubles))
  assert tally['claims'] == 2 and tally['counts']['agrees'] == 1
  assert any(
    'mup, best rate against width' in n for n in tally['notes']['contradicts, undiagnosed']
  )


def test_the_lr_column_shows_the_peak_a_row_ran_at_where_its_config_scaled_the_rate():
  """unseen_width's default_config rows keep the standard parametrization's width rule: 3e-3
  given runs at 3e-3 · 256/96 = 8e-3; a row whose rate is given as it is shows it alone."""
  from experiments import report

  suite = load_suite('unseen_width')
  rows = [
    {'variant': 'default_config-default_lr', 'lr': 3e-3},
    {'variant': 'standard_scaled-default_lr', 'lr': 8e-3},
  ]
  report._add_peak_rates(suite, 'cpu', rows)
  assert rows[0]['peak_lr'] == pytest.approx(8e-3) and rows[1]['peak_lr'] == pytest.approx(8e-3)
  assert report._lr_cell(rows[0]) == '0.003 → 0.008'
  assert report._lr_cell(rows[1]) == '0.008'


def test_a_rate_derived_from_the_config_is_not_scaled_again_in_the_lr_column():
  """norms_2024's -4x rows set their rate to 4x the config's (`derived`); their runs record the
  0.012 they trained at, which the column shows as it is (it once showed 0.012 → 0.048, the
  derivation applied a second time)."""
  from experiments import report

  suite = load_suite('norms_2024')
  rows = [{'variant': 'pre', 'lr': 3e-3}, {'variant': 'pre-4x', 'lr': 1.2e-2}]
  report._add_peak_rates(suite, 'cpu', rows)
  assert [r['peak_lr'] for r in rows] == pytest.approx([3e-3, 1.2e-2])
  assert [report._lr_cell(r) for r in rows] == ['0.003', '0.012']
  assert resolve(suite, suite.variants[3], 'cpu', 0).train.learning_rate == pytest.approx(1.2e-2)
