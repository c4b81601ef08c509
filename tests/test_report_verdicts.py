"""The report's judgement of each row against its paper (same direction / within noise /
contradicts with the suite's diagnosis) and its power line, on hand-made results: no training."""

from __future__ import annotations

import pytest

from experiments import report, stats
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

# Paper: base 2.000; 'better' 1.900 (5% lower); 'level' 2.005 (0.25%: the paper's "no
# difference"); 'worse_here' 1.900 too; 'noisy' 1.980 (1% lower); 'expected' has no number.
SUITE = Suite(
  name='verdicts',
  description='report test',
  base='configs/base.py',
  presets=PRESETS,
  variants=(
    Variant('base', paper={'eval_loss': 2.0}),
    Variant('better', paper={'eval_loss': 1.9}),
    Variant('level', paper={'eval_loss': 2.005}),
    Variant('worse_here', paper={'eval_loss': 1.9}),
    Variant('noisy', paper={'eval_loss': 1.98}),
    Variant('expected', expect='worse'),
  ),
  diagnoses={'worse_here': 'the learning rate (suite x, variant y)'},
)

LOSSES = {  # three paired seeds each
  'base': [3.00, 3.10, 2.90],
  'better': [2.80, 2.91, 2.69],  # 0.2 lower, tight: better
  'level': [3.01, 3.08, 2.92],  # within noise
  'worse_here': [3.30, 3.41, 3.19],  # 0.3 higher, tight: worse
  'noisy': [2.95, 3.15, 2.85],  # within noise, the paper says 1% better
  'expected': [3.20, 3.31, 3.10],
}  # worse, as expected


def results():
  runs = [
    {
      'variant': name,
      'seed': seed,
      'eval_loss': loss,
      'params': 100,
      'active_params': 100,
      'tokens': 1000,
      'tokens_per_s': 1.0,
      'learning_rate': 1e-3,
      'train_flops': 1.0,
    }
    for name, losses in LOSSES.items()
    for seed, loss in enumerate(losses)
  ]
  return {
    'suite': 'verdicts',
    'preset': 'tiny',
    'seeds': 3,
    'runs': runs,
    'failed': [],
    'pending': [],
  }


def test_each_row_is_judged_against_its_paper():
  rows = {r['variant']: r for r in report.summarize(SUITE, results())}
  assert rows['better']['agreement'] == 'same direction'
  assert rows['level']['agreement'] == 'agrees (within noise)'  # the paper: no difference
  assert rows['worse_here']['agreement'] == ('contradicts: the learning rate (suite x, variant y)')
  assert rows['noisy']['agreement'] == 'within noise'
  assert rows['expected']['agreement'] == 'same direction'  # from `expect`, no paper number
  assert rows['base']['agreement'] == ''
  undiagnosed = Suite(**{**SUITE.__dict__, 'diagnoses': {}})
  assert report.summarize(undiagnosed, results())[3]['agreement'] == (
    'contradicts (no diagnosis yet)'
  )


def test_the_power_line_names_the_seeds_a_row_within_noise_would_need():
  rows = report.summarize(SUITE, results())
  by_name = {r['variant']: r for r in rows}
  base_mean = sum(LOSSES['base']) / 3
  # The paper's 1% gap applied to our baseline's mean loss.
  assert report.paper_effect(SUITE, by_name['noisy'], rows) == pytest.approx(-0.01 * base_mean)
  text = report.markdown(SUITE, results(), rows)
  line = next(ln for ln in text.splitlines() if ln.startswith('Power:'))
  diffs = [v - b for v, b in zip(LOSSES['noisy'], LOSSES['base'])]
  n = stats.seeds_for_power(stats.mean_std(diffs)[1], -0.01 * base_mean)
  assert f'noisy {n} (effect {-0.01 * base_mean:+.3f}' in line
  # Rows outside noise and rows whose paper reports no gap ('level') need no more seeds.
  assert 'level' not in line and 'better' not in line and 'expected' not in line


def test_the_overview_counts_every_judged_row_once():
  """experiments.overview: 'better' and 'expected' agree in direction and 'level' agrees with
  the paper's no-difference; 'noisy' is within noise; 'worse_here' contradicts with a diagnosis.
  The baseline is not judged. Runs of variants a suite no longer has are left out."""
  from experiments import overview

  stale = results()
  stale['runs'].append({**stale['runs'][0], 'variant': 'removed'})
  tally = overview.tally(SUITE, stale)
  assert tally['counts'] == {
    'agrees': 3,
    'within noise': 1,
    'contradicts, diagnosed': 1,
    'contradicts, unexplained': 0,
    'contradicts, undiagnosed': 0,
  }
  assert tally['protocol'] == "baseline's lr (old)" and tally['rows'] == 6
  tuned = {**results(), 'lr_from': {'suite': 'x', 'rates': {}}}
  undiagnosed = overview.tally(Suite(**{**SUITE.__dict__, 'diagnoses': {}}), tuned)
  assert undiagnosed['protocol'] == 'tuned lr'
  assert undiagnosed['counts']['contradicts, undiagnosed'] == 1
  unexplained = overview.tally(
    Suite(**{**SUITE.__dict__, 'diagnoses': {'worse_here': 'unexplained. Ruled out: the rate'}}),
    tuned,
  )
  assert unexplained['counts']['contradicts, unexplained'] == 1
  assert unexplained['counts']['contradicts, diagnosed'] == 0
  text = overview.markdown([tally, undiagnosed])
  assert 'Of 10 rows where the literature states a direction' in text
  assert '6 agree, 2 are within noise, 2 contradict it (1 with a diagnosis, 0 unexplained' in text
  assert '- `verdicts` worse_here: contradicts (no diagnosis yet)' in text
