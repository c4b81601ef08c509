"""The training loop's parts against their definitions: schedules, decay mask, sharding rules, MFU."""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_config
from flax import nnx
from jax.sharding import PartitionSpec as P

import mllm
from mllm.config import ConfigError
from mllm.optimizers import weight_decay_mask
from mllm.train.metrics import peak_flops_per_device
from mllm.train.optimizer import learning_rate_schedule
from mllm.train.sharding import logical_to_spec, mesh_shape


@pytest.mark.parametrize('kind', ['cosine', 'linear', 'constant', 'inverse_sqrt'])
def test_schedules_against_their_formulas(kind):
  t = tiny_config(
    train__schedule=kind,
    train__steps=100,
    train__warmup_steps=10,
    train__learning_rate=1.0,
    train__min_lr_ratio=0.1,
  ).train
  schedule = learning_rate_schedule(t)
  for k in range(100):  # update k (0-based) uses the rate at s = k + 1
    s = k + 1
    if s <= 10:
      expected = s / 10
    elif kind == 'cosine':
      expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 90))
    elif kind == 'linear':
      expected = 1.0 - 0.9 * (s - 10) / 90
    elif kind == 'constant':
      expected = 1.0
    else:
      expected = 1 / math.sqrt(1 + (s - 10) / 10)
    assert float(schedule(k)) == pytest.approx(expected, rel=1e-5, abs=1e-7), (kind, k)


def _mask_by_name(choices, **overrides):
  config = tiny_config(choices, **overrides)
  model = nnx.eval_shape(lambda: __import__('mllm').build_model(config, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  mask = weight_decay_mask(params, config.train)
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(mask)[0]}


def test_weight_decay_skips_norms_biases_and_embeddings_by_default():
  mask = _mask_by_name(
    'pos=learned,norm=layernorm', model__attention__use_bias=True, model__tie_embeddings=False
  )
  for name, decays in mask.items():
    matrix = name.endswith("['kernel'].value") and 'norm' not in name
    assert decays == matrix, name
  assert any('head' in n and v for n, v in mask.items())  # an untied head is a matrix
  everything = _mask_by_name(
    'pos=learned,norm=layernorm', train__decay_embeddings=True, train__decay_norms_and_biases=True
  )
  assert all(everything.values())


def test_logical_axis_rules_shard_divisible_dimensions_only():
  mesh = jax.make_mesh(
    (1, 1, 1), ('data', 'fsdp', 'tensor'), axis_types=(jax.sharding.AxisType.Auto,) * 3
  )

  class FakeMesh:  # logical_to_spec reads only .shape
    shape = {'data': 2, 'fsdp': 4, 'tensor': 2}  # noqa: RUF012 (read, never mutated)

  assert logical_to_spec(('embed', 'heads', 'head_dim'), (256, 8, 32), FakeMesh) == P(
    'fsdp', 'tensor', None
  )
  assert logical_to_spec(('embed', 'kv_heads', 'head_dim'), (256, 1, 32), FakeMesh) == P(
    'fsdp', None, None
  )  # MQA's single KV head stays whole
  assert logical_to_spec(('embed', 'mlp'), (6, 680), FakeMesh) == P(None, 'tensor')
  # A scanned layer axis is unnamed and stays whole.
  assert logical_to_spec(('norm',), (4, 256), FakeMesh) == P(None, None)
  assert logical_to_spec(('vocab', 'embed'), (512, 256), mesh) == P(None, None)


def test_mesh_shapes_and_errors():
  assert mesh_shape({'data': -1, 'fsdp': 2, 'expert': 1, 'tensor': 1}, 8) == (4, 2, 1, 1)
  assert mesh_shape({'data': 2, 'fsdp': 2, 'expert': 1, 'tensor': 2}, 8) == (2, 2, 1, 2)
  assert mesh_shape({'data': 1, 'fsdp': 2, 'expert': -1, 'tensor': 1}, 8) == (1, 2, 4, 1)
  with pytest.raises(ConfigError, match='multiply to 4, but there are 8 devices'):
    mesh_shape({'data': 2, 'fsdp': 2, 'expert': 1, 'tensor': 1}, 8)
  with pytest.raises(ConfigError, match='must divide the 8 devices'):
    mesh_shape({'data': -1, 'fsdp': 3, 'expert': 1, 'tensor': 1}, 8)


def test_peak_flops_table():
  assert peak_flops_per_device('NVIDIA H100 80GB HBM3', 'bfloat16') == 989e12
  assert peak_flops_per_device('NVIDIA H200', 'float32') == 495e12
  assert peak_flops_per_device('TPU v5 lite', 'bfloat16') == 197e12
  assert peak_flops_per_device('cpu', 'float32') is None
  assert peak_flops_per_device('cpu', 'float32', override=1e12) == 1e12


@pytest.mark.parametrize(
  'key,value,text',
  [
    ('train.schedule', "'cosin'", "train.schedule='cosin': unknown learning-rate schedule"),
    ('train.grad_accum_steps', '3', 'train.grad_accum_steps=3: must divide data.batch_size=8'),
    ('train.warmup_steps', '600', 'train.warmup_steps=600: must be < train.steps=500'),
    ('data.source', "'csv'", "data.source='csv': unknown data source"),
    ('mesh.tensor', '0', 'mesh.tensor=0: a mesh axis size is a positive integer'),
    ('model.remat', "'some'", "model.remat='some': unknown remat policy"),
    ('model.scan_unroll', '2', 'model.scan_unroll=2: unrolls scanned layers; set model.scan_la'),
    ('model.scan_unroll', '9', 'model.scan_unroll=9: allowed: 1 to model.n_layers=4'),
    ('model.scan_unroll', '0', 'model.scan_unroll=0'),
  ],
)
def test_training_config_errors(key, value, text):
  from mllm.config import load_config
  from mllm.config_keys import parse_value

  with pytest.raises(ConfigError) as info:
    load_config(os.path.join(ROOT, 'configs', 'base.py'), {key: parse_value(value)})
  assert text in str(info.value) and '\n' not in str(info.value)


def test_a_missing_data_path_is_refused_before_the_backend_starts(tmp_path, monkeypatch):
  """The one-line error (launch's exit 2 is test_bad_inputs' 'data-missing') comes before the
  mesh, whose first device query starts the backend: seconds on a GPU."""
  from mllm.train import loop, opening

  def no_mesh(*args, **kwargs):
    raise AssertionError('the mesh was built before data.path was checked')

  monkeypatch.setattr(opening, 'make_mesh', no_mesh)
  missing = tmp_path / 'nope'
  config = tiny_config(data__source='text', data__path=str(missing))
  with pytest.raises(ConfigError, match=rf"^data\.path='{missing}': no such file or folder"):
    loop.train(config, str(tmp_path / 'run'), progress=False)


def _two_steps(**overrides):
  return _two_steps_cached(tuple(sorted(overrides.items())))


@functools.cache
def _two_steps_cached(items):
  overrides = dict(items)
  from mllm.train.sharding import global_batch, make_mesh
  from mllm.train.state import setup
  from mllm.train.step import make_train_step, synthetic_batch

  config = tiny_config(data__batch_size=4, train__warmup_steps=1, **overrides)
  mesh = make_mesh(config.mesh, jax.devices()[:1])
  model, init = setup(config, mesh)
  step, state = make_train_step(model), init()
  batch = global_batch(synthetic_batch(config, np.random.default_rng(3)), mesh)
  losses = []
  for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss']))
  return losses, jax.device_get(state)


@pytest.mark.parametrize('remat,scan', [('full', False), ('dots', True)])
def test_remat_recomputes_the_same_gradients(remat, scan):
  ref_losses, ref = _two_steps(model__scan_layers=scan)
  losses, state = _two_steps(model__scan_layers=scan, model__remat=remat)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state['params']), jax.tree.leaves(ref['params'])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('unroll', [2, 3])
def test_scanned_layers_unrolled_k_at_a_time_compute_the_same_steps(unroll):
  """model.scan_unroll runs k layers per loop iteration (2 of 3: a remainder iteration; 3: one
  iteration): the same losses and parameters as one layer per iteration, and the traced model's
  scan really carries the unroll."""
  ref_losses, ref = _two_steps(model__scan_layers=True, model__n_layers=3)
  losses, state = _two_steps(model__scan_layers=True, model__n_layers=3, model__scan_unroll=unroll)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state['params']), jax.tree.leaves(ref['params'])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  model = mllm.build_model(
    tiny_config(model__scan_layers=True, model__n_layers=3, model__scan_unroll=unroll),
    rngs=nnx.Rngs(0),
  )
  graphdef, weights = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda w, t: nnx.merge(graphdef, w)(t))(
    weights, jnp.zeros((1, 8), jnp.int32)
  )
  assert [e.params['unroll'] for e in _eqns(jaxpr.jaxpr) if e.primitive.name == 'scan'] == [unroll]


def _eqns(jaxpr):
  """Every equation of a jaxpr, nested ones (pjit, scan bodies) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, 'jaxpr', None)
        if inner is not None:
          yield from _eqns(getattr(inner, 'jaxpr', inner))


def test_bfloat16_compute_keeps_float32_parameters_and_optimizer_state():
  ref_losses, _ = _two_steps()
  losses, state = _two_steps(model__dtype='bfloat16')
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(state['params']))
  assert all(
    x.dtype == np.float32
    for x in jax.tree.leaves(state['opt_state'])
    if np.issubdtype(x.dtype, np.floating)
  )
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
  assert losses != ref_losses  # really computed in bfloat16
