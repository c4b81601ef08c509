"""The stability harness's and the optimizer suite's report pieces: Wortsman et al. 2023's LR
sensitivity (experiments/stability.py) and the steps a variant needs to reach the baseline's
final loss (experiments/speedup.py), against numbers worked by hand."""

from __future__ import annotations

import math
import os

import pytest

from experiments import speedup, stability
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


def test_each_claim_is_read_against_the_baseline_at_the_highest_rate_both_finished():
  """qk_norm's LR sensitivity 0.1 against the baseline's 0.15 (agrees); its largest attention
  logit at 1e-1 (the highest rate both finished) 5.0 against 9.0 (agrees); z_loss's LR
  sensitivity 0.1 against 0.15 (agrees) and its |log Z| there 2.0 against 1.5 (contradicts)."""
  suite = load_suite('stability')
  results = {
    'tuning': {
      'baseline': {
        'points': [_point(1e-3, [3.0], [7.5], [1.2]), _point(1e-1, [3.3], [9.0], [-1.5])]
      },
      'qk_norm': {'points': [_point(1e-3, [3.1], [4.0], [0.8]), _point(1e-1, [3.3], [5.0], [0.9])]},
      'z_loss': {'points': [_point(1e-3, [3.0], [7.0], [0.1]), _point(1e-1, [3.2], [9.0], [2.0])]},
    }
  }
  text = '\n'.join(stability.claim_lines(suite, results, vocab_size=32))
  assert "- qk_norm: LR sensitivity 0.100 against baseline's 0.150: agrees" in text
  assert (
    "largest attention logit at the highest rate both finished (at 0.1) 5.000 against "
    "baseline's 9.000: agrees" in text
  )
  assert "- z_loss: LR sensitivity 0.100 against baseline's 0.150: agrees" in text
  assert (
    "- z_loss: |log Z| at the highest rate both finished (at 0.1) 2.000 against baseline's "
    '1.500: contradicts' in text
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
