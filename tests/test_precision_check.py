"""experiments.precision: a suite against its method check (the same runs in another precision),
on hand-made results: a shift common to every run passes; a row whose Δ moves is named; a verdict
that changes fails the check; unfinished runs fail it too."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import hand_made_results

from experiments import precision
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

BASE = Suite(
  name='table',
  description='precision test',
  base='configs/base.py',
  presets=PRESETS,
  variants=(Variant('base'), Variant('ahead'), Variant('level'), Variant('behind')),
)
CHECK = dataclasses.replace(BASE, name='table_bf16', checks_method_of='table')
# Five paired seeds; the rows' per-seed differences spread by ~0.01.
SEED_EFFECT = [0.00, 0.05, -0.04, 0.02, -0.03]
GAPS = {
  'base': [0.0] * 5,
  'ahead': [-0.10, -0.11, -0.09, -0.10, -0.105],
  'level': [0.004, -0.006, 0.008, -0.002, 0.001],
  'behind': [0.08, 0.09, 0.07, 0.085, 0.075],
}


def _losses(shift=0.0, moved: dict | None = None) -> dict[str, list[float]]:
  moved = moved or {}
  return {
    name: [3.0 + s + g + shift + moved.get(name, 0.0) for s, g in zip(SEED_EFFECT, gaps)]
    for name, gaps in GAPS.items()
  }


def test_a_shift_common_to_every_run_passes():
  found = precision.compare_results(
    BASE, hand_made_results(_losses()), CHECK, hand_made_results(_losses(0.02))
  )
  assert found['runs'] == 20
  assert found['shift_mean'] == pytest.approx(0.02)
  assert found['shift_std'] == pytest.approx(0.0, abs=1e-12)
  rows = {r['variant']: r for r in found['rows']}
  assert rows['ahead']['base_verdict'] == rows['ahead']['check_verdict'] == 'better'
  assert rows['behind']['check_verdict'] == 'worse'
  assert rows['level']['check_verdict'] == 'within noise'
  assert rows['ahead']['moved'].mean == pytest.approx(0.0, abs=1e-12)
  assert found['passes'] and found['same_verdicts'] and not found['moved']
  assert '**The check passes' in precision.markdown(found)


def test_a_row_whose_gap_moves_is_named_and_a_changed_verdict_fails():
  # 'level' moves by 0.05 on every seed (a verdict change: within noise -> worse); 'ahead' by a
  # seed-dependent 0.004 at most (no verdict change, not significant).
  check = _losses(moved={'level': 0.05})
  check['ahead'] = [v + d for v, d in zip(check['ahead'], (0.004, -0.003, 0.002, -0.004, 0.001))]
  found = precision.compare_results(
    BASE, hand_made_results(_losses()), CHECK, hand_made_results(check)
  )
  rows = {r['variant']: r for r in found['rows']}
  assert rows['level']['moved'].mean == pytest.approx(0.05)
  assert rows['level']['check_verdict'] == 'worse' != rows['level']['base_verdict']
  assert found['moved'] == ['level'] and not found['same_verdicts'] and not found['passes']
  text = precision.markdown(found)
  assert 'does not pass: a verdict changed; Δ moved in level' in text


def test_unfinished_runs_fail_the_check():
  partial = _losses()
  partial = {name: values[:3] for name, values in partial.items()}
  results = hand_made_results(partial)
  results['pending'] = [{'variant': 'base', 'seed': 4}]
  found = precision.compare_results(BASE, hand_made_results(_losses()), CHECK, results)
  assert found['runs'] == 12 and not found['passes']


def test_the_overview_leaves_a_method_check_out_of_its_tallies(tmp_path):
  import json
  import os

  from experiments import overview
  from experiments.suite import load_suite

  suite = load_suite('ffn_bf16')
  assert suite.checks_method_of == 'ffn'
  names = [v.name for v in suite.variants]
  os.makedirs(tmp_path / 'ffn_bf16')
  losses = {name: [3.0 + 0.01 * i + s for s in SEED_EFFECT] for i, name in enumerate(names)}
  with open(tmp_path / 'ffn_bf16' / 'results.json', 'w') as f:
    json.dump(hand_made_results(losses), f)
  assert [s.name for s, _ in overview.finished(str(tmp_path))] == ['ffn_bf16']
  tallies, diagnoses = overview.collect(str(tmp_path))
  assert tallies == [] and diagnoses == []
