"""Multi-head latent attention (`model.attention.kind='mla'`; DeepSeek-V2, arXiv 2405.04434,
eqs. 9-19): a layer against a float64 NumPy model of the paper's equations (with and without the
query's low-rank path, both RoPE layouts); the cache's size per token, Table 1's (d_c + d_R)·l;
a value head size other than the query's in every implementation, forward and backward, against
the float64 reference; refusals in one line; a run that trains, resumes exactly and generates from
its config alone. The absorbed decoding path equals the expanded forward in test_kv_cache.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import attention_with_grads, relative_error
from conftest import make_config, tiny_config, trains_and_resumes_bitwise
from flax import nnx

import mllm
from mllm import ConfigError
from mllm.layers.kv_cache import init_cache
from mllm.ops.attention import AttentionMask, attend

MLA = dict(model__attention__kind='mla', model__n_kv_heads=4)  # tiny_config's 4 heads


def _rope(x, layout, theta=10000.0):
  """RoPE of x [T, N, R] at positions 0..T−1 in float64 (Su et al. 2021, eq. 34): pairs (x_i,
  x_{i+R/2}) under 'half', (x_{2i}, x_{2i+1}) under 'interleaved'."""
  R = x.shape[-1]
  angles = np.arange(x.shape[0])[:, None, None] * theta ** (-np.arange(0, R, 2) / R)
  cos, sin = np.cos(angles), np.sin(angles)
  if layout == 'half':
    a, b = x[..., : R // 2], x[..., R // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
  a, b = x[..., 0::2], x[..., 1::2]
  return np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)


def _rms(x, gain, eps):
  return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * gain


def mla_reference(x, w, dims, layout, eps):
  """DeepSeek-V2's eqs. 9-19 for one sequence x [T, D] in float64, causal; w: the layer's
  kernels by name (`query` [D or d_c', N, d_h + d_R], `query_down`, `kv_down` [D, d_c + d_R],
  `kv_up` [d_c, N, d_h + d_v], `out` [N, d_v, D]) and norm gains."""
  d_h, d_r, d_c = dims.nope, dims.rope, dims.kv_rank
  if 'query_down' in w:
    q = np.einsum('tr,rnh->tnh', _rms(x @ w['query_down'], w['query_latent_norm'], eps), w['query'])
  else:
    q = np.einsum('td,dnh->tnh', x, w['query'])  # eq. 12 without the query's compression
  latent = x @ w['kv_down']
  c = _rms(latent[:, :d_c], w['kv_norm'], eps)  # eq. 9
  kv = np.einsum('tc,cnh->tnh', c, w['kv_up'])
  k_c, v = kv[..., :d_h], kv[..., d_h:]  # eqs. 10-11
  k_r = _rope(latent[:, None, d_c:], layout)  # eq. 14: one rotated key for all heads
  q = np.concatenate([q[..., :d_h], _rope(q[..., d_h:], layout)], axis=-1)  # eq. 15-16
  k = np.concatenate([k_c, np.broadcast_to(k_r, (*k_c.shape[:2], d_r))], axis=-1)  # eq. 17
  scores = np.einsum('tnh,snh->nts', q, k) / np.sqrt(d_h + d_r)
  T = x.shape[0]
  scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  heads = np.einsum('nts,snh->tnh', p / p.sum(-1, keepdims=True), v)  # eq. 18
  return np.einsum('tnh,nhd->td', heads, w['out'])  # eq. 19


@pytest.mark.parametrize('q_rank,layout', [(None, 'half'), (12, 'interleaved')])
def test_an_mla_layer_matches_the_papers_equations_in_float64(q_rank, layout):
  from mllm.layers.mla import MLADims

  cfg = tiny_config(
    model__n_layers=1,
    model__d_model=32,
    model__attention__mla__q_lora_rank=q_rank,
    model__attention__mla__v_head_dim=6,  # d_v ≠ d_h
    model__position__rope__layout=layout,
    **MLA,
  )
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  layer = model.blocks[0].attention
  dims = MLADims.of(cfg.model)
  assert (dims.nope, dims.rope, dims.value, dims.kv_rank) == (8, 4, 6, 32)  # the defaults
  x = jax.random.normal(jax.random.key(1), (1, 10, 32))
  positions = jnp.arange(10)[None]
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  names = ['query', 'kv_down', 'kv_up', 'out'] + (['query_down'] if q_rank else [])
  w = {n: f64(getattr(layer, n).kernel[...]) for n in names}
  norms = ['kv_norm'] + (['query_latent_norm'] if q_rank else [])
  # Gains away from 1, so a norm applied in the wrong place shows.
  for n in norms:
    gain = 1.0 + 0.5 * np.random.default_rng(len(n)).standard_normal(getattr(layer, n).scale.shape)
    getattr(layer, n).scale[...] = jnp.asarray(gain, jnp.float32)
    w[n] = gain
  got = layer(x, model.position.context(positions, positions), AttentionMask(causal=True))
  want = mla_reference(f64(x[0]), w, dims, layout, cfg.model.norm.eps)
  assert relative_error(got[0], want) < 1e-5


def test_the_cache_keeps_d_c_plus_d_r_numbers_per_token_and_layer():
  """DeepSeek-V2, Table 1: MLA caches (d_c + d_R)·l elements per token, MHA 2·n_h·d_h·l."""
  L, B, S = 2, 3, 16
  mla = tiny_config(model__d_model=32, model__attention__mla__kv_lora_rank=24, **MLA).model
  cache = init_cache(mla, B, S)
  assert cache.k.shape == (L, B, S, 1, 24) and cache.v.shape == (L, B, S, 1, 4)  # d_R = 8 // 2
  assert (cache.k.nbytes + cache.v.nbytes) == (24 + 4) * L * B * S * 4
  mha = init_cache(tiny_config(model__d_model=32, model__n_kv_heads=4).model, B, S)
  assert (mha.k.nbytes + mha.v.nbytes) == 2 * 4 * 8 * L * B * S * 4


@pytest.mark.parametrize('impl', ['xla', 'blockwise', 'pallas', 'pallas_tpu'])
@pytest.mark.parametrize('v_dim', [8, 20])  # smaller than q and k's 12 (MLA), and larger
def test_a_value_head_size_of_its_own_in_every_implementation(impl, v_dim):
  B, T, N, K, H = 2, 128, 4, 1, 12
  keys = jax.random.split(jax.random.key(v_dim), 4)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, T, K, H))
  v = jax.random.normal(keys[2], (B, T, K, v_dim))
  d_out = jax.random.normal(keys[3], (B, T, N, v_dim))
  blocks = {} if impl == 'pallas_tpu' else dict(block_q=32, block_k=32)

  def loss(q, k, v):
    out = attend(q, k, v, mask=AttentionMask(causal=True), scale=0.3, impl=impl, **blocks)
    return jnp.sum(out * d_out), out

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))  # one program
  (_, out), grads = step(q, k, v)
  want, want_grads = attention_with_grads(q, k, v, d_out, scale=0.3, causal=True)
  assert out.shape == (B, T, N, v_dim)
  assert relative_error(out, want) < 1e-5
  for got, ref in zip(grads, want_grads[:3]):
    assert relative_error(got, ref) < 1e-5


@pytest.mark.parametrize(
  'overrides,key',
  [
    ({'pos': 'alibi'}, "model.position.kind='alibi'"),
    ({'model.n_kv_heads': 2}, 'model.n_kv_heads=2'),
    ({'model.attention.qk_norm': True}, 'model.attention.qk_norm=True'),
    ({'model.attention.value_residual': True}, 'model.attention.value_residual=True'),
    ({'model.position.rope.fraction': 0.5}, 'model.position.rope.fraction=0.5'),
    ({'model.attention.mla.rope_head_dim': 3}, 'model.attention.mla.rope_head_dim=3'),
  ],
)
def test_what_mla_cannot_do_is_refused_in_one_line(overrides, key):
  choices = ','.join(f'{k}={v}' for k, v in overrides.items() if '.' not in k)
  dotted = {k.replace('.', '__'): v for k, v in overrides.items() if '.' in k}
  with pytest.raises(ConfigError) as err:
    tiny_config(choices, **{**MLA, **dotted})
  assert str(err.value).startswith(key) and '\n' not in str(err.value)


def test_mla_keys_are_refused_while_mha_is_chosen():
  with pytest.raises(ConfigError) as err:
    tiny_config(model__attention__mla__kv_lora_rank=16)
  assert str(err.value).startswith('model.attention.mla.kv_lora_rank=16: read only by')


def test_an_mla_run_trains_resumes_exactly_and_generates(corpus, tmp_path):
  from mllm.generation import generate_tokens, load_run

  config = make_config(
    corpus,
    str(tmp_path / 'cache'),
    **{'model.attention.kind': 'mla', 'model.n_kv_heads': 4, 'model.attention.mla.q_lora_rank': 16},
  )
  reference = trains_and_resumes_bitwise(config, tmp_path)
  model, _, _, _ = load_run(reference, config)
  prompt, new = [[1, 2, 3, 4, 5]], 6
  out = generate_tokens(model, prompt, max_new_tokens=new)
  # Greedy decoding over the latent cache picks what the full forward's argmax picks. One jitted
  # forward of the final length serves every step (the model is causal: position i reads tokens
  # <= i, so the padding after it changes nothing); called eagerly at each length, the model built
  # ~480 single-operation programs, most of this test's time.
  forward = nnx.jit(lambda model, tokens: model(tokens))
  tokens = list(prompt[0])
  for _ in range(new):
    padded = np.zeros((1, len(prompt[0]) + new), np.int32)
    padded[0, : len(tokens)] = tokens
    tokens.append(int(np.argmax(np.asarray(forward(model, padded))[0, len(tokens) - 1])))
  assert out[0] == tokens[len(prompt[0]) :]
