"""The whole model: every variant combination builds, is finite and causal; equivalences between
paths that must agree (GQA vs MHA weights, scan vs unrolled, packed vs separate documents)."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import mllm
from mllm.layers.ffn import DENSE_FFNS
from mllm.layers.norms import NORMS, PLACEMENTS
from mllm.layers.positions import POSITIONS
from mllm.model import build_model

B, T, V = 2, 8, 32


def _tokens(seed=0, batch=B, length=T):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, V, dtype=jnp.int32)


def _all_pairs(*factors) -> list[tuple]:
  """A pairwise design: every row of the first two factors' product, completed with the levels of
  the others that cover the most pairs not yet covered (greedy), so every pair of levels of any
  two factors is in some row. A bug needs two choices to meet, rarely three; the full product of
  positions x FFNs x norms x placements would compile ~600 models where ~80 cover every pair."""
  covered, rows = set(), []

  def pairs(row):
    return {(i, row[i], j, row[j]) for j in range(len(row)) for i in range(j)}

  for head in itertools.product(*factors[:2]):
    row = max(
      (head + tail for tail in itertools.product(*factors[2:])),
      key=lambda row: len(pairs(row) - covered),
    )
    covered |= pairs(row)
    rows.append(row)
  return rows


FACTORS = (tuple(POSITIONS), tuple(DENSE_FFNS), tuple(NORMS), PLACEMENTS)
COMBINATIONS = _all_pairs(*FACTORS)
# The relative schemes' own keys, small for the tiny model; set only with the scheme that reads
# them (another scheme refuses them).
SMALL_RELATIVE = {'shaw': 'shaw.max_distance=2', 't5': 't5.num_buckets=8,t5.max_distance=16'}


def test_the_combinations_cover_every_pair_of_choices():
  rows = set(COMBINATIONS)
  for (i, a), (j, b) in itertools.combinations(enumerate(FACTORS), 2):
    for level_a, level_b in itertools.product(a, b):
      assert any(row[i] == level_a and row[j] == level_b for row in rows), (level_a, level_b)


@pytest.mark.parametrize('pos,ffn,norm,placement', COMBINATIONS)
def test_every_combination_is_finite_and_causal(pos, ffn, norm, placement):
  cfg = tiny_config(
    f'pos={pos},ffn={ffn},norm={norm},placement={placement},' + SMALL_RELATIVE.get(pos, '')
  )
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  t = 4
  tokens = _tokens()
  changed = tokens.at[:, t].set((tokens[:, t] + 1) % V)
  logits = model(jnp.concatenate([tokens, changed]))
  chex.assert_shape(logits, (2 * B, T, V))
  assert logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  before, after = logits[:B], logits[B:]
  # Changing token t changes no logit before t ...
  np.testing.assert_allclose(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
  # ... and does change the logits at t (so the check above can fail).
  assert np.abs(np.asarray(before[:, t] - after[:, t])).max() > 1e-6


def _copy_kv_to_mha(gqa_model, mha_model, group):
  """Give an MHA model the weights of a GQA model, K/V projections repeated per query group."""
  gqa, mha = nnx.state(gqa_model, nnx.Param), nnx.state(mha_model, nnx.Param)
  flat = dict(nnx.to_flat_state(gqa))
  new = {}
  for path, _ in nnx.to_flat_state(mha):
    value = flat[path][...]
    if len(path) >= 4 and path[2] == 'attention' and path[3] in ('key', 'value'):
      value = jnp.repeat(value, group, axis=1)  # kernel [d, K, h] → [d, K·group, h]
    new[path] = value
  nnx.update(mha_model, nnx.from_flat_state({p: nnx.Param(v) for p, v in new.items()}))


@pytest.mark.parametrize('pos', ['rope', 'alibi', 'shaw'])
def test_gqa_equals_mha_with_repeated_kv_weights(pos):
  choice = f'pos={pos}' + (',shaw.max_distance=3' if pos == 'shaw' else '')
  gqa_cfg = tiny_config(choice, model__n_heads=4, model__n_kv_heads=2)
  mha_cfg = tiny_config(choice, model__n_heads=4, model__n_kv_heads=4)
  gqa = mllm.build_model(gqa_cfg, rngs=nnx.Rngs(0))
  mha = mllm.build_model(mha_cfg, rngs=nnx.Rngs(1))
  _copy_kv_to_mha(gqa, mha, group=2)
  tokens = _tokens(3)
  np.testing.assert_allclose(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_mqa_has_one_kv_head_and_fewer_params():
  mqa = mllm.build_model(tiny_config(model__n_kv_heads=1), rngs=nnx.Rngs(0))
  mha = mllm.build_model(tiny_config(model__n_kv_heads=4), rngs=nnx.Rngs(0))
  chex.assert_shape(mqa.blocks[0].attention.key.kernel[...], (16, 1, 4))
  n_mqa = sum(x.size for x in jax.tree.leaves(nnx.state(mqa, nnx.Param)))
  n_mha = sum(x.size for x in jax.tree.leaves(nnx.state(mha, nnx.Param)))
  # K and V projections shrink from 4 heads to 1: 2 layers · 2 matrices · 16 · 3 · 4.
  assert n_mha - n_mqa == 2 * 2 * 16 * 3 * 4


@pytest.mark.parametrize('pos', ['rope', 't5', 'shaw', 'learned'])
def test_scan_over_layers_equals_unrolled_stack(pos):
  unrolled = mllm.build_model(tiny_config(f'pos={pos}', model__n_layers=3), rngs=nnx.Rngs(0))
  scanned = mllm.build_model(
    tiny_config(f'pos={pos}', model__n_layers=3, model__scan_layers=True), rngs=nnx.Rngs(1)
  )
  flat = dict(nnx.to_flat_state(nnx.state(unrolled, nnx.Param)))
  new = {}
  for path, leaf in nnx.to_flat_state(nnx.state(scanned, nnx.Param)):
    if path[0] == 'blocks':  # stacked [layers, ...] ← blocks.0, blocks.1, blocks.2
      new[path] = jnp.stack([flat[('blocks', i) + path[1:]][...] for i in range(3)])
    else:
      new[path] = flat[path][...]
    chex.assert_shape(new[path], leaf.shape)
  nnx.update(scanned, nnx.from_flat_state({p: nnx.Param(v) for p, v in new.items()}))
  tokens = _tokens(4)
  np.testing.assert_allclose(scanned(tokens), unrolled(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('pos', list(POSITIONS))
def test_packed_documents_equal_separate_runs(pos):
  """With segment ids and per-document positions, a packed row equals each document run alone."""
  model = mllm.build_model(
    tiny_config(f'pos={pos},' + SMALL_RELATIVE.get(pos, '')), rngs=nnx.Rngs(0)
  )
  doc_a, doc_b = _tokens(5, 1, 5), _tokens(6, 1, 3)
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segment_ids = jnp.array([[0] * 5 + [1] * 3])
  positions = jnp.array([list(range(5)) + list(range(3))])
  forward = nnx.jit(lambda model, *args, **kwargs: model(*args, **kwargs))  # 3 programs, not ~150
  logits = forward(model, packed, positions=positions, segment_ids=segment_ids)
  np.testing.assert_allclose(logits[:, :5], forward(model, doc_a), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits[:, 5:], forward(model, doc_b), rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_the_receptive_field():
  """One layer with window W: the logit at i depends on tokens i−W+1 … i only."""
  window = 3
  model = mllm.build_model(tiny_config(f'window={window}', model__n_layers=1), rngs=nnx.Rngs(0))
  tokens = _tokens(7, 1, 8)
  i = 6
  far = tokens.at[:, i - window].set((tokens[:, i - window] + 1) % V)  # just outside the window
  near = tokens.at[:, i - window + 1].set((tokens[:, i - window + 1] + 1) % V)  # just inside
  base = model(tokens)
  np.testing.assert_allclose(model(far)[:, i], base[:, i], rtol=0, atol=1e-6)
  assert np.abs(np.asarray(model(near)[:, i] - base[:, i])).max() > 1e-6


def test_explicit_offset_positions_match_relative_schemes():
  """Shifting all positions by a constant changes nothing for purely relative schemes."""
  for pos in ('rope', 'alibi', 't5', 'shaw', 'none'):
    model = mllm.build_model(
      tiny_config(f'pos={pos},' + SMALL_RELATIVE.get(pos, '')), rngs=nnx.Rngs(0)
    )
    tokens = _tokens(8)
    shifted = jnp.broadcast_to(jnp.arange(T) + 5, (B, T))
    np.testing.assert_allclose(
      model(tokens, positions=shifted), model(tokens), rtol=1e-4, atol=1e-4, err_msg=pos
    )


def test_bfloat16_compute_keeps_float32_params_and_logits():
  cfg32 = tiny_config()
  cfg16 = tiny_config(model__dtype='bfloat16')
  m32 = mllm.build_model(cfg32, rngs=nnx.Rngs(0))
  m16 = mllm.build_model(cfg16, rngs=nnx.Rngs(0))
  for leaf in jax.tree.leaves(nnx.state(m16, nnx.Param)):
    assert leaf.dtype == jnp.float32
  tokens = _tokens(9)
  out16 = m16(tokens)
  assert out16.dtype == jnp.float32
  np.testing.assert_allclose(out16, m32(tokens), atol=0.05)


def test_dropout_is_active_in_train_mode_only():
  cfg = tiny_config(model__dropout=0.3, model__embed_dropout=0.3, model__attention__dropout=0.3)
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  reference = mllm.build_model(tiny_config(), rngs=nnx.Rngs(0))
  tokens = _tokens(10)
  assert not np.allclose(model(tokens), model(tokens))  # fresh masks each call
  model.eval()
  np.testing.assert_allclose(model(tokens), model(tokens))
  np.testing.assert_allclose(model(tokens), reference(tokens), rtol=1e-6, atol=1e-6)


def _param_paths(cfg):
  model = nnx.eval_shape(lambda: mllm.build_model(cfg, rngs=nnx.Rngs(0)))
  return {path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize(
  'toggle',
  [
    'placement=post',
    'placement=output',
    'model.dtype=bfloat16',
    'model.dropout=0.1',
    'window=4',
    'model.position.rope.layout=interleaved',
    'rope_scaling=yarn,yarn.factor=2.0',
    'pos=alibi',
    'pos=none',
    'pos=sinusoidal',
    'ffn=geglu',
    'ffn=reglu',
    'model.attention.softmax_scale=0.5',
    'model.init=fixed,model.init_std=0.1',
    'model.init=fan_in',
    'model.init=small_init',
  ],
)
def test_parameter_names_do_not_change_with_math_free_toggles(toggle):
  """Toggles that add no parameters keep the parameter tree (checkpoints stay loadable)."""
  assert _param_paths(tiny_config(toggle)) == _param_paths(tiny_config())


def test_parameter_tree_is_readable():
  paths = {'.'.join(map(str, p)) for p in _param_paths(tiny_config('ffn=swiglu'))}
  for expected in (
    'embed.embedding',
    'blocks.0.attention.query.kernel',
    'blocks.0.attention.key.kernel',
    'blocks.0.attention.out.kernel',
    'blocks.0.attention_norm.scale',
    'blocks.0.ffn.gate.kernel',
    'blocks.0.ffn.up.kernel',
    'blocks.0.ffn.down.kernel',
    'final_norm.scale',
  ):
    assert expected in paths, expected
  untied = {'.'.join(map(str, p)) for p in _param_paths(tiny_config(model__tie_embeddings=False))}
  assert 'head.kernel' in untied and 'head.kernel' not in paths


def test_logical_axis_names_on_every_parameter():
  model = mllm.build_model(
    tiny_config(
      'pos=t5,norm=layernorm,ffn=gelu', model__attention__use_bias=True, model__ffn__use_bias=True
    ),
    rngs=nnx.Rngs(0),
  )
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    axes = var.get_metadata().get('logical_axes')
    assert axes is not None and len(axes) == var[...].ndim, (path, axes)


def test_depth_scaled_init():
  cfg = tiny_config(model__n_layers=8, model__d_model=64, model__init='fixed', model__init_std=0.02)
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  out_std = float(np.std(np.asarray(model.blocks[0].ffn.down.kernel[...])))
  in_std = float(np.std(np.asarray(model.blocks[0].ffn.up.kernel[...])))
  assert abs(in_std - 0.02) < 0.002
  assert abs(out_std - 0.02 / 4.0) < 0.001  # 0.02 / sqrt(2 · 8)


def test_jit_matches_eager():
  model = mllm.build_model(tiny_config('pos=alibi'), rngs=nnx.Rngs(0))
  tokens = _tokens(11)
  graphdef, state = nnx.split(model)
  jitted = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  np.testing.assert_allclose(jitted(state, tokens), model(tokens), rtol=1e-5, atol=1e-5)


def test_learned_positions_refuse_sequences_longer_than_the_table():
  model = mllm.build_model(
    tiny_config('pos=learned', model__max_seq_len=8, data__seq_len=8), rngs=nnx.Rngs(0)
  )
  with pytest.raises(ValueError, match='max_seq_len=8'):
    model(_tokens(0, 1, 9))


def test_embed_scale_multiplies_the_token_vectors_before_the_positions():
  """embed_scale = s gives the logits of a model whose embedding table is s times larger
  (untied head, so that only the input side changes), with sinusoids added after scaling."""
  import math

  over = {
    'model.d_model': 32,
    'model.n_layers': 1,
    'model.n_heads': 2,
    'model.n_kv_heads': 2,
    'model.vocab_size': 64,
    'model.max_seq_len': 16,
    'model.tie_embeddings': False,
  }
  scale = math.sqrt(32)
  scaled = build_model(
    mllm.load_config('configs/base.py:pos=sinusoidal', {**over, 'model.embed_scale': scale}),
    rngs=nnx.Rngs(0),
  )
  plain = build_model(mllm.load_config('configs/base.py:pos=sinusoidal', over), rngs=nnx.Rngs(0))
  plain.embed.embedding[...] = plain.embed.embedding[...] * scale
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)))
  np.testing.assert_allclose(scaled(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
  unscaled = build_model(mllm.load_config('configs/base.py:pos=sinusoidal', over), rngs=nnx.Rngs(0))
  assert not np.allclose(scaled(tokens), unscaled(tokens), atol=1e-3)
