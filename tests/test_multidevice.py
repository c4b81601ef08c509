"""Sharding over meshes of 8 fake CPU devices gives the 1-device results: (data, fsdp, tensor)
for a dense model, with AdamW and with Muon; (data, expert) and (fsdp, expert, tensor) for an MoE
model, whose experts are sharded over the expert axis.

Runs in a subprocess: the device count is fixed when JAX starts. Each step blocks on its loss,
which avoids a deadlock of XLA:CPU's multi-device collectives when steps are queued back to
back (mllm/train/loop.py waits for each step on a multi-device CPU for the same reason).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, cpu_devices_env

SCRIPT = r'''
import json, sys
import jax, numpy as np
sys.path.insert(0, ROOT)
from conftest import tiny_config
from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import setup
from mllm.train.step import make_train_step, synthetic_batch

assert jax.device_count() == 8, jax.devices()
config = tiny_config(CHOICES, model__vocab_size=64, **OVERRIDES, model__d_model=32, model__n_heads=4,
                     model__n_kv_heads=2, model__max_seq_len=32, data__seq_len=32,
                     data__batch_size=8, train__warmup_steps=1, train__steps=10,
                     model__dropout=0.1, model__scan_layers=SCAN, train__eps=EPS)
rng = np.random.default_rng(0)
batches = [synthetic_batch(config, rng) for _ in range(3)]
result = {}
for shape in MESHES:
  n = int(np.prod(list(shape.values())))
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 1, **shape}, jax.devices()[:n])
  model, init = setup(config, mesh)
  step, state = make_train_step(model), init()
  text = step.lower(state, global_batch(batches[0], mesh)).as_text()
  losses = []
  for b in batches:
    state, metrics = step(state, global_batch(b, mesh))
    losses.append(float(metrics['loss']))  # blocks: no two all-reducing steps in flight
  params = jax.device_get(state['params'])
  specs = sorted({str(leaf.sharding.spec) for leaf in jax.tree.leaves(state['params'])})
  result[json.dumps(shape)] = {
      'losses': losses, 'params': [np.asarray(p).tolist() for p in jax.tree.leaves(params)],
      'specs': specs, 'per_shard': 'manual_computation' in text or 'FullToShard' in text}
print('RESULT' + json.dumps(result))
'''


# Adam's update is m̂/(√v̂ + eps). Where a gradient sums to ~eps (a weight whose contributions
# cancel), float32 reassociation of the sharded sums moves it by δ and the update by up to lr·δ/eps:
# at optax's eps 1e-8 one weight in thousands moved by 1-2% of the learning rate, more under jax
# 0.12's XLA than 0.10's. At eps 1e-3 the same δ moves an update by lr·δ/1e-3, far under the
# tolerance, and a small gradient's update stays proportional to it, so a sharding bug that
# scales gradients moves weights too (at 1e-8 Adam would normalise it away).
ADAM_EPS = 1e-3


def run(meshes: list[dict], scan: bool = False, choices: str = '', **overrides) -> dict:
  env = cpu_devices_env(8)
  code = (
    SCRIPT.replace('ROOT', repr(os.path.join(ROOT, 'tests')))
    .replace('SCAN', str(scan))
    .replace('MESHES', repr(meshes))
    .replace('CHOICES', repr(choices))
    .replace('OVERRIDES', repr(overrides))
    .replace('EPS', repr(ADAM_EPS))
  )
  proc = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(ln for ln in proc.stdout.splitlines() if ln.startswith('RESULT'))
  return {name: value for name, value in json.loads(line[len('RESULT') :]).items()}


def assert_matches_one_device(result: dict, one: str = '{}', atol: float = 2e-6):
  import numpy as np

  for name, got in result.items():
    if name == one:
      continue
    np.testing.assert_allclose(got['losses'], result[one]['losses'], rtol=2e-5, err_msg=name)
    for a, b in zip(got['params'], result[one]['params']):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=atol, err_msg=name)


def test_sharded_meshes_match_one_device():
  result = run([{}, {'data': 2, 'fsdp': 2, 'tensor': 2}])
  assert all('fsdp' not in s and 'tensor' not in s for s in result['{}']['specs'])
  sharded = result['{"data": 2, "fsdp": 2, "tensor": 2}']['specs']
  assert any('fsdp' in s for s in sharded) and any('tensor' in s for s in sharded)  # really
  assert_matches_one_device(result)


def test_muon_on_a_sharded_mesh_matches_one_device():
  """Muon's Newton-Schulz on matrices split over fsdp and tensor, its momentum sharded as they are
  (scanned layers: the layer axis is one of its batch axes)."""
  result = run([{}, {'data': 2, 'fsdp': 2, 'tensor': 2}], scan=True, choices='opt=muon')
  sharded = result['{"data": 2, "fsdp": 2, "tensor": 2}']['specs']
  assert any('fsdp' in s for s in sharded) and any('tensor' in s for s in sharded)
  assert_matches_one_device(result)


def test_expert_parallel_meshes_match_one_device():
  """Experts split 4 ways, and 2 ways beside FSDP and tensor parallelism; router noise and the
  aux-loss-free bias on, capacity dispatch (its capacity is the global batch's)."""
  meshes = [{}, {'data': 2, 'expert': 4}, {'fsdp': 2, 'expert': 2, 'tensor': 2}]
  result = run(meshes, choices='ffn=moe,num_experts=4,top_k=2,noise=mixture,expert_bias=true')
  specs = result['{"data": 2, "expert": 4}']['specs']
  assert "P('expert', None, None)" in specs, specs  # expert weights [E, D, F]
  assert any(
    "'expert'" in s and 'tensor' in s
    for s in result['{"fsdp": 2, "expert": 2, "tensor": 2}']['specs']
  )
  assert_matches_one_device(result)


def test_kernels_run_per_shard_and_match_one_device():
  """A Pallas kernel is a custom call XLA cannot split: on a mesh it runs per device under
  shard_map (batch over data, heads and ALiBi slopes over tensor), packed documents included."""
  result = run(
    [{}, {'data': 2, 'tensor': 2}], choices='pos=alibi,attn=pallas', data__document_mask=True
  )
  assert not result['{}']['per_shard'] and result['{"data": 2, "tensor": 2}']['per_shard']
  assert_matches_one_device(result)


HF_SCRIPT = r'''
import jax, numpy as np
from flax import nnx
import mllm
from mllm.interop import hf
from mllm.train.sharding import make_mesh
from mllm.train.state import setup
assert jax.device_count() == 4, jax.devices()
path = PATH
config = mllm.load_config(hf.base_config_path(), {**hf.config_overrides(hf.read_hf_config(path)),
                                                  'mesh.data': 1, 'mesh.expert': 2, 'mesh.tensor': 2})
model, _ = setup(config, make_mesh(config.mesh))
abstract = model.abstract_state['params']
placed = hf.hf_params(path, config, abstract)
_, reference = hf.from_hf(path)
want = nnx.state(reference, nnx.Param)
sharded = 0
for got, like, ref in zip(jax.tree.leaves(placed), jax.tree.leaves(abstract), jax.tree.leaves(want)):
  assert got.sharding == like.sharding, (got.sharding, like.sharding)
  assert np.array_equal(np.asarray(got), np.asarray(ref))
  if len(got.sharding.device_set) == 4 and not got.sharding.is_fully_replicated:
    sharded += 1
    shard = got.addressable_shards[0]
    assert shard.data.shape != got.shape  # a device holds its slice, not the whole tensor
print('SHARDED', sharded)
'''


def test_hf_weights_load_straight_onto_the_meshs_shardings():
  """Qwen3-MoE on an (expert 2, tensor 2) mesh: every imported tensor has the sharding the train
  state wants, each device holding its slice, with the unsharded import's values."""
  env = cpu_devices_env(4)
  path = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'qwen3-moe')
  proc = subprocess.run(
    [sys.executable, '-c', HF_SCRIPT.replace('PATH', repr(path))],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert int(proc.stdout.split('SHARDED')[-1]) > 10, proc.stdout


GENERATE_SCRIPT = r'''
import sys
import jax, numpy as np
sys.path.insert(0, ROOT)
from conftest import tiny_config
from mllm.generation import generate_tokens
import mllm.ops.attention as attention
import mllm.ops.mesh as on_mesh
from mllm.train.sharding import make_mesh
from mllm.train.state import setup
assert jax.device_count() == 4, jax.devices()
config = tiny_config('pos=alibi,attn=pallas', model__vocab_size=64, model__d_model=32,
                     model__n_heads=4, model__n_kv_heads=2, model__max_seq_len=64,
                     mesh__data=2, mesh__tensor=2)
calls = []
plain = attention.run_impl
def recording(impl, *args, **kwargs):
  mesh = on_mesh.current_mesh()
  calls.append((impl, 0 if mesh is None else mesh.size))
  return plain(impl, *args, **kwargs)
attention.run_impl = recording
parts, init = setup(config, make_mesh(config.mesh))
params = init()['params']
sharded = parts.merge(params)
sharded.eval()
prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13]]
got = generate_tokens(sharded, prompts, max_new_tokens=8)
on_mesh_calls = list(calls)
one_parts, _ = setup(config, make_mesh({'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 1},
                                       jax.devices()[:1]))
single = one_parts.merge(jax.device_put(jax.device_get(params), jax.devices()[0]))
single.eval()
want = generate_tokens(single, prompts, max_new_tokens=8)
assert got == want, (got, want)
print('TRACED', sorted(set(on_mesh_calls)))
'''


def test_generation_on_a_mesh_traces_for_it_and_matches_one_device():
  """generate_tokens traces for the mesh its parameters live on (as the train step does, so
  `auto` chooses for those devices): on a (data 2, tensor 2) mesh the prefill chunk runs
  blockwise (a kernel's index-only masks cannot follow cache positions), the decode step xla,
  both traced under the 4-device mesh, and the tokens are the 1-device ones."""
  env = cpu_devices_env(4)
  code = GENERATE_SCRIPT.replace('ROOT', repr(os.path.join(ROOT, 'tests')))
  proc = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split('TRACED')[-1].strip() == "[('blockwise', 4), ('xla', 4)]", proc.stdout
