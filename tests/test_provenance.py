"""Provenance: every run records the code, packages and device that produced it; a finished run of
other code is reused only when asked (and the report says so), never silently."""

from __future__ import annotations

import json
import os

import pytest
from test_lr_tuning import SUITE, _fake_run

from experiments import __main__ as cli
from experiments import provenance, report
from experiments.runner import resolve, run_suite
from experiments.scheduler import LEDGER


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
  assert provenance.same_computation(here, {**here, 'commit': 'elsewhere', 'python': '3.0'})
  assert not provenance.same_computation({'ledger_commit': 'abc'}, here)  # not recorded
  assert provenance.label(here).startswith(f"code {here['code']}")
  assert provenance.label({'ledger_commit': '616e4cf4'}) == (
    'not recorded (finished by commit 616e4cf4)'
  )


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
  run_suite(SUITE, preset='tiny', seeds=1, out=out, progress=False, run=_fake_run(optimum, 1, []))
  _other_code(out, 'tune')
  with pytest.raises(ValueError, match=r'3 finished runs here came from other code.*--reuse_other'):
    run_suite(SUITE, preset='tiny', seeds=1, out=out, progress=False, run=_fake_run(optimum, 1, []))
  calls = []
  kept = run_suite(
    SUITE,
    preset='tiny',
    seeds=1,
    out=out,
    progress=False,
    run=_fake_run(optimum, 1, calls),
    reuse_other_code=True,
  )
  assert calls == [] and kept['reused_other_code'] and len(kept['runs']) == 3
  text = report.markdown(SUITE, kept, report.summarize(SUITE, kept))
  assert 'Provenance: 3 runs: code 000000000000' in text
  assert 'continued with --reuse_other_code' in text
  # A report reads whatever finished, and names each code version it mixes.
  fresh = provenance.current()
  mixed = {**kept, 'runs': [*kept['runs'][:2], {**kept['runs'][2], 'provenance': fresh}]}
  text = report.markdown(SUITE, mixed, report.summarize(SUITE, mixed))
  assert 'Provenance (MIXED' in text and f"1 runs: code {fresh['code']}" in text


def test_another_suites_run_of_other_code_is_trained_again_not_copied(tmp_path):
  from experiments.suite import Suite, Variant
  from experiments.suites._presets import PRESETS

  out = str(tmp_path)
  plain = Suite('plain', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  center = resolve(plain, plain.variants[0], 'tiny', 0).train.learning_rate
  run_suite(
    plain, preset='tiny', seeds=1, out=out, progress=False, run=_fake_run({'base': center}, 1, [])
  )
  _other_code(out, 'plain')
  calls = []
  copy = Suite('copy', 'x', 'configs/base.py', (Variant('base'),), PRESETS)
  again = run_suite(
    copy, preset='tiny', seeds=1, out=out, progress=False, run=_fake_run({'base': center}, 1, calls)
  )
  assert len(calls) == 1 and 'copied_from' not in again['runs'][0]
  assert provenance.same_computation(again['runs'][0]['provenance'], provenance.current())


def test_the_cli_refuses_runs_of_other_code_in_one_line(tmp_path, capsys, monkeypatch):
  out = str(tmp_path)
  center = resolve(SUITE, SUITE.variants[0], 'tiny', 0).train.learning_rate
  optimum = {'base': center, 'relu': center, 'child': 1.0}
  run_suite(SUITE, preset='tiny', seeds=1, out=out, progress=False, run=_fake_run(optimum, 1, []))
  _other_code(out, 'tune')
  monkeypatch.setattr(cli, 'load_suite', lambda name: SUITE)
  monkeypatch.setattr(cli, 'available', lambda: ['tune'])
  code = cli.main(['tune', '--preset=tiny', '--seeds=1', f'--out={out}', '--no-tune_lr'])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith('error: 3 finished runs here')
  assert '--reuse_other_code' in err[0] and 'Traceback' not in err[0]
