"""launch.py as a user runs it: the summary works; bad input is one line on stderr and exit 2."""

from __future__ import annotations

import launch_server
import pytest

TINY_FLAGS = [
  '--config.model.n_layers=1',
  '--config.model.d_model=32',
  '--config.model.n_heads=2',
  '--config.model.n_kv_heads=1',
  '--config.model.vocab_size=64',
  '--config.data.seq_len=16',
  '--config.data.batch_size=2',
]


def run_launch(*args):
  """`python launch.py ARGS` (forked from a warm process: tests/launch_server.py)."""
  return launch_server.shared().run(list(args))


def test_summary_mode_prints_tables_counts_and_a_timed_forward():
  result = run_launch(
    '--config=configs/base.py:pos=alibi,ffn=geglu,norm=layernorm,placement=post',
    '--mode=summary',
    *TINY_FLAGS,
  )
  assert result.returncode == 0, result.stderr
  out = result.stdout
  for text in (
    'model.position.kind',
    "'alibi'",
    'layer 0',
    'geglu',
    'layernorm post-LN',
    'parameters:',
    'training choices: standard parametrization, peak rate 0.003 × 256/32 = 0.024',
    'FLOPs/token',
    'forward on random tokens [2, 16]',
    'compile',
    'all finite',
  ):
    assert text in out, text
  assert 'Traceback' not in result.stderr


@pytest.mark.parametrize(
  'args,expected',
  [
    (['--config.model.n_layerz=3'], 'model.n_layerz=3: no such key'),
    (['--config.model.n_layers=three'], "model.n_layers='three': wrong type"),
    (['--config.model.n_kv_heads=3'], 'model.n_kv_heads=3: must divide model.n_heads=8'),
    (['--config=configs/base.py:pos=rop'], "model.position.kind='rop': unknown position"),
    (['--config=configs/base.py:bogus=1'], 'bogus=1: unknown choice key'),
    (
      ['--config=configs/base.py:pos=alibi,rope_scaling=linear'],
      "read only by model.position.kind='rope'",
    ),
    (['--config=configs/nope.py'], 'no such config file'),
    (['--mode=trian'], "--mode='trian': unknown mode; allowed: train, eval, summary"),
    (['--no_such_flag=1'], "Unknown command line flag 'no_such_flag'"),
  ],
)
def test_bad_input_is_one_line_and_exit_2(args, expected):
  result = run_launch(*args)
  assert result.returncode == 2, (result.stdout, result.stderr)
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith('error: ') and expected in lines[0], lines[0]
  assert 'Traceback' not in result.stderr


def test_eval_mode_evaluates_past_the_training_context(corpus, tmp_path):
  """`--mode=eval` at 4× the trained context (data.seq_len and model.max_seq_len raised) prints
  the loss evaluate() gives for that config: the trained weights on 4× longer sequences."""
  import mllm
  from mllm.train import evaluate, train

  flags = {
    'model.n_layers': 1,
    'model.d_model': 32,
    'model.n_heads': 2,
    'model.n_kv_heads': 1,
    'model.vocab_size': 258,
    'model.max_seq_len': 16,
    'data.seq_len': 16,
    'data.batch_size': 2,
    'data.source': 'text',
    'data.path': corpus,
    'data.tokenizer': 'byte',
    'data.val_fraction': 0.3,
    'data.cache_dir': str(tmp_path / 'cache'),
    'train.steps': 4,
    'train.warmup_steps': 1,
    'train.eval_every': 0,
    'train.eval_batches': 2,
    'train.tensorboard': False,
  }
  workdir = str(tmp_path / 'run')
  train(mllm.load_config('configs/base.py', flags), workdir, progress=False)
  longer = {**flags, 'data.seq_len': 64, 'model.max_seq_len': 64}
  result = run_launch(
    '--mode=eval', f'--workdir={workdir}', *(f'--config.{k}={v}' for k, v in longer.items())
  )
  assert result.returncode == 0, result.stderr
  printed = float(result.stdout.split('val loss ')[1].split()[0])
  expected = evaluate(mllm.load_config('configs/base.py', longer), workdir)
  assert printed == pytest.approx(expected['loss'], abs=1e-4)
  short = evaluate(mllm.load_config('configs/base.py', flags), workdir)
  assert expected['tokens'] == 4 * short['tokens']  # 2 batches of 2 × 64 tokens, not of 2 × 16


def test_import_mllm_is_lazy_and_every_top_level_name_resolves():
  """`import mllm` imports no Orbax, Grain or generation code (launch.py's config errors come
  before them); each name in `mllm.__all__` is the object its module defines."""
  import importlib
  import subprocess
  import sys

  from conftest import ROOT

  code = (
    'import sys, mllm\n'
    'heavy = ("orbax", "grain", "mllm.generation", "mllm.interop", "mllm.train")\n'
    'print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy)))\n'
  )
  out = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert out.stdout.strip() == '[]', out.stdout + out.stderr
  import mllm

  for name in mllm.__all__:
    assert getattr(mllm, name) is getattr(importlib.import_module(mllm._WHERE[name]), name)
  assert mllm.validation is importlib.import_module('mllm.validation')
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    mllm.no_such_name  # noqa: B018 (the attribute access is the test)


# Counts every validation of a model section (validate() runs validate_model once; build_model
# runs it for a config load_config did not make), then runs launch.py as __main__.
_COUNTING_LAUNCH = r'''
import atexit, runpy, sys
import mllm.validation as validation
calls = []
real = validation.validate_model
validation.validate_model = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
atexit.register(lambda: print('validations:', len(calls)))
sys.argv = ['launch.py', *sys.argv[1:]]
runpy.run_path('launch.py', run_name='__main__')
'''


def test_a_training_launch_validates_its_config_once(corpus, tmp_path):
  import subprocess
  import sys

  from conftest import ROOT, run_overrides

  overrides = run_overrides(
    corpus, str(tmp_path / 'cache'), **{'train.steps': 2, 'train.warmup_steps': 1}
  )
  args = [f'--config.{key}={value}' for key, value in overrides.items()]
  result = subprocess.run(
    [sys.executable, '-c', _COUNTING_LAUNCH, f'--workdir={tmp_path / "run"}', *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  assert 'validations: 1' in result.stdout, result.stdout[-2000:]
