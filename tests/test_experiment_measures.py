"""Measurements the suites add to their runs, against independent computations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mllm
from experiments.measures import _ffn_grad_norms
from mllm.train.state import initial_model


def _model_and_batch(scan: bool, placement: str = 'post'):
  config = mllm.load_config(
    f'configs/rope_swiglu.py:placement={placement}',
    {
      'model.d_model': 32,
      'model.n_layers': 3,
      'model.n_heads': 2,
      'model.n_kv_heads': 2,
      'model.vocab_size': 64,
      'model.max_seq_len': 16,
      'model.scan_layers': scan,
    },
  )
  net = initial_model(config)
  net.eval()
  tokens = np.random.default_rng(0).integers(0, 64, (4, 17))
  batch = {
    'inputs': jnp.asarray(tokens[:, :-1]),
    'targets': jnp.asarray(tokens[:, 1:]),
    'loss_mask': jnp.ones((4, 16), jnp.float32),
  }
  return net, batch


@pytest.mark.parametrize('placement,scan', [('pre', False), ('post', True)])
def test_ffn_grad_norms_are_the_slope_along_each_layers_gradient(placement, scan):
  """‖g_i‖ is the directional derivative of the loss along g_i/‖g_i‖: a central difference that
  moves only layer i's FFN weights (a row of the stacked arrays when layers are scanned) must
  give it back."""
  net, batch = _model_and_batch(scan=scan, placement=placement)
  norms = _ffn_grad_norms(net, [batch])
  assert len(norms) == 3 and all(n > 0 for n in norms)
  graphdef, params, rest = nnx.split(net, nnx.Param, ...)

  @jax.jit  # one program for the 12 evaluations below (op by op, each was a dispatch storm)
  def loss(params):
    logits = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))(batch['inputs'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets']).mean()

  grads = jax.jit(jax.grad(loss))(params)

  @jax.jit
  def loss_moved(t, unit):  # the loss at params + t · unit
    return loss(jax.tree.map(lambda p, d: p + t * d, params, unit))

  for layer in range(3):

    def only_layer(path, g, layer=layer):
      keys = [getattr(k, 'key', getattr(k, 'idx', None)) for k in path]
      if keys[0] != 'blocks' or 'ffn' not in keys:
        return jnp.zeros_like(g)
      if scan:
        return g * (jnp.arange(g.shape[0]) == layer).reshape((-1,) + (1,) * (g.ndim - 1))
      return g if keys[1] == layer else jnp.zeros_like(g)

    direction = jax.tree_util.tree_map_with_path(only_layer, grads)
    size = float(optax.tree.norm(direction))
    # A fourth-order central difference (error O(h^4)) with h = 0.02 along the unit direction:
    # 5e-5 off at most here (a second-order one with h = 0.1 was 3.5% off under model.init
    # 'fan_in': curvature; with h = 0.01, 5% under some XLA thread counts: rounding, CI 2026-11-24).
    h = 2e-2

    unit = jax.tree.map(lambda d: d / size, direction)  # noqa: B023 (runs within this iteration)

    def moved(t):
      return float(loss_moved(t, unit))  # noqa: B023 (runs within this iteration)

    slope = (8 * (moved(h) - moved(-h)) - (moved(2 * h) - moved(-2 * h))) / (12 * h)
    np.testing.assert_allclose(norms[layer], size, rtol=1e-5)
    np.testing.assert_allclose(slope, size, rtol=5e-3)


def test_measures_joined_by_plus_run_each_and_record_both(monkeypatch):
  from experiments import measures

  calls = []
  monkeypatch.setitem(measures.MEASURES, 'decode', lambda c, w: calls.append('d') or {'a': 1})
  monkeypatch.setitem(measures.MEASURES, 'moe_load', lambda c, w: calls.append('m') or {'b': 2})
  assert 'moe_load+decode' in measures.MEASURES and 'moe_load+nothing' not in measures.MEASURES
  assert measures.MEASURES['moe_load+decode'](None, 'w') == {'a': 1, 'b': 2}
  assert calls == ['m', 'd']
  with pytest.raises(KeyError):
    measures.MEASURES['nothing']
