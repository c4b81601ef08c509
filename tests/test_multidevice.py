"""Sharding over a (data, fsdp, tensor) mesh of 8 fake CPU devices gives the 1-device results.

Runs in a subprocess: the device count is fixed when JAX starts. Each step blocks on its loss,
which avoids the multi-device CPU rendezvous deadlock (JAX_NOTES.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

SCRIPT = r'''
import json, sys
import jax, numpy as np
sys.path.insert(0, ROOT)
from conftest import tiny_config
from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import setup
from mllm.train.step import make_train_step, synthetic_batch

assert jax.device_count() == 8, jax.devices()
config = tiny_config(model__vocab_size=64, model__d_model=32, model__n_heads=4,
                     model__n_kv_heads=2, model__max_seq_len=32, data__seq_len=32,
                     data__batch_size=8, train__warmup_steps=1, train__steps=10,
                     model__dropout=0.1, model__scan_layers=SCAN)
rng = np.random.default_rng(0)
batches = [synthetic_batch(config, rng) for _ in range(3)]
result = {}
for name, shape, n in [('1', (1, 1, 1), 1), ('2x2x2', (2, 2, 2), 8)]:
  mesh_cfg = dict(zip(('data', 'fsdp', 'tensor'), shape))
  mesh = make_mesh(mesh_cfg, jax.devices()[:n])
  model, init = setup(config, mesh)
  step, state = make_train_step(model), init()
  losses = []
  for b in batches:
    state, metrics = step(state, global_batch(b, mesh))
    losses.append(float(metrics['loss']))  # blocks: no two all-reducing steps in flight
  params = jax.device_get(state['params'])
  specs = sorted({str(leaf.sharding.spec) for leaf in jax.tree.leaves(state['params'])})
  result[name] = {'losses': losses, 'params': [np.asarray(p).tolist() for p in jax.tree.leaves(params)],
                  'specs': specs}
print('RESULT' + json.dumps(result))
'''


def run(scan: bool) -> dict:
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='--xla_force_host_platform_device_count=8')
  code = SCRIPT.replace('ROOT', repr(os.path.join(ROOT, 'tests'))).replace('SCAN', str(scan))
  proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith('RESULT')][0]
  return json.loads(line[len('RESULT'):])


def test_sharded_meshes_match_one_device():
  import numpy as np
  result = run(scan=False)
  one = result['1']
  assert all('fsdp' not in s and 'tensor' not in s for s in one['specs'])
  assert any('fsdp' in s for s in result['2x2x2']['specs'])  # really sharded
  assert any('tensor' in s for s in result['2x2x2']['specs'])
  for name in ('2x2x2',):
    np.testing.assert_allclose(result[name]['losses'], one['losses'], rtol=2e-5, err_msg=name)
    for a, b in zip(result[name]['params'], one['params']):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6, err_msg=name)
