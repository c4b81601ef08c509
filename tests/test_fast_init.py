"""The layer-by-layer init of unrolled models (mllm/train/state.py `layered_init`) gives, bit for
bit, the state of the whole-model jitted init it replaced, and compiles a number of programs that
does not grow with depth."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import tiny_config

from mllm.train.sharding import make_mesh
from mllm.train.state import _parts, setup

MOE = 'ffn=moe,num_experts=4,top_k=2'
BACKEND_COMPILE = '/jax/core/compile/backend_compile_duration'  # jax/_src/dispatch.py


def whole_model_init(config, shardings):
  """The reference: one jitted program building the whole model and Adam's state (the old init)."""
  return jax.jit(_parts(config).init, out_shardings=shardings)()


CASES = {
  'dense': ('', {}),
  # layers dense, MoE, dense: two layer programs, the dense one used again after the MoE one; the
  # expert bias is saved but not trained (in params, not in Adam's state)
  'moe_mixed': (
    MOE,
    {'model__n_layers': 3, 'model__ffn__moe__every': 2, 'model__ffn__moe__expert_bias': True},
  ),
  # parameters in the stem (a position table) and the tail (an untied head)
  'learned_untied': ('pos=learned', {'model__tie_embeddings': False}),
  'relative_bias': ('pos=t5,norm=layernorm', {}),
}


@pytest.mark.parametrize('case', list(CASES))
def test_layered_init_is_the_whole_model_init_bit_for_bit(case):
  choices, overrides = CASES[case]
  config = tiny_config(choices, seed=3, **overrides)
  train_setup, init = setup(config, make_mesh(config.mesh))
  new, old = init(), whole_model_init(config, train_setup.shardings)
  assert jax.tree.structure(new) == jax.tree.structure(old)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(old)):
    where = jax.tree_util.keystr(path)
    assert a.dtype == b.dtype and a.shape == b.shape, where
    assert a.sharding == b.sharding, where
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
  # not a vacuous match: the layers differ from each other
  blocks = new['params']['blocks']
  assert not np.array_equal(
    blocks[0]['attention']['query']['kernel'][...], blocks[1]['attention']['query']['kernel'][...]
  )


def compiled_programs(fn) -> int:
  """How many XLA programs `fn()` compiles (or loads from the persistent cache)."""
  events = []

  def listen(event, duration, **_):
    if event == BACKEND_COMPILE:
      events.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    jax.block_until_ready(fn())
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  return len(events)


def test_the_number_of_init_programs_does_not_grow_with_depth():
  counts = {}
  for n_layers in (2, 4):
    config = tiny_config(MOE, model__n_layers=n_layers, model__ffn__moe__first_dense_layers=1)
    _, init = setup(config, make_mesh(config.mesh))
    counts[n_layers] = compiled_programs(init)
  # stem, a dense layer, an MoE layer, tail, optimizer state: whatever the depth
  assert counts == {2: 5, 4: 5}
