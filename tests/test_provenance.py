"""Provenance: every run records the code, packages and device that produced it; a finished run of
other code is reused only when asked (and the report says so), never silently."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from test_lr_tuning import SUITE, _fake_run

from experiments import __main__ as cli
from experiments import provenance, report, verdicts
from experiments.ledger import LEDGER
from experiments.runner import SuiteRun, resolve, run_suite


def _package(root, body: str) -> str:
  os.makedirs(os.path.join(root, 'pkg'), exist_ok=True)
  with open(os.path.join(root, 'pkg', 'mod.py'), 'w') as f:
    f.write(body)
  return provenance.code_digest(str(root), ('pkg',))


def test_the_code_digest_ignores_docstrings_and_comments_but_not_code(tmp_path):
  plain = _package(tmp_path, 'def f(x):\n  return x + 1\n')
  documented = _package(
    tmp_path, '"""A module."""\n\n\ndef f(x):  # adds one\n  """One more."""\n  return x + 1\n'
  )
  changed = _package(tmp_path, 'def f(x):\n  return x + 2\n')
  assert plain == documented != changed and len(plain) == 12


def test_a_record_names_the_code_packages_and_device():
  here = provenance.current()
  import jax

  assert here['code'] == provenance.code_digest() and here['jax'] == jax.__version__
  assert here['device'] == jax.devices()[0].device_kind and here['backend'] == jax.default_backend()
  assert provenance.same_computation(here, dict(here))
  assert not provenance.same_computation(here, {**here, 'jax': '0.0.1'})
  assert not provenance.same_computation(here, {**here, 'code': 'something else'})
  assert provenance.same_computation(here, {**here, 'commit': 'elsewhere', 'dirty': True})
  assert here['host'] == provenance.host()
  # The host is recorded, not compared.
  assert provenance.same_computation(here, {**here, 'host': 'another CPU'})
  assert not provenance.same_computation(here, {**here, 'python': '3.0'})  # another corpus
  assert not provenance.same_computation({'ledger_commit': 'abc'}, here)  # not recorded
  assert provenance.label(here).startswith(f"code {here['code']}")
  assert provenance.label({'ledger_commit': '616e4cf4'}) == (
    'not recorded (finished by commit 616e4cf4)'
  )


def test_the_host_names_the_cpu_its_cores_and_the_features_that_pick_xlas_kernels():
  # /proc/cpuinfo's first processor on an x86 host (AVX-512 with bf16 dots) and on an Arm one.
  x86 = {
    'model name': 'AMD EPYC 9R14',
    'flags': 'fpu sse2 avx fma avx2 avx512f avx512dq avx512_bf16 avx512_vnni sha_ni',
  }
  arm = {'CPU implementer': '0x41', 'Features': 'fp asimd aes crc32 asimddp sve i8mm bf16'}
  cores = os.cpu_count()
  assert (
    provenance.host(x86)
    == f'AMD EPYC 9R14, {cores} cores: avx2 fma avx512f avx512_vnni avx512_bf16'
  )
  assert provenance.host(arm).endswith(f', {cores} cores: asimd asimddp bf16 i8mm sve')
  assert provenance.host({'model name': 'Old', 'flags': 'sse2'}).endswith(
    'none of avx2/fma/avx512f'
  )
  assert provenance.host({'model name': 'M', 'other': 'x'}).endswith('cores: features not listed')
  # This machine's, read by another path: grep's view of /proc/cpuinfo.
  if os.path.exists('/proc/cpuinfo'):
    with open('/proc/cpuinfo') as f:
      flags = next(
        (line.split(':', 1)[1].split() for line in f if line.startswith(('flags', 'Features'))), []
      )
    assert provenance.cpu_features() == [c for c in provenance.CPU_FEATURES if c in flags]


def test_a_report_names_the_hosts_its_runs_ran_on():
  from experiments import report_notes

  here = provenance.current()
  runs = [
    {'variant': 'a', 'seed': s, 'provenance': {**here, 'host': h}}
    for s, h in enumerate(['X, 2 cores: avx2', 'X, 2 cores: avx2', 'Y, 2 cores: avx512f'])
  ]
  line = report_notes.provenance_lines({'runs': runs})[0]
  assert line.startswith('Provenance: 3 runs: code')  # one computation: hosts do not split it
  assert line.endswith(
    'Hosts (not part of a run\'s identity: another CPU sums in another order, '
    'a perturbation like a new draw of noise): 2 runs on X, 2 cores: avx2; '
    '1 run on Y, 2 cores: avx512f.'
  )
  one = report_notes.provenance_lines({'runs': runs[:2]})[0]
  assert one.endswith(' Host: 2 runs on X, 2 cores: avx2.')
  # Runs recorded before hosts were say nothing of a host (committed reports stay as they were).
  older = [
    {**r, 'provenance': {k: v for k, v in r['provenance'].items() if k != 'host'}} for r in runs
  ]
  assert 'Host' not in report_notes.provenance_lines({'runs': older})[0]
  mixed = report_notes.provenance_lines({'runs': [*older[:1], *runs[2:]]})[0]
  # Ties keep the order first seen.
  assert mixed.endswith('1 run on a host not recorded; 1 run on Y, 2 cores: avx512f.')


def _other_code(out: str, suite: str) -> None:
  """Rewrite every finished run of `suite` under `out` as if other code had produced it."""
  ledger = os.path.join(out, suite, LEDGER)
  with open(ledger) as f:
    entries = [json.loads(line) for line in f]
  for entry in entries:
    entry['result']['provenance'] = {**entry['result']['provenance'], 'code': '000000000000'}
  with open(ledger, 'w') as f:
    f.writelines(json.dumps(e) + '\n' for e in entries)
  for entry in entries:
    path = os.path.join(out, suite, 'runs', entry['run'], 'result.json')
    with open(path, 'w') as f:
      json.dump(entry['result'], f)


def test_runs_of_other_code_stop_the_suite_unless_reused_and_the_report_says_so(tmp_path):
  out = str(tmp_path)
  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  optimum = {'base': center, 'relu': center, 'child': 1.0}
  run_suite(
    SUITE, SuiteRun(preset='tiny', seeds=1, out=out, progress=False), run=_fake_run(optimum, 1, [])
  )
  _other_code(out, 'tune')
  with pytest.raises(ValueError, match=r'3 finished runs here came from other code.*--reuse_other'):
    run_suite(
      SUITE,
      SuiteRun(preset='tiny', seeds=1, out=out, progress=False),
      run=_fake_run(optimum, 1, []),
    )
  calls = []
  kept = run_suite(
    SUITE,
    SuiteRun(preset='tiny', seeds=1, out=out, progress=False, reuse_other_code=True),
    run=_fake_run(optimum, 1, calls),
  )
  assert calls == [] and kept['reused_other_code'] and len(kept['runs']) == 3
  text = report.markdown(SUITE, kept, verdicts.summarize(SUITE, kept))
  assert 'Provenance: 3 runs: code 000000000000' in text
  assert 'continued with --reuse_other_code' in text
  # A report made later without the flag (nothing runs) keeps the record of the one it rewrites;
  # a suite never continued that way does not gain it.
  report.write(SUITE, kept, out)
  again = run_suite(SUITE, SuiteRun(preset='tiny', seeds=1, out=out, progress=False), run=None)
  assert again['reused_other_code'] and len(again['runs']) == 3
  os.remove(os.path.join(out, SUITE.name, 'results.json'))
  plain = run_suite(SUITE, SuiteRun(preset='tiny', seeds=1, out=out, progress=False), run=None)
  assert 'reused_other_code' not in plain
  # A report reads whatever finished, and names each code version it mixes.
  fresh = provenance.current()
  mixed = {**kept, 'runs': [*kept['runs'][:2], {**kept['runs'][2], 'provenance': fresh}]}
  text = report.markdown(SUITE, mixed, verdicts.summarize(SUITE, mixed))
  assert 'Provenance (MIXED' in text and f"1 runs: code {fresh['code']}" in text


def test_another_suites_run_of_other_code_is_trained_again_not_copied(tmp_path):
  from experiments.suite import Suite, Variant
  from experiments.suites._presets import PRESETS

  out = str(tmp_path)
  plain = Suite('plain', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  center = resolve(plain, plain.variants[0], 'tiny', 0).train.learning_rate
  run_suite(
    plain,
    SuiteRun(preset='tiny', seeds=1, out=out, progress=False),
    run=_fake_run({'base': center}, 1, []),
  )
  _other_code(out, 'plain')
  calls = []
  copy = Suite('copy', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  again = run_suite(
    copy,
    SuiteRun(preset='tiny', seeds=1, out=out, progress=False),
    run=_fake_run({'base': center}, 1, calls),
  )
  assert len(calls) == 1 and 'copied_from' not in again['runs'][0]
  assert provenance.same_computation(again['runs'][0]['provenance'], provenance.current())
  # --reuse_other_code keeps a suite's own runs of other code, never another suite's.
  _other_code(out, 'copy')
  calls.clear()
  third = Suite('third', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  reused = run_suite(
    third,
    SuiteRun(preset='tiny', seeds=1, out=out, progress=False, reuse_other_code=True),
    run=_fake_run({'base': center}, 1, calls),
  )
  assert len(calls) == 1 and 'copied_from' not in reused['runs'][0]


def test_a_run_folder_its_ledger_records_otherwise_is_stale_and_the_ledger_wins(tmp_path):
  """A checkout whose run folder still holds an older result of a run (its ledger line was
  replaced, the run trained again elsewhere) reports the ledger's record, as a fresh clone does,
  and the stale folder is set aside; a result newer than the ledger (a run that finished and is
  about to be recorded) is left alone."""
  from experiments.run import read_result, write_result
  from experiments.suite import Suite, Variant
  from experiments.suites._presets import PRESETS

  out = str(tmp_path)
  plain = Suite('plain', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  center = resolve(plain, plain.variants[0], 'tiny', 0).train.learning_rate
  done = run_suite(
    plain,
    SuiteRun(preset='tiny', seeds=2, out=out, progress=False),
    run=_fake_run({'base': center}, 1, []),
  )
  stale, fresh = (r['workdir'] for r in done['runs'])
  recorded = read_result(stale)['eval_loss']
  write_result(stale, {**read_result(stale), 'eval_loss': recorded + 1.0})
  before = time.time() - 3600  # written before the ledger last changed
  os.utime(os.path.join(stale, 'result.json'), (before, before))
  write_result(fresh, {**read_result(fresh), 'eval_loss': 9.0})  # newer than the ledger
  again = run_suite(plain, SuiteRun(preset='tiny', seeds=2, out=out, progress=False), run=None)
  assert [r['eval_loss'] for r in again['runs']] == [recorded, 9.0]
  assert read_result(stale)['eval_loss'] == recorded
  aside = [n for n in os.listdir(os.path.dirname(stale)) if '.stale-' in n]
  assert len(aside) == 1 and aside[0].startswith(os.path.basename(stale))


def test_the_cli_refuses_runs_of_other_code_in_one_line(tmp_path, capsys, monkeypatch):
  out = str(tmp_path)
  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  optimum = {'base': center, 'relu': center, 'child': 1.0}
  run_suite(
    SUITE, SuiteRun(preset='tiny', seeds=1, out=out, progress=False), run=_fake_run(optimum, 1, [])
  )
  _other_code(out, 'tune')
  monkeypatch.setattr(cli, 'load_suite', lambda name: SUITE)
  monkeypatch.setattr(cli, 'available', lambda: ['tune'])
  code = cli.main(['tune', '--preset=tiny', '--seeds=1', f'--out={out}', '--no-tune_lr'])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith('error: 3 finished runs here')
  assert '--reuse_other_code' in err[0] and 'Traceback' not in err[0]


def _in_progress_elsewhere(out: str, age_s: float) -> str:
  """Suite 'other''s unfinished folder of the run that suite 'copy' (below) plans for seed 0, last
  written `age_s` seconds ago, as another process training it leaves it."""
  from experiments.run import config_hash, run_dir
  from experiments.suite import Suite, Variant
  from experiments.suites._presets import PRESETS

  other = Suite('other', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  config = resolve(other, other.variants[0], 'tiny', 0)
  workdir = run_dir(out, other, other.variants[0], config)
  assert workdir.endswith(f'-s0-{config_hash(config)}')
  os.makedirs(workdir)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.write(json.dumps({'split': 'train', 'step': 10, 'loss': 3.0}) + '\n')
  os.utime(os.path.join(workdir, 'metrics.jsonl'), (time.time() - age_s,) * 2)
  return workdir


def test_a_run_another_process_is_training_is_waited_for_and_copied(tmp_path, monkeypatch):
  """Two suites that share a run, run at once: the second trains its other runs first, then copies
  the shared one when the first finishes it; a folder nobody has written to lately is no one's."""
  from experiments import scheduler
  from experiments.suite import Suite, Variant
  from experiments.suites._presets import PRESETS

  monkeypatch.setattr(scheduler, 'POLL_S', 0.05)
  copy = Suite('copy', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  center = resolve(copy, copy.variants[0], 'tiny', 0).train.learning_rate
  out = str(tmp_path / 'live')
  other = _in_progress_elsewhere(out, age_s=1.0)
  calls, events = [], []
  train = _fake_run({'base': center}, 1, calls)

  def the_other_process_finishes():
    deadline = time.time() + 120  # generous: a loaded machine starts the suite slowly
    while not calls and time.time() < deadline:  # until 'copy' has trained its seed 1
      time.sleep(0.02)
    os.makedirs(os.path.join(other, 'checkpoints'))
    train(resolve(copy, copy.variants[0], 'tiny', 0), other, False, None)
    events.append('the other process finished seed 0')

  def run(config, workdir, progress, measure, parent=None):
    events.append(f'trained seed {config.seed} here')
    return train(config, workdir, progress, measure, parent)

  finisher = threading.Thread(target=the_other_process_finishes)
  finisher.start()
  results = run_suite(copy, SuiteRun(preset='tiny', seeds=2, out=out, progress=False), run=run)
  finisher.join()
  by_seed = {r['seed']: r for r in results['runs']}
  assert events == ['trained seed 1 here', 'the other process finished seed 0']
  assert by_seed[0]['copied_from'] == other and 'copied_from' not in by_seed[1]

  stale = str(tmp_path / 'stale')  # its process died long ago: trained here
  _in_progress_elsewhere(stale, age_s=scheduler.FRESH_S + 60)
  calls.clear()
  results = run_suite(copy, SuiteRun(preset='tiny', seeds=1, out=stale, progress=False), run=train)
  assert [c[1] for c in calls] == [0] and 'copied_from' not in results['runs'][0]
