"""The suite runner on the tiny preset: hashing and skipping, paired seeds, resume after a kill,
retry, the report. (Not the scientific results: those are the suites' own runs.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import launch_server
import pytest
from conftest import ROOT, read_tensorboard_scalars

import mllm
from experiments import provenance, report, report_notes, verdicts
from experiments.run import run_dir
from experiments.runner import SuiteRun, config_hash, resolve, run_one, run_suite
from experiments.suite import BenchmarkSuite, Suite, Variant, available, load_suite
from experiments.suites._presets import PRESETS


def data_overrides(corpus, cache):
  return {
    'data.source': 'text',
    'data.path': corpus,
    'data.tokenizer': 'byte',
    'model.vocab_size': 258,
    'data.val_fraction': 0.3,
    'data.cache_dir': cache,
  }


def one_seed(tmp_path, corpus) -> SuiteRun:
  """A suite's tiny preset on one seed over the test corpus, in tmp_path, quietly."""
  return SuiteRun(
    preset='tiny',
    seeds=1,
    out=str(tmp_path),
    extra=data_overrides(corpus, str(tmp_path / 'cache')),
    progress=False,
  )


# 'same' is the baseline's config under another name: with paired seeds it must give exactly the
# baseline's numbers, which is what makes the differences paired.
SUITE = Suite(
  name='demo',
  description='runner test',
  base='configs/base.py',
  variants=(Variant('base'), Variant('same'), Variant('relu', 'ffn=relu')),
  presets=PRESETS,
)


# Its tests, and the Ray engine's, carry xdist_group('finished'): one worker builds it (a worker
# building it again cost 8-11 s) and starts the local Ray once.
@pytest.fixture(scope='module')
def finished(corpus, tmp_path_factory):
  out = str(tmp_path_factory.mktemp('suites'))
  extra = data_overrides(corpus, str(tmp_path_factory.mktemp('cache')))
  # Kill one run part-way first (train's stop_after, as a preemption): the suite resumes it.
  from mllm.train import train

  killed = resolve(SUITE, SUITE.variants[1], 'tiny', 0, extra)
  train(killed, run_dir(out, SUITE, SUITE.variants[1], killed), stop_after=3, progress=False)
  results = run_suite(SUITE, SuiteRun(preset='tiny', seeds=2, out=out, extra=extra, progress=False))
  return out, extra, results


@pytest.mark.xdist_group('finished')
def test_every_run_finishes_and_paired_seeds_agree_exactly(finished):
  _out, _, results = finished
  assert not results['failed'] and len(results['runs']) == 6
  by = {(r['variant'], r['seed']): r for r in results['runs']}
  for seed in (0, 1):  # same config, same seed: the same numbers, the resumed run included
    assert by['same', seed]['eval_loss'] == by['base', seed]['eval_loss']
    assert by['relu', seed]['eval_loss'] != by['base', seed]['eval_loss']
  assert by['base', 0]['eval_loss'] != by['base', 1]['eval_loss']  # seeds differ
  resumed = os.path.join(by['same', 0]['workdir'], 'metrics.jsonl')
  steps = [
    json.loads(line)['step'] for line in Path(resumed).read_text().splitlines() if '"train"' in line
  ]
  assert steps == sorted(set(steps)) and steps[-1] == PRESETS['tiny']['train.steps']


@pytest.mark.xdist_group('finished')
def test_a_runs_eval_loss_is_what_evaluate_gives_on_its_checkpoint(finished):
  """run_one keeps train()'s final evaluation instead of evaluating again: it must be exactly
  what `launch.py --mode=eval` (evaluate) reads from the saved checkpoint."""
  from mllm.train import evaluate

  _, extra, results = finished
  for r in results['runs']:
    if r['variant'] == 'same' and r['seed'] == 1:
      continue  # copied from base seed 1
    config = resolve(
      SUITE, next(v for v in SUITE.variants if v.name == r['variant']), 'tiny', r['seed'], extra
    )
    again = evaluate(config, r['workdir'])
    assert (again['loss'], again['perplexity'], again['bits_per_byte']) == (
      r['eval_loss'],
      r['eval_perplexity'],
      r['bits_per_byte'],
    )


@pytest.mark.xdist_group('finished')
def test_runs_in_worker_processes_give_the_same_numbers(finished, tmp_path):
  """jobs=2: two runs at once, each in its own process; the same losses as in this process."""
  _, extra, results = finished
  two = Suite('demo', 'x', 'configs/base.py', (SUITE.variants[0], SUITE.variants[2]), PRESETS)
  out = run_suite(
    two, SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), extra=extra, progress=False, jobs=2)
  )
  serial = {(r['variant'], r['seed']): r['eval_loss'] for r in results['runs']}
  assert not out['failed'] and [(r['variant'], r['eval_loss']) for r in out['runs']] == [
    ('base', serial['base', 0]),
    ('relu', serial['relu', 0]),
  ]
  assert all(os.path.exists(os.path.join(r['workdir'], 'worker.log')) for r in out['runs'])


# What a run's record may differ in between two engines: where it ran and how fast.
_TIMING = ('workdir', 'wall_s', 'tokens_per_s', 'median_step_s')


@pytest.mark.xdist_group('finished')
def test_ray_tasks_give_the_same_results_as_this_process_and_the_pool(finished, tmp_path):
  """--engine=ray on a local Ray (2 CPUs, a task each): every run's record is the one trained in
  this process (and by jobs=2, test above), timings and paths aside."""
  _, extra, results = finished
  two = Suite('demo', 'x', 'configs/base.py', (SUITE.variants[0], SUITE.variants[2]), PRESETS)
  out = run_suite(
    two,
    SuiteRun(
      preset='tiny', seeds=1, out=str(tmp_path), extra=extra, progress=False, jobs=2, engine='ray'
    ),
  )
  serial = {(r['variant'], r['seed']): r for r in results['runs']}
  assert not out['failed'] and len(out['runs']) == 2
  for run in out['runs']:
    assert 'copied_from' not in run
    same = serial[run['variant'], run['seed']]
    assert {k: v for k, v in run.items() if k not in _TIMING} == {
      k: v for k, v in same.items() if k not in _TIMING
    }
    assert ': starting\n' in Path(os.path.join(run['workdir'], 'worker.log')).read_text()


# Slow (25 s): the fast run checks the Ray engine's results (above); retries after a lost worker
# run with -m slow, as does SIGTERM through Ray (below).
@pytest.mark.slow
@pytest.mark.xdist_group('finished')
def test_a_killed_ray_worker_is_retried_and_its_run_resumes(corpus, tmp_path):
  """SIGKILL to the Ray worker process training a run (a node lost, the OOM killer): the runner
  submits the run again once, and it resumes from its last checkpoint to the end."""
  import glob
  import signal
  import threading
  import time

  from experiments.suite import Variant

  out = str(tmp_path / 'out')
  extra = {
    **data_overrides(corpus, str(tmp_path / 'cache')),
    'train.steps': 200,
    'train.checkpoint_every': 20,
  }
  one = Suite('demo', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  killed = []

  def kill_after_first_checkpoint():
    deadline = time.time() + 240
    while time.time() < deadline and not killed:
      # At step 40's save, step 20 is committed whatever stage 40's own save is at.
      for steps in glob.glob(os.path.join(out, 'demo', 'runs', '*', 'checkpoints', '40')):
        log = os.path.join(os.path.dirname(os.path.dirname(steps)), 'worker.log')
        for pid in _workers_of(log):
          os.kill(pid, signal.SIGKILL)
          killed.append(log)
      time.sleep(0.05)

  killer = threading.Thread(target=kill_after_first_checkpoint)
  killer.start()
  try:
    results = run_suite(
      one, SuiteRun(preset='tiny', seeds=1, out=out, extra=extra, progress=False, engine='ray')
    )
  finally:
    killed.append(None)  # stops the thread if the suite raised
    killer.join()
  assert killed[0] is not None, 'the run was never killed'
  assert not results['failed'] and results['runs'][0]['steps'] == 200
  log = Path(killed[0]).read_text()
  assert log.count('worker pid ') == 2, log[-2000:]  # one retry
  assert ': starting\n' in log and 'resuming from step ' in log, log[-2000:]
  resumed_at = int(log.split('resuming from step ')[1].split()[0])
  assert 20 <= resumed_at < 200


@pytest.mark.xdist_group('finished')
def test_an_identical_finished_run_is_copied_not_trained(finished):
  """'same' is 'base' under another name: its seed-1 run was copied from base's, while its
  seed-0 run, started (and killed) before, resumed instead."""
  _, _, results = finished
  by = {(r['variant'], r['seed']): r for r in results['runs']}
  assert by['same', 1]['copied_from'] == by['base', 1]['workdir']
  assert 'copied_from' not in by['same', 0] and 'copied_from' not in by['relu', 1]
  # same's killed seed-0 run belongs to this plan: base's seed 0 did not wait for it.
  assert 'copied_from' not in by['base', 0]
  assert os.path.isdir(os.path.join(by['same', 1]['workdir'], 'checkpoints'))


@pytest.mark.xdist_group('finished')
def test_a_run_of_other_code_is_trained_again_for_its_first_steps_and_compared(finished, tmp_path):
  """experiments.reproduce: relu's runs relabelled as another code version; its seed-0 run
  trained again here logs the same losses (this is the same code), and a recorded curve that
  drifts from step 3 is caught there (the same draw: step 1 agrees), one that differs from its
  first step is another draw; the report's provenance line states the check."""
  from experiments import provenance, reproduce

  _, extra, results = finished
  other = {**provenance.current(), 'code': '000000000000'}
  runs = [{**r, 'provenance': other} if r['variant'] == 'relu' else r for r in results['runs']]
  relabelled = {**results, 'runs': runs}
  (same,) = reproduce.check(SUITE, relabelled, str(tmp_path), steps=4, extra=extra)
  assert same['run'] == 'relu seed 0' and same['steps'] == [1, 2, 3, 4]
  assert same['same'] and same['max_abs_diff'] <= 1e-5
  changed = [dict(r) for r in runs]
  changed[2] = {**changed[2], 'curve': dict(changed[2]['curve'])}
  assert (changed[2]['variant'], changed[2]['seed']) == ('relu', 0)
  changed[2]['curve']['loss'] = [
    x + 0.05 * (s >= 3) for s, x in zip(changed[2]['curve']['step'], changed[2]['curve']['loss'])
  ]
  (differs,) = reproduce.check(
    SUITE, {**relabelled, 'runs': changed}, str(tmp_path), steps=4, extra=extra
  )
  assert not differs['same'] and differs['same_draw'] and differs['at_step'] == 3
  assert abs(differs['max_abs_diff'] - 0.05) < 1e-4
  other_draw = reproduce._compare(
    {'step': [1, 2], 'loss': [3.0, 2.9]}, {'step': [1, 2], 'loss': [3.2, 2.9]}
  )
  assert not other_draw['same'] and not other_draw['same_draw'] and other_draw['at_step'] == 1
  assert 'the two versions draw differently' in reproduce.sentence(
    {**differs, **other_draw, 'max_abs_diff': 0.2}
  )
  checks = reproduce.read(str(tmp_path / 'demo'))
  assert len(checks) == 2
  text = report.markdown(
    SUITE, {**relabelled, 'reproduced': checks[:1]}, verdicts.summarize(SUITE, relabelled)
  )
  assert 'Provenance (MIXED' in text and 'Checked: relu seed 0 of code 000000000000' in text
  assert 'logs the same train loss at steps 1-4' in text
  text = report.markdown(
    SUITE, {**relabelled, 'reproduced': checks}, verdicts.summarize(SUITE, relabelled)
  )
  assert 'logs the same train loss at step 1 and drifts by 0.0500 by step 3' in text  # the latest


def test_a_child_process_keeps_the_pythonpath_behind_the_checkout(monkeypatch):
  """Runs trained in a child (a worker, a commit's worktree) import the checkout first and still
  find packages installed outside site-packages: on a lent GPU (2026-11-27) grain came through
  PYTHONPATH, and a worktree's child given PYTHONPATH=<worktree> alone could not import it."""
  from experiments.engines import ROOT, pythonpath

  monkeypatch.setenv('PYTHONPATH', os.pathsep.join(['/opt/site', '', '/opt/more']))
  assert pythonpath() == os.pathsep.join([ROOT, '/opt/site', '/opt/more'])
  assert pythonpath('/w/tree') == os.pathsep.join(['/w/tree', '/opt/site', '/opt/more'])
  monkeypatch.delenv('PYTHONPATH')
  assert pythonpath('/w/tree') == '/w/tree'


def test_a_run_is_trained_again_under_a_commits_code_in_a_worktree(tmp_path, corpus):
  """experiments.reproduce --code_of: noise's run, relabelled as an older version, trained again
  under HEAD's code in a git worktree (its own experiments/ resolves the config) logs the same
  losses; the record names that commit's code, and the worktree is gone afterwards."""
  from experiments import provenance, reproduce

  def worktrees():
    listed = subprocess.run(['git', 'worktree', 'list'], capture_output=True, text=True, cwd=ROOT)
    return listed.stdout

  before = worktrees()
  noise = load_suite('noise')
  extra = data_overrides(corpus, str(tmp_path / 'cache'))
  results = run_suite(
    noise, SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), extra=extra, progress=False)
  )
  older = {'ledger_commit': '0123abcd (2026-11-25 00:00 UTC)'}
  relabelled = {**results, 'runs': [{**r, 'provenance': older} for r in results['runs']]}
  (record,) = reproduce.check(
    noise, relabelled, str(tmp_path), steps=3, extra=extra, code_of='HEAD'
  )
  assert 'error' not in record, record  # the child's failure, named (a GPU run's: a lost package)
  assert record['same'] and record['steps'] == [1, 2, 3], record
  head = subprocess.run(['git', 'rev-parse', '--short=12', 'HEAD'], capture_output=True, text=True)
  assert record['under']['commit'] == head.stdout.strip()
  assert record['from'] == older
  if not provenance.current()['dirty']:  # a clean checkout (CI's): HEAD's code is this code
    assert record['under']['code'] == provenance.current()['code']
  assert worktrees() == before
  with pytest.raises(ValueError, match=r'^--code_of=nonesuch: not a commit of this repository'):
    reproduce.check(noise, relabelled, str(tmp_path), steps=3, code_of='nonesuch')


@pytest.mark.xdist_group('finished')
def test_finished_runs_are_skipped_and_a_changed_config_is_a_new_run(finished):
  out, extra, results = finished
  calls = []
  again = run_suite(
    SUITE,
    SuiteRun(preset='tiny', seeds=2, out=out, extra=extra, progress=False),
    run=lambda *a, **k: calls.append(a),
  )
  partial = run_suite(
    SUITE, SuiteRun(preset='tiny', seeds=3, out=out, extra=extra, progress=False), run=None
  )  # --report_only: the 6 finished runs, seed 2's three pending
  assert len(partial['runs']) == 6 and [p['seed'] for p in partial['pending']] == [2, 2, 2]
  assert 'Not run yet: 3 of 9 runs' in report.markdown(
    SUITE, partial, verdicts.summarize(SUITE, partial)
  )
  assert calls == [] and [r['eval_loss'] for r in again['runs']] == [
    r['eval_loss'] for r in results['runs']
  ]
  # What each run cost stays with it (result.json), so a suite continued later still reports it;
  # a copied run cost nothing and says where it came from instead.
  assert [r.get('wall_s') for r in again['runs']] == [r.get('wall_s') for r in results['runs']]
  assert all((r.get('wall_s', 0) > 0) != ('copied_from' in r) for r in again['runs'])
  own = [r['wall_s'] for r in again['runs'] if 'copied_from' not in r]
  spent = report_notes.cost(again)
  assert (spent['trained'], spent['evaluated'], spent['untimed'], spent['copied']) == (
    len(own),
    0,
    0,
    len(again['runs']) - len(own),
  )
  assert spent['run_minutes'] == pytest.approx(sum(own) / 60)
  assert f"Cost: {len(own)} runs trained and 0 only evaluated by this suite" in report.markdown(
    SUITE, again, verdicts.summarize(SUITE, again)
  )
  a = resolve(SUITE, SUITE.variants[0], 'tiny', 0, extra)
  b = resolve(SUITE, SUITE.variants[0], 'tiny', 0, {**extra, 'train.learning_rate': 1e-3})
  assert config_hash(a) != config_hash(b) and a.seed == 0
  assert run_dir(out, SUITE, SUITE.variants[0], a) != run_dir(out, SUITE, SUITE.variants[0], b)


def test_a_failed_run_is_retried_once_then_reported(tmp_path, corpus, monkeypatch):
  """Also as on an accelerator with room for populations (its budget stood in for): a stand-in
  `run` is still what runs each job, never a population."""
  from experiments import scheduler

  def no_fit(*args):
    raise AssertionError('a stand-in run was sized into populations')

  monkeypatch.setattr(scheduler, 'device_budget', lambda: 2**30)
  monkeypatch.setattr(scheduler, 'fit_population', no_fit)
  extra = data_overrides(corpus, str(tmp_path / 'cache'))
  attempts = []

  def flaky(config, workdir, progress, measure):
    attempts.append(workdir)
    if len(attempts) == 1:
      raise OSError('transient')
    return {'eval_loss': 1.0, 'params': 1, 'active_params': 1, 'tokens_per_s': 1.0}

  one = Suite('one', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  ok = run_suite(
    one, SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), extra=extra, progress=False), run=flaky
  )
  assert len(attempts) == 2 and len(ok['runs']) == 1 and not ok['failed']

  def broken(config, workdir, progress, measure):
    raise RuntimeError('always')

  bad = run_suite(
    one,
    SuiteRun(preset='tiny', seeds=2, out=str(tmp_path / 'b'), extra=extra, progress=False),
    run=broken,
  )
  assert (
    not bad['runs'] and [f['errors'] for f in bad['failed']] == [['RuntimeError: always'] * 2] * 2
  )
  assert 'Failed runs' in report.markdown(one, bad, verdicts.summarize(one, bad))


@pytest.mark.xdist_group('finished')
def test_report_table_and_verdicts(finished):
  out, _, results = finished
  path = report.write(SUITE, results, out)
  text = Path(path).read_text()
  rows = {r['variant']: r for r in verdicts.summarize(SUITE, results)}
  assert rows['same']['test'].mean == pytest.approx(0.0, abs=1e-12)
  assert rows['same']['verdict'] == 'within noise'
  m = rows['relu']['m']
  assert rows['relu']['p_adjusted'] == pytest.approx(min(1.0, m * rows['relu']['test'].p))
  assert '| same |' in text and 'within noise' in text and '| base |' in text
  saved = json.loads(Path(os.path.join(out, 'demo', 'results.json')).read_text())
  assert len(saved['runs']) == 6
  curve = saved['runs'][0]['curve']  # per-step train losses, as logged
  assert curve['step'] == list(range(1, PRESETS['tiny']['train.steps'] + 1))
  for figure in ('deltas.png', 'loss_curves.png', 'pareto.png'):
    assert os.path.getsize(os.path.join(out, 'demo', figure)) > 1000
    assert f'![{figure}]({figure})' in text
  # TensorBoard: a run per (variant, seed) holding its curve, and the suite's layout.
  board = os.path.join(out, 'demo', 'tensorboard')
  scalars = read_tensorboard_scalars(os.path.join(board, 'relu', 's1'))
  relu = next(r for r in saved['runs'] if r['variant'] == 'relu' and r['seed'] == 1)
  assert [v for _, v in scalars['train/loss']] == pytest.approx(relu['curve']['loss'])
  assert [s for s, _ in scalars['train/loss']] == relu['curve']['step']
  assert scalars['final/eval_loss'][0][1] == pytest.approx(relu['eval_loss'])
  assert sorted(d for d in os.listdir(board) if os.path.isdir(os.path.join(board, d))) == [
    'base',
    'relu',
    'same',
  ]
  assert read_tensorboard_scalars(board) == {}  # the root holds only the layout


def test_named_rates_tuned_rows_are_named_configs_table_runs():
  """named_rates compares each config's tuned rate with its shipped one; its tuned rows (and the
  baseline) must resolve to the configs named_configs trains at those rates, so the scheduler
  copies those runs instead of training them twice; its shipped rows differ only in the rate."""
  named, rates = load_suite('named_configs'), load_suite('named_rates')
  by_name = {v.name: v for v in named.variants}
  for variant in rates.variants:
    config, lr = variant.name.rsplit('-lr', 1)
    mine = resolve(rates, variant, 'cpu', 0)
    theirs = resolve(named, by_name[config], 'cpu', 0, {'train.learning_rate': float(lr)})
    assert mine.train.learning_rate == float(lr)
    assert config_hash(mine) == config_hash(theirs), variant.name
    # A tuned row is compared with the same config shipped, a shipped row with the baseline.
    assert variant.versus in ('', f'{config}-lr0.003'), variant.name


def test_every_named_config_ships_the_rate_named_configs_tuned_for_it():
  """The committed named_configs tuning (its grid centred on base's rate for every config, so a
  config's shipped rate does not move the runs) chose each config's best rate; `python launch.py
  --config=configs/NAME.py` trains at it. A re-run that moves a best rate fails here until the
  config follows (or a named_rates-style check says why not)."""
  import mllm

  named = load_suite('named_configs')
  with open(os.path.join(ROOT, 'experiments', 'results', 'named_configs', 'results.json')) as f:
    tuning = json.load(f)['tuning']
  for variant in named.variants:
    assert resolve(named, variant, 'cpu', 0).train.learning_rate == 3e-3, variant.name
    shipped = mllm.load_config(os.path.join(ROOT, 'configs', f'{variant.name}.py'))
    assert tuning[variant.name]['center'] == 3e-3
    assert shipped.train.learning_rate == tuning[variant.name]['best_lr'], variant.name


def test_suites_load_and_resolve_every_preset():
  assert {'noise', 'ffn'} <= set(available())
  for name in available():
    suite = load_suite(name)
    if isinstance(suite, BenchmarkSuite):
      continue
    for preset in suite.presets:
      for variant in suite.variants:
        resolve(suite, variant, preset, 0)  # validates; raises on a bad override
    # A preset's FFN (_presets.CPU_FFN) would override a row's own choice of FFN, silently.
    if 'model.ffn.kind' in suite.presets.get('cpu', {}):
      for variant in suite.variants:
        chosen = 'ffn=' in variant.choices or any(
          k.startswith('model.ffn') for k in variant.overrides
        )
        assert not chosen, (name, variant.name)
  ffn = load_suite('ffn')
  moe = resolve(ffn, ffn.variants[-1], 'cpu', 0)
  dense = resolve(
    ffn,
    ffn.variants[ffn.variants.index(next(v for v in ffn.variants if v.name == 'swiglu'))],
    'cpu',
    0,
  )
  from mllm import count_params

  # top-2 of experts half as wide: the dense SwiGLU's FFN parameters are active (router aside).
  assert count_params(moe).active - count_params(dense).active == (
    moe.model.n_layers * moe.model.d_model * moe.model.ffn.moe.num_experts
  )


def test_cli_refuses_an_unknown_suite_in_one_line():
  proc = launch_server.shared().run(['nonesuch', '--preset=tiny'], module='experiments')
  assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
    "error: suite 'nonesuch' does not exist; allowed:"
  )


@pytest.mark.parametrize(
  'args, message',
  [
    (['--engine=ray', "--resources=[1]"], "error: --resources='[1]'; allowed: a JSON object"),
    (['--engine=ray', '--resources={"GPU": -1}'], 'error: --resources=\'{"GPU": -1}\'; allowed'),
    (
      ['--engine=ray', '--out=gs://bucket/x'],
      "error: --out='gs://bucket/x'; allowed with --engine=ray: a directory every Ray node mounts",
    ),
    (['--ray_address=auto'], 'error: --ray_address and --resources go with --engine=ray'),
    (['--engine=ray'], "error: --engine=ray; allowed for the benchmark suite 'flash': local"),
  ],
)
def test_cli_refuses_bad_engine_flags_in_one_line(args, message):
  suite = 'flash' if args == ['--engine=ray'] else 'noise'
  proc = launch_server.shared().run([suite, '--preset=tiny', *args], module='experiments')
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert proc.stderr.startswith(message), proc.stderr


def test_attention_heads_variants_match_parameters_and_measure_decoding(tmp_path, corpus):
  from mllm import count_params

  suite = load_suite('attention_heads')
  counts = {v.name: count_params(resolve(suite, v, 'cpu', 0)).total for v in suite.variants}
  kv = {v.name: resolve(suite, v, 'cpu', 0).model.n_kv_heads for v in suite.variants}
  assert kv == {'MHA': 8, 'GQA-4': 4, 'GQA-2': 2, 'MQA': 1}
  for name, n in counts.items():  # the FFN gives back the dropped K/V weights, to 1%
    assert abs(n - counts['MHA']) / counts['MHA'] < 0.01, (name, n, counts['MHA'])
  mqa = Suite('mqa', 'x', suite.base, (suite.variants[-1],), suite.presets, extra_metrics='decode')
  out = run_suite(
    mqa,
    one_seed(tmp_path, corpus),
  )
  run = out['runs'][0]
  m = resolve(mqa, mqa.variants[0], 'tiny', 0).model
  assert run['kv_bytes_per_token'] == 2 * m.n_layers * 1 * (m.d_model // m.n_heads) * 4
  assert run['decode_tok_s'] > 0
  assert 'KV bytes/token' in report.markdown(mqa, out, verdicts.summarize(mqa, out))


def test_positions_suite_evaluates_past_the_training_context(tmp_path, corpus):
  import math

  suite = load_suite('positions')
  two = Suite(
    'pos',
    'x',
    suite.base,
    tuple(v for v in suite.variants if v.name in ('rope', 'learned')),
    suite.presets,
    extra_metrics='extrapolation',
  )
  out = run_suite(
    two,
    one_seed(tmp_path, corpus),
  )
  runs = {r['variant']: r for r in out['runs']}
  assert all(math.isfinite(runs['rope'][f'loss_at_{k}L']) for k in (2, 4, 8, 16))
  assert runs['rope']['loss_at_16L'] != runs['rope']['loss_at_2L']
  assert all(math.isnan(runs['learned'][f'loss_at_{k}L']) for k in (2, 4, 8, 16))
  text = report.markdown(two, out, verdicts.summarize(two, out))
  assert 'loss at 16L' in text
  assert 'n/a' in text


def test_starts_from_variants_evaluate_or_fine_tune_their_parents_parameters(tmp_path, corpus):
  """An eval-only child under the same math (linear RoPE scaling by 1) reproduces its parent's
  loss exactly from the parent's checkpoint; a fine-tuning child starts from the parent's workdir;
  a changed parent is a new child."""
  extra = data_overrides(corpus, str(tmp_path / 'cache'))
  suite = Suite(
    'chain',
    'x',
    'configs/rope_swiglu.py',
    (
      Variant('parent'),
      Variant(
        'same-math',
        overrides={'model.position.rope.scaling.kind': 'linear'},
        starts_from='parent',
        trains=False,
      ),
      Variant('tuned', overrides={'train.steps': 3}, starts_from='parent'),
    ),
    PRESETS,
  )
  out = run_suite(
    suite, SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), extra=extra, progress=False)
  )
  assert not out['failed']
  runs = {r['variant']: r for r in out['runs']}
  assert runs['same-math']['eval_loss'] == runs['parent']['eval_loss']
  assert runs['same-math']['steps'] == 0 and runs['same-math']['tokens_per_s'] is None
  assert not os.path.exists(os.path.join(runs['same-math']['workdir'], 'checkpoints'))
  saved = json.loads(Path(os.path.join(runs['tuned']['workdir'], 'run_config.json')).read_text())
  assert saved['train']['init_from'] == f"workdir:{runs['parent']['workdir']}"
  own = runs['tuned']['flops_per_token'] * runs['tuned']['tokens']
  assert runs['tuned']['train_flops'] == own + runs['parent']['train_flops']
  text = report.markdown(suite, out, verdicts.summarize(suite, out))
  assert (
    '| same-math (evaluated from parent) |' in text and '| tuned (fine-tuned from parent) |' in text
  )
  spent = report_notes.cost(out)  # the evaluated-only child's time counts too
  assert (spent['trained'], spent['evaluated']) == (2, 1)
  assert spent['run_minutes'] == pytest.approx(sum(r['wall_s'] for r in out['runs']) / 60)
  # A changed parent changes every child's directory; an unchanged one keeps them.
  again = run_suite(
    suite,
    SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), extra=extra, progress=False),
    run=None,
  )
  assert [r['workdir'] for r in again['runs']] == [r['workdir'] for r in out['runs']]
  # A parent finished by an older runner (no token or FLOP counts) still has evaluated children.
  parent_result = os.path.join(runs['parent']['workdir'], 'result.json')
  old = {
    k: v
    for k, v in json.loads(Path(parent_result).read_text()).items()
    if k not in ('tokens', 'train_flops')
  }
  Path(parent_result).write_text(json.dumps(old))
  os.remove(os.path.join(runs['same-math']['workdir'], 'result.json'))
  redone = run_suite(
    suite, SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), extra=extra, progress=False)
  )
  assert (
    not redone['failed']
    and next(r for r in redone['runs'] if r['variant'] == 'same-math')['eval_loss']
    == runs['parent']['eval_loss']
  )
  changed = run_suite(
    suite,
    SuiteRun(
      preset='tiny',
      seeds=1,
      out=str(tmp_path),
      extra={**extra, 'train.learning_rate': 1e-3},
      progress=False,
    ),
    run=None,
  )
  assert len(changed['pending']) == 3 and not set(p['workdir'] for p in changed['pending']) & set(
    r['workdir'] for r in out['runs']
  )


def test_a_child_of_a_failed_run_is_reported_not_run(tmp_path, corpus):
  suite = Suite(
    'chain',
    'x',
    'configs/base.py',
    (Variant('parent'), Variant('child', starts_from='parent', trains=False)),
    PRESETS,
  )
  calls = []

  def broken(config, workdir, progress, measure, **kwargs):
    calls.append(kwargs)
    raise RuntimeError('always')

  out = run_suite(
    suite,
    one_seed(tmp_path, corpus),
    run=broken,
  )
  assert len(calls) == 2 and [f['variant'] for f in out['failed']] == ['parent', 'child']
  assert out['failed'][1]['errors'] == ['its starts_from run parent seed 0 did not finish']


def test_a_suite_refuses_a_starts_from_that_is_not_an_earlier_variant():
  with pytest.raises(ValueError, match=r"starts_from='later'; allowed: an earlier variant \(a\)"):
    Suite(
      'x',
      'x',
      'configs/base.py',
      (Variant('a'), Variant('b', starts_from='later'), Variant('later')),
      PRESETS,
    )
  with pytest.raises(ValueError, match='trains=False but no starts_from'):
    Suite('x', 'x', 'configs/base.py', (Variant('a'), Variant('b', trains=False)), PRESETS)


def test_context_extension_suite_scales_for_8L_and_measures_1_to_8L(tmp_path, corpus):
  import math

  suite = load_suite('context_extension')
  cfg = {v.name: resolve(suite, v, 'cpu', 0) for v in suite.variants}
  length = cfg['rope'].data.seq_len
  for name in ('pi', 'ntk', 'yarn', 'pi-finetune'):
    pos = cfg[name].model.position
    scaling = pos.rope.scaling[pos.rope.scaling.kind]
    assert scaling.factor == 8 and pos.rope.original_max_len == length, name
  tuned = cfg['pi-finetune']
  assert tuned.data.seq_len == 8 * length and tuned.model.max_seq_len == 8 * length
  assert tuned.data.batch_size * tuned.data.seq_len == cfg['rope'].data.batch_size * length
  small = Suite(
    'ce',
    'x',
    suite.base,
    tuple(v for v in suite.variants if v.name in ('rope', 'pi', 'pi-finetune')),
    suite.presets,
    metric=suite.metric,
    extra_metrics=suite.extra_metrics,
  )
  out = run_suite(
    small,
    one_seed(tmp_path, corpus),
  )
  runs = {r['variant']: r for r in out['runs']}
  assert not out['failed'] and set(runs) == {'rope', 'pi', 'pi-finetune'}
  for run in runs.values():
    assert all(math.isfinite(run[f'loss_at_{k}L']) for k in (1, 2, 4, 8))
  assert runs['pi']['loss_at_1L'] != runs['rope']['loss_at_1L']  # the scaling changes the math
  path = report.write(small, out, str(tmp_path))
  assert os.path.getsize(os.path.join(tmp_path, 'ce', 'loss_vs_context.png')) > 1000
  assert '![loss_vs_context.png](loss_vs_context.png)' in Path(path).read_text()


def test_a_diverged_run_is_a_result_and_its_row_says_so(tmp_path, corpus):
  extra = {
    **data_overrides(corpus, str(tmp_path / 'cache')),
    'train.learning_rate': 1e9,
    'train.grad_clip': 0.0,
    'train.warmup_steps': 0,
  }
  suite = Suite('div', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  config = resolve(suite, suite.variants[0], 'tiny', 0, extra)
  result = run_one(config, str(tmp_path / 'run'), progress=False)
  assert 1 <= result['diverged_at_step'] <= config.train.steps
  assert result['eval_loss'] != result['eval_loss']  # NaN
  # In a table: the finite seeds' mean, no paired test, the verdict says how many diverged.
  two = Suite('div', 'x', 'configs/base.py', (Variant('base'), Variant('hot')), PRESETS)
  runs = [
    {
      'variant': 'base',
      'seed': s,
      'eval_loss': 3.0 + s / 10,
      'params': 1,
      'active_params': 1,
      'tokens_per_s': 1.0,
    }
    for s in range(3)
  ]
  runs += [
    {
      'variant': 'hot',
      'seed': s,
      'eval_loss': 3.5,
      'params': 1,
      'active_params': 1,
      'tokens_per_s': 1.0,
    }
    for s in (0, 2)
  ]
  runs.insert(4, {**result, 'variant': 'hot', 'seed': 1, 'tokens_per_s': None})
  results = {'preset': 'tiny', 'seeds': 3, 'runs': runs, 'failed': [], 'pending': []}
  rows = {r['variant']: r for r in verdicts.summarize(two, results)}
  assert rows['hot']['n'] == 2 and rows['hot']['mean'] == 3.5 and 'test' not in rows['hot']
  assert rows['hot']['verdict'] == 'diverged in 1 of 3 seeds'
  assert '| diverged in 1 of 3 seeds |' in report.markdown(
    two, results, verdicts.summarize(two, results)
  )


def test_norms_suite_measures_each_layers_gradient_norm(tmp_path, corpus):
  suite = load_suite('norms')
  names = [v.name for v in suite.variants]
  assert names == [
    'rmsnorm',
    'layernorm',
    'partial_rmsnorm',
    'partial_rmsnorm-32_features',
    'pre-no_warmup',
    'post-warmup',
    'post-no_warmup',
    'post-warmup-at_3e-3',
  ]
  post = resolve(suite, suite.variants[names.index('post-no_warmup')], 'cpu', 0)
  base = resolve(suite, suite.variants[0], 'cpu', 0)
  assert post.model.norm.placement == 'post' and post.train.warmup_steps == 0
  # The learning rate is tuned per variant (the runner's grid), not a variant of its own.
  assert post.train.learning_rate == base.train.learning_rate
  assert base.train.warmup_steps == base.train.steps // 10
  # The diagnosis row: Post-LN with warm-up at a fixed rate one grid step below its tuned one.
  lower = suite.variants[names.index('post-warmup-at_3e-3')]
  assert not lower.tune and resolve(suite, lower, 'cpu', 0).train.learning_rate == 3e-3
  two = Suite(
    'nrm',
    'x',
    suite.base,
    (suite.variants[0], suite.variants[names.index('post-warmup')]),
    suite.presets,
    extra_metrics=suite.extra_metrics,
  )
  out = run_suite(
    two,
    SuiteRun(
      preset='tiny',
      seeds=1,
      out=str(tmp_path),
      progress=False,
      extra={**data_overrides(corpus, str(tmp_path / 'cache')), 'model.n_layers': 2},
    ),
  )
  for run in out['runs']:
    assert len(run['ffn_grad_norm_init']) == 2 and len(run['ffn_grad_norm_final']) == 2
    assert run['grad_ratio_init'] == run['ffn_grad_norm_init'][1] / run['ffn_grad_norm_init'][0]
  path = report.write(two, out, str(tmp_path))
  assert os.path.getsize(os.path.join(tmp_path, 'nrm', 'grad_norms.png')) > 1000
  assert 'FFN grad norm last/first layer, init' in Path(path).read_text()


def test_flash_suite_writes_the_benchmark_table_beside_the_papers_numbers(tmp_path):
  proc = launch_server.shared().run(
    ['flash', '--preset=tiny', f'--out={tmp_path}'], module='experiments', timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = Path(tmp_path / 'flash' / 'results.md').read_text()
  assert text.startswith('# Suite `flash`') and '41.7 vs 7.3 ms' in text
  results = json.loads(Path(tmp_path / 'flash' / 'results.json').read_text())
  # The code that timed it, as every training run records it (digested here independently).
  assert results['provenance']['code'] == provenance.code_digest()
  assert f"Provenance: code {results['provenance']['code']}" in text
  rows = results['rows']
  assert {(r['impl'], r['N']) for r in rows} == {
    (i, n) for i in ('xla', 'blockwise') for n in (64, 128)
  }
  assert all(r['fwd_ms'] > 0 for r in rows)
  assert os.path.getsize(tmp_path / 'flash' / 'results.png') > 1000


@pytest.mark.xdist_group('finished')
def test_remeasure_runs_the_measure_again_on_finished_runs(finished, monkeypatch):
  from experiments import measures

  out, extra, _ = finished
  seen = []

  def probe(config, workdir):
    seen.append(workdir)
    return {'decode_tok_s': 123.0}

  monkeypatch.setitem(measures.MEASURES, 'probe', probe)
  probed = Suite('demo', 'x', 'configs/base.py', SUITE.variants, PRESETS, extra_metrics='probe')
  again = run_suite(
    probed,
    SuiteRun(preset='tiny', seeds=2, out=out, extra=extra, progress=False, remeasure=True),
    run=None,
  )
  assert sorted(seen) == sorted(r['workdir'] for r in again['runs']) and len(seen) == 6
  for run in again['runs']:
    assert (
      json.loads(Path(os.path.join(run['workdir'], 'result.json')).read_text())['decode_tok_s']
      == 123.0
    )


KILL_SCRIPT = r'''
import sys
sys.path.insert(0, TESTS)
from experiments.runner import SuiteRun, run_suite
from test_experiments import SUITE, data_overrides
extra = {**data_overrides(CORPUS, CACHE), 'train.steps': 100000, 'train.log_every': 1,
         'train.checkpoint_every': 100000, 'train.eval_every': 0}
two = type(SUITE)('demo', 'x', 'configs/base.py', (SUITE.variants[0], SUITE.variants[2]),
                  SUITE.presets)
try:
  run_suite(two, SuiteRun(preset='tiny', seeds=1, out=OUT, extra=extra, progress=False, jobs=2,
                          engine=ENGINE))
except KeyboardInterrupt:
  sys.exit(130)
'''


def _workers_of(out: str) -> list[int]:
  """PIDs of live processes writing a worker.log under `out`: the local pool's
  `python -m experiments.worker` processes, or Ray's worker processes running a run."""
  pids = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/stat') as f:
        if f.read().rsplit(')', 1)[1].split()[0] == 'Z':
          continue
      targets = [os.readlink(f'/proc/{pid}/fd/{fd}') for fd in os.listdir(f'/proc/{pid}/fd')]
    except OSError:
      continue
    if any(t.startswith(out) and t.endswith('worker.log') for t in targets):
      pids.append(int(pid))
  return pids


@pytest.mark.parametrize(
  'engine',
  ['local', pytest.param('ray', marks=[pytest.mark.xdist_group('finished'), pytest.mark.slow])],
)
def test_sigterm_to_the_suite_stops_its_workers_and_they_save(corpus, tmp_path, engine):
  """A preempted suite (SIGTERM to its main process, jobs=2) passes the signal on: the workers
  save a checkpoint and exit, none keeps training unsupervised, and the suite exits 130. Ray's
  workers get the stop as a task cancellation (KeyboardInterrupt in the run)."""
  import glob
  import signal
  import time

  out = str(tmp_path / 'out')
  code = (
    KILL_SCRIPT.replace('TESTS', repr(os.path.join(ROOT, 'tests')))
    .replace('CORPUS', repr(str(corpus)))
    .replace('CACHE', repr(str(tmp_path / 'cache')))
    .replace('OUT', repr(out))
    .replace('ENGINE', repr(engine))
  )
  proc = subprocess.Popen(
    [sys.executable, '-c', code], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS='cpu')
  )
  try:
    deadline = time.time() + 240
    while time.time() < deadline:  # both workers past their first logged step
      logs = glob.glob(os.path.join(out, '**', 'metrics.jsonl'), recursive=True)
      if len(logs) == 2 and all('"train"' in Path(p).read_text() for p in logs):
        break
      assert proc.poll() is None, 'the suite ended before it was stopped'
      time.sleep(0.5)
    workers = _workers_of(out)
    assert len(workers) == 2, workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
  finally:
    if proc.poll() is None:
      proc.kill()
  assert not _workers_of(out)
  for workdir in {os.path.dirname(p) for p in logs}:
    steps = [int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')) if s.isdigit()]
    assert steps and max(steps) > 0, workdir  # the SIGTERM save (checkpoint_every is 100,000)


def test_the_moe_suites_top1_row_gates_its_expert_by_the_router_probability():
  """Switch's top-1 (eq. 2): y = p_i E_i(x). The row trained renormalised gates until 2026-11-26,
  a gate of 1 whose router learned only from the balancing and z losses; that setting stays as a
  diagnosis row of its own."""
  from mllm.layers.moe import training_note

  suite = load_suite('moe')
  rows = {v.name: resolve(suite, v, 'cpu', 0) for v in suite.variants}
  assert rows['top1'].model.ffn.moe.top_k == 1 and not rows['top1'].model.ffn.moe.renormalize
  assert training_note(rows['top1'].model.ffn.moe) is None
  assert training_note(rows['top1-renormalized'].model.ffn.moe) is not None
  # The two rows differ in that one key, so the diagnosis row is the old top1 row's config and
  # its finished runs (same hash) stand.
  top1 = mllm.load_config(rows['top1'], {'model.ffn.moe.renormalize': True})
  assert config_hash(top1) == config_hash(rows['top1-renormalized'])


def test_the_runner_holds_the_library_from_its_start():
  """A suite's process imports every library module its runs and measures use when it starts:
  one imported hours later, after the code on disk changed, would mix two versions."""
  code = (
    'import sys, experiments.runner; '
    "print(all(m in sys.modules for m in ('mllm.train.loop', 'mllm.train.metrics', "
    "'mllm.generation.text', 'mllm.layers.moe')))"
  )
  proc = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  assert proc.stdout.strip() == 'True', proc.stderr[-2000:]


def test_variants_and_steps_trim_a_suite_for_a_smoke_run(capsys):
  """`--variants` keeps the named rows in the suite's order and `--steps` shortens every run
  (warm-up scaled, evaluation at the end), both checked before anything runs."""
  from experiments.__main__ import _only, _steps, main

  ffn = load_suite('ffn')
  trimmed = _only(ffn, 'swiglu,relu')
  assert [v.name for v in trimmed.variants] == ['relu', 'swiglu']
  assert trimmed.variants[1] is ffn.variants[[v.name for v in ffn.variants].index('swiglu')]
  config = resolve(trimmed, trimmed.variants[0], 'gpu', 0, _steps(100))
  assert (config.train.steps, config.train.warmup_steps, config.train.eval_every) == (100, 10, 0)
  # A row's diagnosis or re-tuning goes with it: trimming the rows it names away is no error.
  positions = _only(load_suite('positions'), 'rope,alibi')
  assert positions.diagnoses == {} and positions.refine_lr == ('rope',)
  assert _only(load_suite('ffn_tokens'), 'relu,swish').retune_lr == ('relu',)
  assert main(['ffn', '--variants=relu,nope', '--steps=20', '--out=/nonexistent']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [
    "error: --variants=relu,nope: no 'nope' in 'ffn'; allowed: "
    + ', '.join(v.name for v in ffn.variants)
  ]
  assert main(['ffn', '--steps=1', '--out=/nonexistent']) == 2
  assert capsys.readouterr().err.strip() == 'error: --steps=1; allowed: an integer >= 2'


def test_a_suite_runs_its_own_seed_count_unless_told(monkeypatch, tmp_path):
  """`noise` and `ffn` declare 5 table seeds: a plain re-run must not report 3 of them; --seeds
  still overrides, and the other suites keep 3."""
  import experiments.__main__ as cli

  asked = []

  def fake_run_suite(suite, how, **kw):
    asked.append((suite.name, how.seeds))
    raise KeyboardInterrupt  # stop before the report: only the seed count is under test

  monkeypatch.setattr(cli, 'run_suite', fake_run_suite)
  for argv in (['noise'], ['ffn'], ['norms'], ['noise', '--seeds=2']):
    assert cli.main([*argv, f'--out={tmp_path}']) == 130
  assert asked == [('noise', 5), ('ffn', 5), ('norms', 3), ('noise', 2)]


def test_the_reproduce_cli_refuses_in_one_line(tmp_path, capsys):
  from experiments import reproduce

  for argv, says in (
    (['no_such_suite', f'--out={tmp_path}'], "suite 'no_such_suite' does not exist; allowed: "),
    (['ffn', f'--out={tmp_path}'], "suite 'ffn' has no results ("),
    (['ffn', '--steps=0'], '--steps=0; allowed: a positive integer'),
  ):
    assert reproduce.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: ') and says in err[0], err


def test_two_versions_that_ran_the_same_config_and_seed_are_compared_from_their_records(tmp_path):
  """reproduce.recorded: no training; a config and seed that two suites' ledgers hold from two
  code versions compares their first three logged losses, and a table holding both versions
  states the comparison."""
  from experiments import provenance, reproduce

  old = {'ledger_commit': '83cf9458 (2026-11-26 01:25 UTC)'}
  new = {**provenance.current(), 'code': 'aaaaaaaaaaaa'}
  newer = {**provenance.current(), 'code': 'bbbbbbbbbbbb'}

  def ledger(suite, entries):
    os.makedirs(tmp_path / suite)
    with open(tmp_path / suite / 'finished.jsonl', 'w') as f:
      for run, seed, record, losses in entries:
        result = {'provenance': record, 'curve': {'step': [10, 20, 30, 40], 'loss': losses}}
        f.write(json.dumps({'hash': run[-12:], 'seed': seed, 'run': run, 'result': result}) + '\n')

  ledger('a', [('moe-top2-s0-0123456789ab', 0, old, [5.0, 4.0, 3.0, 2.0])])
  ledger('b', [('dense-s0-0123456789ab', 0, new, [5.0, 4.0, 3.0, 9.0])])  # differs after step 30
  ledger('c', [('dense-s0-0123456789ab', 0, newer, [5.0, 4.2, 3.0, 2.0])])
  found = {(c['suites'][0], c['suites'][1]): c for c in reproduce.recorded(str(tmp_path))}
  assert set(found) == {('a', 'b'), ('a', 'c'), ('b', 'c')}
  assert found['a', 'b']['same'] and found['a', 'b']['steps'] == [10, 20, 30]
  assert found['a', 'b']['run'] == 'moe-top2 seed 0'
  assert not found['a', 'c']['same'] and found['a', 'c']['at_step'] == 20
  assert abs(found['a', 'c']['max_abs_diff'] - 0.2) < 1e-9
  table = [
    {'variant': 'x', 'seed': 0, 'provenance': old},
    {'variant': 'y', 'seed': 0, 'provenance': new},
  ]
  kept = reproduce.relevant(table, list(found.values()))
  assert [(c['suites'][0], c['suites'][1]) for c in kept] == [('a', 'b')]
  assert reproduce.sentence(kept[0]) == (
    'moe-top2 seed 0 ran under not recorded (finished by commit 83cf9458 (2026-11-26 01:25 UTC)) '
    f'(in a) and under {provenance.label(new)} (in b) with the same train loss at steps 10-30: '
    'those versions pair.'
  )


def test_a_tables_code_versions_are_grouped_by_the_checks_that_link_them():
  """reproduce.pairing: versions linked by same-loss checks form one group, through a version
  outside the table too; groups are said to differ only where a check found them apart."""
  from experiments import provenance, reproduce

  def version(code):
    return {**provenance.current(), 'code': code}

  a, b, c, outside = (version(x * 12) for x in 'abcd')
  runs = [{'provenance': v} for v in (a, a, b, c)]

  def link(x, y, same):
    return {'from': x, 'under': y, 'same': same}

  found = reproduce.pairing(runs, [link(a, outside, True), link(b, outside, True)])
  groups = [[label.split(' ')[1] for label in g] for g in found['groups']]
  assert groups == [['a' * 12, 'b' * 12], ['c' * 12]] and not found['differ']
  assert 'are not all checked across them' in reproduce.pairing_sentence(found)
  found = reproduce.pairing(
    runs, [link(a, outside, True), link(b, outside, True), link(c, outside, False)]
  )
  assert found['differ'] and 'rows across the groups are not paired' in (
    reproduce.pairing_sentence(found)
  )
  drift = {**link(c, b, False), 'same_draw': True}  # the same draw, numerics drifting later
  found = reproduce.pairing(runs, [link(a, b, True), drift])
  assert len(found['groups']) == 1
  assert reproduce.pairing_sentence(found).startswith('Its 3 code versions pair')
  assert reproduce.pairing(runs[:2], []) is None  # one version: nothing to say


def test_rates_tuned_on_runs_of_another_version_are_named():
  """report_notes.tuned_elsewhere: tuning runs whose version is neither the table's nor linked to it by
  a same-draw check are counted by version, and the provenance line names them."""
  from experiments import provenance

  a, b, c = ({**provenance.current(), 'code': x * 12} for x in 'abc')
  point = {'lr': 1e-3, 'seeds': [1000, 1001, 1002], 'eval_loss': [3.0] * 3, 'provenance': [a, b, c]}
  results = {
    'runs': [{'variant': 'base', 'seed': 0, 'provenance': a}],
    'tuning': {'base': {'points': [point], 'refined': {'points': [{**point, 'provenance': [b]}]}}},
  }
  linked = [{'from': c, 'under': a, 'same': True}]
  assert report_notes.tuned_elsewhere(results, linked) == [
    {'runs': 2, 'label': provenance.label(b)}
  ]
  assert (
    report_notes.tuned_elsewhere(results, linked + [{'from': b, 'under': c, 'same': True}]) == []
  )
  lines = report_notes.provenance_lines({**results, 'tuned_elsewhere': [{'runs': 2, 'label': 'X'}]})
  assert lines[0].endswith("not checked to draw as the table's do: 2 tuning runs: X.")


@pytest.mark.xdist_group('finished')
def test_a_suite_trained_in_populations_reports_what_the_sequential_suite_reports(
  finished, tmp_path, monkeypatch
):
  """The demo suite again with --population=auto on a device with room for two of each shape
  (each variant's two seeds one program; 'same', the twin of 'base', is copied from it): every
  run an ordinary record, results.md the same apart from its timings, each eval loss within 1e-5
  of its sequential run's. The device's budget and the fit stand in for an accelerator's (tested
  themselves in test_population.py); each shape is sized once."""
  from experiments import scheduler

  sized = []
  monkeypatch.setattr(scheduler, 'device_budget', lambda: 2**30)
  monkeypatch.setattr(
    scheduler, 'fit_population', lambda config, mesh, budget: sized.append(config) or (2, 2**20)
  )
  _, extra, sequential = finished
  results = run_suite(
    SUITE, SuiteRun(preset='tiny', seeds=2, out=str(tmp_path), extra=extra, progress=False)
  )
  assert not results['failed'] and len(results['runs']) == 6
  shapes = [c.to_dict() for c in sized]
  for shape in shapes:  # what a population's members share: all but the seed and the rate
    del shape['seed'], shape['train']['learning_rate']
  assert sized and all(a != b for i, a in enumerate(shapes) for b in shapes[i + 1 :])
  before = {(r['variant'], r['seed']): r for r in sequential['runs']}
  for run in results['runs']:
    other = before[run['variant'], run['seed']]
    if 'copied_from' not in run and 'copied_from' not in other:  # (the fixture's killed run
      assert set(run) == set(other)  # resumed itself; here it is a fresh twin, copied)
    assert run['eval_loss'] == pytest.approx(other['eval_loss'], abs=1e-5)

  def table(results, folder):  # results.md without what times things: lines, the tok/s column
    text = Path(report.write(SUITE, results, folder)).read_text()
    lines = [line for line in text.splitlines() if ' s' not in line and 'tok/s' not in line]
    return [line.rsplit('|', 2)[0] if line.startswith('| ') else line for line in lines]

  assert table(results, str(tmp_path)) == table(sequential, str(tmp_path / 'sequential'))
  with pytest.raises(ValueError, match=r'^--population=2; allowed: .*--jobs=1'):
    run_suite(SUITE, SuiteRun(preset='tiny', seeds=1, out=str(tmp_path), population=2, jobs=2))
