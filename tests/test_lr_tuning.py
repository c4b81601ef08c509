"""Per-variant learning-rate tuning in the suite runner: the grid, widening past an edge, tuning
seeds kept apart from the table's, divergence as data, the report's lr column and plot."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from pathlib import Path

import pytest
from test_experiments import data_overrides

from experiments import provenance, report, verdicts
from experiments.runner import SuiteRun, resolve, run_suite
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS
from experiments.tuning import BUDGET_GRID, TUNING_SEED_BASE, LrGrid, choose, tuning_seeds


def test_the_default_grid_has_five_log_spaced_rates_spanning_over_10x():
  grid = LrGrid()
  rates = [grid.lr(3e-3, k) for k in grid.steps()]
  assert len(rates) >= 5 and rates[-1] / rates[0] >= 10
  ratios = [b / a for a, b in itertools.pairwise(rates)]
  assert ratios == pytest.approx([ratios[0]] * len(ratios)) and 3e-3 in rates


def test_choose_picks_the_lowest_mean_and_widens_past_an_edge():
  grid = LrGrid(points=3, ratio=2.0, max_widen=2)  # steps -1, 0, 1
  assert grid.steps() == [-1, 0, 1]
  inner = choose({-1: [3.0], 0: [2.0], 1: [2.5]}, grid)
  assert (inner.best, inner.edge, inner.widen) == (0, None, None)
  high = choose({-1: [3.0], 0: [2.5], 1: [2.0]}, grid)
  assert (high.best, high.edge, high.widen) == (1, 'high', 2)
  low = choose({-1: [2.0, 2.2], 0: [2.5, 2.5], 1: [3.0, 3.0]}, grid)  # mean over seeds
  assert (low.best, low.edge, low.widen) == (-1, 'low', -2)
  # Widened twice already on the high side: the edge is reported, nothing more is tried.
  capped = choose({-1: [3.0], 0: [2.9], 1: [2.8], 2: [2.7], 3: [2.6]}, grid)
  assert (capped.best, capped.edge, capped.widen) == (3, 'high', None)
  # A diverged seed (NaN) makes its point infinitely bad, whatever the other seed gave.
  diverged = choose({-1: [3.0], 0: [2.9], 1: [1.0, math.nan]}, grid)
  assert (diverged.best, diverged.edge) == (0, None)
  # Everything diverged: the lowest rate is the best guess and the grid grows downwards.
  nothing = choose({k: [math.nan] for k in (-1, 0, 1)}, grid)
  assert (nothing.best, nothing.edge, nothing.widen) == (-1, 'low', -2)
  tie = choose({-1: [2.0], 0: [2.0], 1: [3.0]}, grid)  # a tie goes to the lower rate
  assert tie.best == -1


def _fake_run(best_lr: dict, diverge_above: float, calls: list):
  """A stand-in for run_one (result.json included, so finished runs are skipped): eval loss a
  parabola in log10(lr) around each variant's optimum, NaN (diverged at step 3) above
  `diverge_above`."""

  def run(config, workdir, progress, measure, parent=None):
    lr, variant = config.train.learning_rate, os.path.basename(workdir).split('-')[0]
    calls.append((variant, config.seed, lr))
    result = {
      'params': 1,
      'active_params': 1,
      'tokens_per_s': 1.0,
      'learning_rate': lr,
      'tokens': 10,
      'provenance': provenance.current(),  # as run_one records it
    }
    if lr > diverge_above:
      result.update(eval_loss=math.nan, diverged_at_step=3, tokens_per_s=None)
    else:
      result['eval_loss'] = (
        2.0 + (math.log10(lr) - math.log10(best_lr[variant])) ** 2 + 0.01 * config.seed
      )
    with open(os.path.join(workdir, 'result.json'), 'w') as f:
      json.dump(result, f)
    return result

  return run


SUITE = Suite(
  'tune',
  'x',
  'configs/base.py',
  (
    Variant('base'),
    Variant('relu', 'ffn=relu'),
    Variant('child', overrides={'train.steps': 3}, starts_from='base'),
  ),
  PRESETS,
  lr_grid=LrGrid(points=5, ratio=2.0, max_widen=2),
)


def test_each_variant_is_tuned_on_its_own_seeds_then_runs_the_table_at_its_best(tmp_path):
  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  grid = SUITE.lr_grid
  # base's optimum is inside the grid, relu's two steps past its top edge, above which runs
  # diverge after one more step: relu's grid widens upwards until a run diverges.
  optimum = {'base': grid.lr(center, 1), 'relu': grid.lr(center, 4), 'child': 1.0}
  calls = []
  out = run_suite(
    SUITE,
    SuiteRun(preset='tiny', seeds=2, out=str(tmp_path), progress=False, tune_lr=True, tune_seeds=2),
    run=_fake_run(optimum, grid.lr(center, 3) * 1.01, calls),
  )
  tuning = out['tuning']
  assert set(tuning) == {'base', 'relu'}  # a starts_from variant inherits, it is not tuned
  assert tuning['base']['best_lr'] == pytest.approx(grid.lr(center, 1))
  assert tuning['base']['edge'] is None and len(tuning['base']['points']) == 5
  relu = tuning['relu']
  assert [p['lr'] for p in relu['points']] == pytest.approx(
    [grid.lr(center, k) for k in range(-2, 5)]
  )
  assert relu['best_lr'] == pytest.approx(grid.lr(center, 3)) and relu['edge'] is None
  assert relu['points'][-1]['diverged_at_step'] == [3, 3]  # a data point, not a failure
  assert not out['failed']
  tuning_calls = [c for c in calls if c[1] >= TUNING_SEED_BASE]
  table_calls = [c for c in calls if c[1] < TUNING_SEED_BASE]
  assert {c[1] for c in tuning_calls} == set(tuning_seeds(2)) == {1000, 1001}
  assert sorted({c[1] for c in table_calls}) == [0, 1]
  assert len(tuning_calls) == 2 * (5 + 7)
  # The table: each variant at its own best rate, the child at its parent's.
  lrs = {(v, s): lr for v, s, lr in table_calls}
  for seed in (0, 1):
    assert lrs['base', seed] == pytest.approx(tuning['base']['best_lr'])
    assert lrs['relu', seed] == pytest.approx(tuning['relu']['best_lr'])
    assert lrs['child', seed] == pytest.approx(tuning['base']['best_lr'])
  rows = {r['variant']: r for r in verdicts.summarize(SUITE, out)}
  assert rows['relu']['lr'] == pytest.approx(relu['best_lr'])
  text = report.markdown(SUITE, out, list(rows.values()))
  assert '| lr |' in text and 'tokens/param' in text and 'tuned first on seeds 1000, 1001' in text
  # A report of the finished runs (--report_only) reads the widened points back: it must not
  # call relu's best an edge because it stopped at the first grid.
  reread = run_suite(
    SUITE,
    SuiteRun(preset='tiny', seeds=2, out=str(tmp_path), progress=False, tune_lr=True, tune_seeds=2),
    run=None,
  )
  assert json.dumps(reread['tuning']) == json.dumps(tuning)  # NaN != NaN in ==


_BARS = []  # every _Bar made, in order


class _Bar:
  """Records what a progress bar of experiments/scheduler.py was told: its totals as they change
  and the runs it counted."""

  def __init__(self, *, total, initial, desc, **_):
    self.desc, self.total, self.n, self.totals = desc, total, initial, [total]
    _BARS.append(self)

  def update(self, k=1):
    self.n += k
    self.totals.append(self.total)

  def write(self, _):
    pass

  def close(self):
    pass


def test_the_tuning_bar_counts_the_table_from_the_start_and_grows_only_by_widening(
  tmp_path, monkeypatch
):
  """2 tuning seeds x 5 rates x 2 tuned variants, and the table's 3 variants x 2 seeds, from the
  first step: 26; relu's grid widens by 2 rates (4 runs): 30 at the end, every run counted."""
  from experiments import scheduler

  monkeypatch.setattr(scheduler, 'tqdm', _Bar)
  _BARS.clear()
  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  grid = SUITE.lr_grid
  optimum = {'base': grid.lr(center, 1), 'relu': grid.lr(center, 4), 'child': 1.0}
  run_suite(
    SUITE,
    SuiteRun(preset='tiny', seeds=2, out=str(tmp_path), progress=True, tune_lr=True, tune_seeds=2),
    run=_fake_run(optimum, grid.lr(center, 3) * 1.01, []),
  )
  tuning = [bar for bar in _BARS if 'lr tuning' in bar.desc]
  assert tuning and tuning[0].totals[0] == 2 * 5 * 2 + 3 * 2
  assert tuning[-1].totals[-1] == tuning[-1].n == 2 * (5 + 7) + 3 * 2
  assert all(t in (26, 28, 30) for bar in tuning for t in bar.totals), [b.totals for b in tuning]


def test_a_best_rate_still_at_the_edge_after_widening_is_flagged(tmp_path):
  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  low = Suite(
    'low',
    'x',
    'configs/base.py',
    (Variant('base'),),
    PRESETS,
    lr_grid=LrGrid(points=5, ratio=2.0, max_widen=1),
  )
  calls = []
  out = run_suite(
    low,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False, tune_lr=True),
    run=_fake_run({'base': center / 1000}, 1.0, calls),
  )
  base = out['tuning']['base']
  assert len(base['points']) == 6 and base['edge'] == 'low'
  assert base['best_lr'] == pytest.approx(center / 8)
  rows = verdicts.summarize(low, out)
  assert '(lowest tried)' in report.markdown(low, out, rows)


def test_seeds_that_would_reach_the_tuning_seeds_are_refused(tmp_path):
  with pytest.raises(ValueError, match='--seeds=1001; allowed with --tune_lr: at most 1000'):
    run_suite(SUITE, SuiteRun(preset='tiny', seeds=1001, out=str(tmp_path), tune_lr=True), run=None)


def test_tuning_for_real_on_the_tiny_preset_writes_the_lr_plot(tmp_path, corpus):
  """Real runs (tiny preset): tuning runs get their own directories, the table's run uses the
  chosen rate, the report has the lr column and the sensitivity plot; a second call runs
  nothing."""
  extra = data_overrides(corpus, str(tmp_path / 'cache'))
  one = Suite(
    'real',
    'x',
    'configs/base.py',
    (Variant('base'),),
    PRESETS,
    lr_grid=LrGrid(points=2, ratio=10.0, max_widen=0),
  )
  out_dir = str(tmp_path / 'out')
  out = run_suite(
    one, SuiteRun(preset='tiny', seeds=1, out=out_dir, extra=extra, progress=False, tune_lr=True)
  )
  assert not out['failed'] and len(out['runs']) == 1
  best = out['tuning']['base']['best_lr']
  losses = {p['lr']: p['eval_loss'][0] for p in out['tuning']['base']['points']}
  assert best == min(losses, key=losses.get)
  saved = json.loads(Path(os.path.join(out['runs'][0]['workdir'], 'run_config.json')).read_text())
  assert saved['train']['learning_rate'] == best and saved['seed'] == 0
  runs = sorted(os.listdir(os.path.join(out_dir, 'real', 'runs')))
  assert len(runs) == 3 and sum('-s1000-' in r for r in runs) == 2
  path = report.write(one, out, out_dir)
  assert os.path.getsize(os.path.join(out_dir, 'real', 'lr_sensitivity.png')) > 1000
  assert '![lr_sensitivity.png](lr_sensitivity.png)' in Path(path).read_text()
  again = run_suite(
    one,
    SuiteRun(preset='tiny', seeds=1, out=out_dir, extra=extra, progress=False, tune_lr=True),
    run=lambda *a, **k: pytest.fail('ran again'),
  )
  assert again['tuning'] == out['tuning']


def test_concurrent_workers_get_their_own_share_of_the_cores(monkeypatch):
  """jobs=2 on 2 cores pins one worker to each (unpinned, both size XLA's pool to both cores and
  run slower together than one alone); no pinning where the cores do not go round."""
  from experiments import engines

  monkeypatch.setattr(engines.os, 'sched_getaffinity', lambda pid: {0, 1}, raising=False)
  assert engines.cpu_slots(2) == [frozenset({0}), frozenset({1})]
  assert engines.cpu_slots(3) == [None] * 3 and engines.cpu_slots(1) == [None]
  monkeypatch.setattr(engines.os, 'sched_getaffinity', lambda pid: set(range(16)), raising=False)
  assert [len(s) for s in engines.cpu_slots(2)] == [8, 8]
  assert set().union(*engines.cpu_slots(2)) == set(range(16))


def test_a_fresh_clone_resumes_from_the_ledger_without_run_directories(tmp_path):
  """finished.jsonl (committed beside results.json) restores every finished run, tuning runs
  included, when the run directories are gone; a parent whose child still has to run is trained
  again, since the child needs its parameters."""
  import shutil

  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  optimum = {'base': center, 'relu': center, 'child': 1.0}
  calls = []
  first = run_suite(
    SUITE,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False, tune_lr=True),
    run=_fake_run(optimum, 1.0, calls),
  )
  runs = os.path.join(str(tmp_path), 'tune', 'runs')
  shutil.rmtree(runs)
  again = run_suite(
    SUITE,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False, tune_lr=True),
    run=lambda *a, **k: pytest.fail('ran again'),
  )
  assert again['tuning'] == first['tuning']
  assert [r['eval_loss'] for r in again['runs']] == [r['eval_loss'] for r in first['runs']]
  # The child's result is lost: its parent (restored without checkpoints) trains again first.
  shutil.rmtree(runs)
  with open(os.path.join(str(tmp_path), 'tune', 'finished.jsonl')) as f:
    kept = [line for line in f if '"child-' not in line]
  with open(os.path.join(str(tmp_path), 'tune', 'finished.jsonl'), 'w') as f:
    f.writelines(kept)
  calls.clear()
  run_suite(
    SUITE,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False, tune_lr=True),
    run=_fake_run(optimum, 1.0, calls),
  )
  assert [(v, s) for v, s, _ in calls] == [('base', 0), ('child', 0)]


def test_another_suites_ledger_does_not_stand_in_for_a_run_this_suite_measures(tmp_path):
  """A run that another suite's ledger records (same config and seed) lacks this suite's
  measure (e.g. `positions`' loss at 2L..16L on a run the `noise` suite trained): without its
  checkpoint it trains again here, and is measured; this suite's own ledger restores it after."""
  plain = Suite('plain', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  measured = Suite(
    'measured', 'x', 'configs/base.py', (Variant('base'),), PRESETS, extra_metrics='extrapolation'
  )
  center = resolve(plain, plain.variants[0], 'tiny', 0).train.learning_rate
  calls = []
  run_suite(
    plain,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False),
    run=_fake_run({'base': center}, 1.0, calls),
  )
  assert os.path.exists(os.path.join(str(tmp_path), 'plain', 'finished.jsonl'))
  copied = run_suite(
    Suite('copy', 'x', 'configs/base.py', (Variant('base'),), PRESETS),
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False),
    run=lambda *a, **k: pytest.fail('ran again'),
  )
  assert copied['runs'][0]['copied_from'].startswith(os.path.join(str(tmp_path), 'plain'))
  calls.clear()
  run_suite(
    measured,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False),
    run=_fake_run({'base': center}, 1.0, calls),
  )
  assert [(v, s) for v, s, _ in calls] == [('base', 0)]
  import shutil

  shutil.rmtree(os.path.join(str(tmp_path), 'measured', 'runs'))
  again = run_suite(
    measured,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False),
    run=lambda *a, **k: pytest.fail('ran again'),
  )
  assert 'copied_from' not in again['runs'][0]


def test_a_clone_restores_a_copied_run_from_the_suite_it_was_copied_from(tmp_path):
  """Two suites' ledgers record the same run (config and seed) with different results; a third
  suite copied one of them (its own ledger does not record a copy). In a clone (no run folders)
  its table reads the same record again, the one its results.json names, not whichever ledger
  sorts last (the `noise` table's seeds 0-2 changed that way)."""
  import shutil

  def suite(name):
    return Suite(name, 'x', 'configs/base.py', (Variant('base'),), PRESETS)

  center = resolve(suite('a'), Variant('base'), 'tiny', 0).train.learning_rate
  spec = SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False)
  run_suite(suite('a_donor'), spec, run=_fake_run({'base': center}, 1.0, []))
  never = lambda *a, **k: pytest.fail('ran again')  # noqa: E731
  first = run_suite(suite('copy'), spec, run=never)['runs'][0]
  assert os.path.basename(os.path.dirname(os.path.dirname(first['copied_from']))) == 'a_donor'
  with open(tmp_path / 'copy' / 'results.json', 'w') as f:  # its committed table (report.write's)
    json.dump({'runs': [first]}, f)
  # Later, the same run trained by another suite in another checkout (another result) merged in.
  elsewhere = dataclasses.replace(spec, out=str(tmp_path / 'elsewhere'))
  run_suite(suite('z_donor'), elsewhere, run=_fake_run({'base': center * 10}, 1.0, []))
  shutil.move(str(tmp_path / 'elsewhere' / 'z_donor'), str(tmp_path / 'z_donor'))
  for name in ('a_donor', 'z_donor', 'copy'):
    shutil.rmtree(os.path.join(str(tmp_path), name, 'runs'))
  again = run_suite(suite('copy'), spec, run=never)['runs'][0]
  assert (again['eval_loss'], again['copied_from']) == (first['eval_loss'], first['copied_from'])


# A suite that tunes, and a longer copy of its rows that takes its rates (lr_from).
_DONOR = Suite(
  'donor',
  'x',
  'configs/base.py',
  (Variant('base'), Variant('relu', 'ffn=relu')),
  PRESETS,
  lr_grid=LrGrid(points=3, ratio=2.0, max_widen=2),
)
_BORROWER = Suite(
  'borrower',
  'x',
  'configs/base.py',
  _DONOR.variants,
  {'tiny': {**PRESETS['tiny'], 'train.steps': 12}},
  lr_from='donor',
)


def test_a_suite_can_take_its_rates_from_another_suites_tuning(tmp_path):
  """lr_from: a longer copy of some rows runs each at the rate its donor suite tuned (no grid of
  its own); before the donor has tuned, the suite refuses in one line naming what is missing."""
  donor = _DONOR
  borrower = _BORROWER
  with pytest.raises(
    ValueError,
    match=r"suite 'borrower' takes its learning rates from suite "
    r"'donor', whose tuning .* has no best rate for base, relu",
  ):
    run_suite(borrower, SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), tune_lr=True), run=None)
  center = resolve(donor, donor.variants[0], 'tiny', 0).train.learning_rate
  grid = donor.lr_grid
  calls = []
  tuned = run_suite(
    donor,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False, tune_lr=True),
    run=_fake_run({'base': grid.lr(center, -1), 'relu': grid.lr(center, 1)}, 1.0, calls),
  )
  report.write(donor, tuned, str(tmp_path))
  calls.clear()
  out = run_suite(
    borrower,
    SuiteRun(preset='tiny', seeds=2, out=str(tmp_path), progress=False, tune_lr=True),
    run=_fake_run({'base': 1.0, 'relu': 1.0}, 1.0, calls),
  )
  assert all(seed < TUNING_SEED_BASE for _, seed, _ in calls)  # nothing tuned here
  rates = {(v, s): lr for v, s, lr in calls}
  assert sorted(rates) == [('base', 0), ('base', 1), ('relu', 0), ('relu', 1)]
  for seed in (0, 1):
    assert rates['base', seed] == pytest.approx(grid.lr(center, -1))
    assert rates['relu', seed] == pytest.approx(grid.lr(center, 1))
  assert 'tuning' not in out and out['lr_from']['suite'] == 'donor'
  text = report.markdown(borrower, out, verdicts.summarize(borrower, out))
  assert "tuned rate in suite `donor`" in text
  # --no-tune_lr: every variant at its configured rate, donor or not.
  calls.clear()
  run_suite(
    borrower,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path / 'other'), progress=False, tune_lr=False),
    run=_fake_run({'base': 1.0, 'relu': 1.0}, 1.0, calls),
  )
  assert {lr for _, _, lr in calls} == {center}


def test_a_longer_suite_tunes_its_retune_lr_rows_again_around_the_borrowed_rate(tmp_path):
  """retune_lr: those rows of an lr_from suite are tuned again at its own budget on BUDGET_GRID
  (√2 apart, centred on the donor's rate, widened past an edge) on tuning seeds; the table runs
  them at the new best and the others at the donor's rate; results.md says which is which."""
  donor = _DONOR
  with pytest.raises(ValueError, match=r"retune_lr=\('relu',\); allowed: with lr_from"):
    dataclasses.replace(donor, retune_lr=('relu',))
  borrower = dataclasses.replace(_BORROWER, retune_lr=('relu',))
  center = resolve(donor, donor.variants[0], 'tiny', 0).train.learning_rate
  grid = donor.lr_grid
  tuned = run_suite(
    donor,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False, tune_lr=True),
    run=_fake_run({'base': center, 'relu': center}, 1.0, []),
  )
  report.write(donor, tuned, str(tmp_path))
  borrowed = grid.lr(center, 0)
  # At 12 steps relu's best sits two √2 steps above the donor's: the grid widens up to it, and
  # one step past it to see it is not an edge.
  longer_best = BUDGET_GRID.lr(borrowed, 2)
  calls = []
  out = run_suite(
    borrower,
    SuiteRun(preset='tiny', seeds=2, out=str(tmp_path), progress=False, tune_lr=True),
    run=_fake_run({'base': borrowed, 'relu': longer_best}, 1.0, calls),
  )
  tuning_calls = sorted((v, lr) for v, seed, lr in calls if seed >= TUNING_SEED_BASE)
  assert tuning_calls == sorted(('relu', BUDGET_GRID.lr(borrowed, k)) for k in (-1, 0, 1, 2, 3))
  assert out['tuning']['relu']['best_lr'] == pytest.approx(longer_best)
  assert out['tuning']['relu']['edge'] is None and 'base' not in out['tuning']
  table = {(v, s): lr for v, s, lr in calls if s < TUNING_SEED_BASE}
  assert table == {
    ('base', 0): borrowed,
    ('base', 1): borrowed,
    ('relu', 0): pytest.approx(longer_best),
    ('relu', 1): pytest.approx(longer_best),
  }
  text = report.markdown(borrower, out, verdicts.summarize(borrower, out))
  assert f"tuned rate in suite `donor` (base {borrowed:.3g}), not tuned again" in text
  assert f"Tuned again at this suite's budget, on seeds {TUNING_SEED_BASE}" in text
  assert f'relu {borrowed:.3g} -> {longer_best:.3g} (' in text
  # Suite.retune_grid: a grid widened at most once a side stops one step short of that best,
  # which the table then runs at and the report marks as the highest rate tried.
  narrow = dataclasses.replace(
    borrower, name='narrow', retune_grid=dataclasses.replace(BUDGET_GRID, max_widen=1)
  )
  calls = []
  out = run_suite(
    narrow,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), progress=False, tune_lr=True),
    run=_fake_run({'base': borrowed, 'relu': longer_best}, 1.0, calls),
  )
  # (Its runs are the first borrower's, copied: the same configs.)
  tried = sorted(point['lr'] for point in out['tuning']['relu']['points'])
  assert tried == pytest.approx(sorted(BUDGET_GRID.lr(borrowed, k) for k in (-1, 0, 1, 2)))
  assert out['tuning']['relu']['edge'] == 'high'
  text = report.markdown(narrow, out, verdicts.summarize(narrow, out))
  assert 'widened past an edge where the best sat (up to 1 more per side)' in text
  assert f'relu {borrowed:.3g} -> {longer_best:.3g} (highest tried)' in text


def test_runs_evaluated_during_training_draw_loss_against_tokens(tmp_path, corpus):
  """train.eval_every > 0: the run keeps its eval losses (eval_curve), the eval at the last step
  equal to the run's eval_loss, and the report draws loss_vs_tokens.png."""
  extra = {**data_overrides(corpus, str(tmp_path / 'cache')), 'train.eval_every': 2}
  one = Suite('evals', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  out = run_suite(
    one, SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), extra=extra, progress=False)
  )
  run = out['runs'][0]
  assert run['eval_curve']['step'] == [2, 4, 6]
  assert run['eval_curve']['loss'][-1] == pytest.approx(run['eval_loss'])
  path = report.write(one, out, str(tmp_path))
  assert os.path.getsize(os.path.join(str(tmp_path), 'evals', 'loss_vs_tokens.png')) > 1000
  assert '![loss_vs_tokens.png](loss_vs_tokens.png)' in Path(path).read_text()


def test_a_refinement_halves_the_grid_step_around_a_named_variants_best(tmp_path):
  """base's optimum lies between two grid points (center · √2): the coarse grid, on one seed,
  picks center (a tie goes to the lower rate); the refinement tries center / √2, center and
  center · √2 on two seeds, reusing the coarse run it shares, and the table runs at center · √2.
  relu, not named, keeps its coarse rate."""
  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  grid = SUITE.lr_grid
  optimum = {'base': center * 2**0.5, 'relu': center, 'child': 1.0}
  calls = []
  out = run_suite(
    SUITE,
    SuiteRun(
      preset='tiny',
      seeds=1,
      out=str(tmp_path),
      progress=False,
      tune_lr=True,
      refine_lr=('base',),
      refine_seeds=2,
    ),
    run=_fake_run(optimum, 1.0, calls),
  )
  base = out['tuning']['base']
  assert base['refined']['coarse_best_lr'] == pytest.approx(center)
  assert [p['lr'] for p in base['refined']['points']] == pytest.approx(
    [center / 2**0.5, center, center * 2**0.5]
  )
  assert base['best_lr'] == pytest.approx(center * 2**0.5) == grid.lr(center, 0.5)
  assert 'refined' not in out['tuning']['relu']
  assert out['tuning']['relu']['best_lr'] == pytest.approx(center)
  at_center = [c for c in calls if c[0] == 'base' and c[1] == 1000 and c[2] == center]
  assert len(at_center) == 1  # the coarse run is the refinement's too
  assert sum(c[0] == 'base' and c[1] >= TUNING_SEED_BASE for c in calls) == 5 + 5
  table = {(v, s): lr for v, s, lr in calls if s < TUNING_SEED_BASE}
  assert table['base', 0] == table['child', 0] == pytest.approx(center * 2**0.5)
  text = report.markdown(SUITE, out, verdicts.summarize(SUITE, out))
  assert 'Refined after tuning, on seeds 1000, 1001' in text
  assert f'base {center:.3g} -> {center * 2**0.5:.3g}' in text
  with pytest.raises(ValueError, match=r'--refine_lr=child .*allowed: variants this suite tunes'):
    run_suite(
      SUITE,
      SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), tune_lr=True, refine_lr=('child',)),
      run=None,
    )


def test_a_suites_own_refine_lr_is_refined_without_the_flag(tmp_path):
  """Suite.refine_lr: the refinement happens (and a report regenerated later shows it) without
  --refine_lr; a --variants subset keeps the names it holds."""
  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  optimum = {'base': center * 2**0.5, 'relu': center, 'child': 1.0}
  declared = dataclasses.replace(SUITE, refine_lr=('base',))
  common = dict(preset='tiny', seeds=1, out=str(tmp_path), progress=False, tune_lr=True)
  out = run_suite(declared, SuiteRun(**common), run=_fake_run(optimum, 1.0, []))
  assert out['tuning']['base']['best_lr'] == pytest.approx(center * 2**0.5)
  again = run_suite(declared, SuiteRun(**common), run=None)  # a report of what finished
  assert again['tuning']['base']['best_lr'] == pytest.approx(center * 2**0.5)
  only_relu = dataclasses.replace(declared, variants=(SUITE.variants[1],))
  assert 'refined' not in run_suite(only_relu, SuiteRun(**common), run=None)['tuning']['relu']


class _TwoSlots:
  """An engine of two slots in this process: a run is trained when it is submitted and reported
  ended at the next wait, oldest first, so two runs are always 'running' at once as with
  --jobs=2. `started` lists (variant, seed, workdir) in the order the runner submitted them."""

  slots = 2

  def __init__(self, run, fails=lambda variant, seed: False):
    self._run, self._ended, self.started, self._fails = run, [], [], fails

  def submit(self, payload: dict, workdir: str) -> str:
    config = payload['config']
    variant = os.path.basename(workdir).split('-')[0]
    self.started.append((variant, config.seed, workdir))
    ok = not self._fails(variant, config.seed)
    if ok:
      self._run(config, workdir, progress=False, measure=None, parent=payload.get('parent'))
    self._ended.append((workdir, ok))
    return workdir

  def wait(self, timeout_s: float) -> list[tuple[str, bool]]:
    return [self._ended.pop(0)] if self._ended else []

  def stop(self) -> None:
    self._ended.clear()


def test_a_settled_variants_table_runs_fill_the_slots_while_another_still_tunes(
  tmp_path, monkeypatch
):
  """base settles on its first grid; relu widens twice. base's table runs (and its child's,
  after their parents) start while relu's widening runs are still to come, instead of a slot
  idling at the end of each tuning round; the table is the one the rounds one after the other
  gave: the same runs at the same rates."""
  import experiments.runner as runner

  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  grid = SUITE.lr_grid
  optimum = {'base': grid.lr(center, 1), 'relu': grid.lr(center, 4), 'child': 1.0}
  kwargs = dict(preset='tiny', seeds=2, progress=False, tune_lr=True, tune_seeds=1)
  serial = run_suite(
    SUITE, SuiteRun(out=str(tmp_path / 'serial'), **kwargs), run=_fake_run(optimum, 1.0, [])
  )
  engine = _TwoSlots(_fake_run(optimum, 1.0, []))
  monkeypatch.setattr(runner, '_engine', lambda *a: engine)
  both = run_suite(
    SUITE, SuiteRun(out=str(tmp_path / 'two'), **kwargs), run=_fake_run(optimum, 1.0, [])
  )
  order = [(v, seed) for v, seed, _ in engine.started]
  relu_tuning = [i for i, (v, seed) in enumerate(order) if v == 'relu' and seed >= 1000]
  assert len(relu_tuning) == 5 + 2  # the grid, then two widenings
  assert order.index(('base', 0)) < relu_tuning[-1]
  assert order.index(('child', 0)) < relu_tuning[-1]
  workdirs = [w for _, _, w in engine.started]
  assert len(workdirs) == len(set(workdirs)) == 5 + 7 + 3 * 2  # each run once
  for a, b in zip(serial['runs'], both['runs']):
    assert (a['variant'], a['seed'], a['learning_rate'], a['eval_loss']) == (
      b['variant'],
      b['seed'],
      b['learning_rate'],
      b['eval_loss'],
    )
  assert json.dumps(serial['tuning']) == json.dumps(both['tuning'])


def test_a_table_run_that_failed_while_another_variant_tuned_is_not_tried_again(
  tmp_path, monkeypatch
):
  """base's seed-0 table run starts (pipelined) while relu still tunes and fails both its
  attempts there; the table's own pass reports it failed instead of trying it twice more."""
  import experiments.runner as runner

  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  grid = SUITE.lr_grid
  optimum = {'base': grid.lr(center, 1), 'relu': grid.lr(center, 4), 'child': 1.0}
  engine = _TwoSlots(_fake_run(optimum, 1.0, []), fails=lambda v, seed: (v, seed) == ('base', 0))
  monkeypatch.setattr(runner, '_engine', lambda *a: engine)
  out = run_suite(
    SUITE,
    SuiteRun(out=str(tmp_path), preset='tiny', seeds=2, progress=False, tune_lr=True, tune_seeds=1),
    run=_fake_run(optimum, 1.0, []),
  )
  order = [(v, seed) for v, seed, _ in engine.started]
  relu_tuning = [i for i, (v, seed) in enumerate(order) if v == 'relu' and seed >= 1000]
  assert order.index(('base', 0)) < relu_tuning[-1]  # it failed during the tuning
  assert order.count(('base', 0)) == 2  # the run and its one retry
  assert [(r['variant'], r['seed']) for r in out['failed']] == [('base', 0), ('child', 0)]
  assert ('base', 1) in [(r['variant'], r['seed']) for r in out['runs']]
