"""launch.py as a user runs it: the summary works; bad input is one line on stderr and exit 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

TINY_FLAGS = ['--config.model.n_layers=1', '--config.model.d_model=32', '--config.model.n_heads=2',
              '--config.model.n_kv_heads=1', '--config.model.vocab_size=64',
              '--config.data.seq_len=16', '--config.data.batch_size=2']


def run_launch(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, 'launch.py', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_summary_mode_prints_tables_counts_and_a_timed_forward():
  result = run_launch('--config=configs/base.py:pos=alibi,ffn=geglu,norm=layernorm,placement=post',
                      '--mode=summary', *TINY_FLAGS)
  assert result.returncode == 0, result.stderr
  out = result.stdout
  for text in ('model.position.kind', "'alibi'", 'layer 0', 'geglu', 'layernorm post-LN',
               'parameters:', 'FLOPs/token', 'forward on random tokens [2, 16]', 'compile',
               'all finite'):
    assert text in out, text
  assert 'Traceback' not in result.stderr


@pytest.mark.parametrize('args,expected', [
    (['--config.model.n_layerz=3'], 'model.n_layerz=3: no such key'),
    (['--config.model.n_layers=three'], "model.n_layers='three': wrong type"),
    (['--config.model.n_kv_heads=3'], 'model.n_kv_heads=3: must divide model.n_heads=8'),
    (['--config=configs/base.py:pos=rop'], "model.position.kind='rop': unknown position"),
    (['--config=configs/base.py:bogus=1'], 'bogus=1: unknown choice key'),
    (['--config=configs/base.py:pos=alibi,rope_scaling=linear'], 'RoPE scaling needs'),
    (['--config=configs/nope.py'], 'no such config file'),
    (['--mode=trian'], "--mode='trian': unknown mode; allowed: train, eval, summary"),
    (['--no_such_flag=1'], "Unknown command line flag 'no_such_flag'"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected):
  result = run_launch(*args)
  assert result.returncode == 2, (result.stdout, result.stderr)
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith('error: ') and expected in lines[0], lines[0]
  assert 'Traceback' not in result.stderr
