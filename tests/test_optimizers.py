"""Optimizers (mllm/optimizers.py): Muon's matrices against a float64 NumPy polar factor, its
AdamW part against optax.adamw, its decoupled decay, and an exact resume.

Muon steps along the orthogonalised momentum: the polar factor U Vᵀ of the matrix (its SVD
U S Vᵀ), approximated by 5 quintic Newton-Schulz steps whose singular values land in about
[0.7, 1.2] (Jordan et al. 2024), not exactly 1. So the reference is NumPy's SVD in float64, and
the test asks for the direction (cosine) and a band for the singular values.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import make_config, tiny_config, trains_and_resumes_bitwise
from flax import nnx

from mllm.checks import ConfigError
from mllm.optimizers import AdamW, Muon, MuonSettings, muon_dimensions, weight_decay_mask
from mllm.train.state import abstract_state, split_trained

LR = 1e-2


def _params(choices: str = 'opt=muon', **overrides):
  """A tiny model's trained parameters with random values, and its config."""
  config = tiny_config(choices, **overrides)
  structure = split_trained(abstract_state(config)['params'])[0]
  leaves, treedef = jax.tree.flatten(structure)
  key = jax.random.key(0)
  values = [
    jax.random.normal(jax.random.fold_in(key, i), leaf.shape, leaf.dtype)
    for i, leaf in enumerate(leaves)
  ]
  return jax.tree.unflatten(treedef, values), config


def _by_path(tree) -> dict[str, np.ndarray]:
  def name(path):
    return '/'.join(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path if k != 'value')

  return {
    name(path).removesuffix('/value'): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


def _dimensions(params) -> dict[str, object]:
  out = {}
  jax.tree_util.tree_map_with_path(
    lambda path, var: out.setdefault(
      '/'.join(str(getattr(k, 'key', k)) for k in path),
      muon_dimensions(tuple(str(getattr(k, 'key', k)) for k in path), var),
    ),
    params,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )
  return out


def test_muon_takes_the_hidden_matrices_and_leaves_tables_norms_and_biases_to_adamw():
  params, _ = _params(
    'opt=muon,ffn=moe,pos=learned',
    model__tie_embeddings=False,
    model__scan_layers=True,
    model__attention__qkv_bias=True,
  )
  dims = {k: (None if d is None else tuple(d)) for k, d in _dimensions(params).items()}
  # Scanned layers put the layer axis first: a batch axis, as the experts' axis is.
  assert dims['blocks/attention/query/kernel'] == (1, (2, 3))  # [L, D, N, H]: D → N·H
  assert dims['blocks/attention/out/kernel'] == ((1, 2), 3)  # [L, N, H, D]: N·H → D
  assert dims['blocks/ffn/experts/gate'] == (2, (3,))  # [L, E, D, F]
  assert dims['blocks/ffn/experts/down'] == ((2,), 3)  # [L, E, F, D]
  assert dims['blocks/ffn/router'] == (1, (2,))  # [L, D, E]
  for adam in (
    'embed/embedding',
    'head/kernel',
    'position/table',
    'final_norm/scale',
    'blocks/attention_norm/scale',
    'blocks/attention/query/bias',
  ):
    assert dims[adam] is None, adam
  assert set(dims) >= {'position/table', 'blocks/attention/query/bias'}  # they were there


def _orthogonality(update: np.ndarray, gradient: np.ndarray, fan_in_axes, fan_out_axes):
  """(cosine of the update with the gradient's float64 polar factor, the update's singular
  values over the expected scale), the matrix laid out as [fan_in, fan_out]."""
  axes = list(fan_in_axes) + list(fan_out_axes)
  fan_in = int(np.prod([gradient.shape[a] for a in fan_in_axes]))
  g = np.transpose(gradient, axes).reshape(fan_in, -1).astype(np.float64)
  u = np.transpose(update, axes).reshape(fan_in, -1).astype(np.float64)
  left, _, right = np.linalg.svd(g, full_matrices=False)
  polar = left @ right
  cosine = np.sum(u * polar) / (np.linalg.norm(u) * np.linalg.norm(polar))
  # consistent_rms 0.2 scales an orthogonal update by √max(fan_in, fan_out) · 0.2 (Liu et al. eq. 4)
  scale = LR * 0.2 * np.sqrt(max(g.shape))
  return cosine, np.linalg.svd(u / scale, compute_uv=False)


def test_muons_matrix_step_is_the_gradients_polar_factor_and_the_rest_is_adamws():
  """First step, no momentum (beta 0, no Nesterov), no decay: a matrix's update is −lr · 0.2 ·
  √max(fan_in, fan_out) · NS(g) ≈ −lr · 0.2 · √max · U Vᵀ; a table's, norm's or bias's is
  exactly optax.adamw's with the same mask."""
  params, config = _params(model__tie_embeddings=False, train__weight_decay=0.0)
  gradients = jax.tree.map(lambda x: -0.3 * x, params)  # any full-rank matrices
  settings = MuonSettings(beta=0.0, nesterov=False)
  muon = Muon.build(config.train, settings, lambda _: LR, params)
  adamw = AdamW.build(config.train, None, lambda _: LR, params)
  update = _by_path(muon.update(gradients, muon.init(params), params)[0])
  reference = _by_path(adamw.update(gradients, adamw.init(params), params)[0])
  grad = _by_path(gradients)
  checked = 0
  for name, d in _dimensions(params).items():
    if d is None:
      np.testing.assert_array_equal(update[name], reference[name], err_msg=name)
      continue
    fan_in = (d.reduction_axis,) if isinstance(d.reduction_axis, int) else d.reduction_axis
    fan_out = (d.output_axis,) if isinstance(d.output_axis, int) else d.output_axis
    cosine, singular = _orthogonality(-update[name], grad[name], fan_in, fan_out)
    assert cosine > 0.97, (name, cosine)
    assert singular.min() > 0.6 and singular.max() < 1.25, (name, singular)
    checked += 1
  assert checked == 4 * 2 + 3 * 2  # q, k, v, out and gate, up, down in each of 2 layers


def test_muons_decay_is_decoupled_and_masked_like_adamws():
  """A zero gradient: each decayed parameter moves by −lr · λ · θ (on Muon's matrices and AdamW's
  untied head alike); the embedding and the norms (masked out) do not move."""
  params, config = _params(model__tie_embeddings=False, train__weight_decay=0.1)
  tx = Muon.build(config.train, MuonSettings(), lambda _: LR, params)
  zeros = jax.tree.map(np.zeros_like, params)
  update = _by_path(tx.update(zeros, tx.init(params), params)[0])
  decays = _by_path(weight_decay_mask(params, config.train))
  values = _by_path(params)
  assert decays['head/kernel'] and decays['blocks/0/ffn/up/kernel']
  assert not decays['embed/embedding'] and not decays['final_norm/scale']
  for name, value in values.items():
    expected = -LR * 0.1 * value if decays[name] else np.zeros_like(value)
    np.testing.assert_allclose(update[name], expected, rtol=1e-5, atol=1e-9, err_msg=name)


def test_muons_adamw_part_runs_at_its_own_ratio_of_the_rate():
  params, config = _params(model__tie_embeddings=False, train__weight_decay=0.0)
  gradients = jax.tree.map(lambda x: 0.5 * x, params)
  steps = {}
  for ratio in (1.0, 0.25):
    tx = Muon.build(config.train, MuonSettings(adam_lr_ratio=ratio), lambda _: LR, params)
    steps[ratio] = _by_path(tx.update(gradients, tx.init(params), params)[0])
  np.testing.assert_allclose(steps[0.25]['head/kernel'], 0.25 * steps[1.0]['head/kernel'])
  np.testing.assert_array_equal(
    steps[0.25]['blocks/0/ffn/up/kernel'], steps[1.0]['blocks/0/ffn/up/kernel']
  )


def test_a_muon_run_resumes_bitwise_exactly_and_its_loss_falls(corpus, tmp_path):
  config = make_config(corpus, str(tmp_path / 'cache'), train__optimizer__kind='muon')
  trains_and_resumes_bitwise(config, tmp_path)


def test_the_optimizer_is_a_choice_section_with_its_own_keys(tiny):
  assert tiny().train.optimizer.kind == 'adamw'
  muon = tiny('opt=muon,muon.ns_steps=3')
  assert (muon.train.optimizer.kind, muon.train.optimizer.muon.ns_steps) == ('muon', 3)
  with pytest.raises(ConfigError) as err:  # Muon's key set while AdamW is chosen
    tiny(train__optimizer__muon__beta=0.5)
  assert str(err.value).startswith('train.optimizer.muon.beta=0.5: read only by')
  assert '\n' not in str(err.value)
  with pytest.raises(ConfigError, match=r"train.optimizer.kind='sgd'.*adamw, muon"):
    tiny('opt=sgd')
