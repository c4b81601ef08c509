"""mllm.compile_cache: a second process reads the first one's compiled step from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import CHILD_PYTHONPATH, ROOT

PROGRAM = '''
import json, sys
import jax, jax.numpy as jnp
from mllm import compile_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
path = compile_cache.enable()
y = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64)))
print(json.dumps({'dir': path, 'hits': events.count('/jax/compilation_cache/cache_hits'),
                  'value': float(y)}))
'''


def run(env):
  out = subprocess.run(
    [sys.executable, '-c', PROGRAM], env=env, cwd=ROOT, capture_output=True, text=True, check=True
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_hits_the_cache_and_computes_the_same(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_COMPILATION_CACHE')}
  env.update(
    MLLM_CACHE_DIR=str(tmp_path),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    PYTHONPATH=CHILD_PYTHONPATH,
  )
  first, second = run(env), run(env)
  assert first['dir'] == second['dir'] == str(tmp_path / 'jax')
  assert os.listdir(first['dir'])
  assert first['hits'] == 0 and second['hits'] >= 1  # the jit above, and jnp.ones' own
  assert first['value'] == second['value']


def test_the_users_folder_wins_and_zero_turns_it_off(tmp_path):
  env = {
    **os.environ,
    'PYTHONPATH': CHILD_PYTHONPATH,
    'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'mine'),
  }
  assert run(env)['dir'] == str(tmp_path / 'mine')
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_COMPILATION_CACHE')}
  env.update(
    PYTHONPATH=CHILD_PYTHONPATH, MLLM_COMPILATION_CACHE='0', MLLM_CACHE_DIR=str(tmp_path / 'c')
  )
  assert run(env)['dir'] is None and not os.path.exists(tmp_path / 'c' / 'jax')
