"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, sec. 2.1.2-2.1.3, eqs. 9-19):
`model.attention.kind='mla'`.

Keys and values come from one low-rank latent per token, which is all the KV cache keeps besides
a small shared rotated key:

    c^KV = RMSNorm(x·W^DKV)                        [d_c]             (eq. 9; the norm: V2's code)
    k^C, v^C = c^KV·W^UK, c^KV·W^UV                [n, d_h], [n, d_v] (eqs. 10-11)
    k^R = RoPE(x·W^KR)                             [d_R], one for all heads (eq. 14)
    q = x·W^Q, or RMSNorm(x·W^DQ)·W^UQ             [n, d_h + d_R]     (eqs. 12-13)
    q^C, q^R = q[:d_h], RoPE(q[d_h:])                                 (eq. 15)
    k = [k^C; k^R], score = q·k / √(d_h + d_R)                       (eqs. 16-18)

Decoupled RoPE: a rotation between W^UK and q would stop W^UK from being absorbed into the query,
so position lives in the d_R extra dims only. Training attends with the expanded k and v (any
implementation; v's head size d_v may differ from q's, mllm/ops/attention.py). Decoding attends
over the cache itself: W^UK absorbed into the query and W^UV applied after, MLA as multi-query
attention with one head of d_c + d_R dims (sec. 2.1.2's "absorbed" inference), so a step reads
(d_c + d_R) numbers per cached token and layer where MHA reads 2·n·d_h (Table 1).

The cache's `k` holds c^KV [1, d_c] and its `v` holds k^R [1, d_R] (mllm/layers/kv_cache.py).
DeepSeek's head sizes map as: qk_nope_head_dim = `model.head_dim` (d_h), qk_rope_head_dim =
`mla.rope_head_dim`, v_head_dim = `mla.v_head_dim`, kv_lora_rank = `mla.kv_lora_rank`,
q_lora_rank = `mla.q_lora_rank`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mllm.checks import ConfigError
from mllm.layers import resolved_head_dim, rotary_head_dim
from mllm.layers.attention import ATTENTIONS, Attention, projection
from mllm.layers.kv_cache import CACHE_DIMS, LayerCache
from mllm.layers.norms import RMSNorm
from mllm.layers.parametrization import weight_std
from mllm.variant_config import at_least, setting, settings_of


def _rotated_pairs(name: str, value) -> None:
  if value < 2 or value % 2:
    raise ConfigError(name, value, 'RoPE rotates pairs of dimensions; allowed: an even number >= 2')


@dataclasses.dataclass(frozen=True)
class MLASettings:
  kv_lora_rank: int | None = setting(
    None,
    "d_c, the latent the cache keeps per token; None: 4·head_dim (DeepSeek-V2's d_c = 4·d_h)",
    at_least(1),
  )
  q_lora_rank: int | None = setting(
    None,
    "d_c', the query's low-rank bottleneck (DeepSeek-V2/V3); None: a full-rank query projection "
    '(DeepSeek-V2-Lite)',
    at_least(1),
  )
  rope_head_dim: int | None = setting(
    None,
    "d_R, the rotated dims of each query head and of the one shared key; None: head_dim // 2 "
    "(DeepSeek-V2's d_R = d_h / 2)",
    _rotated_pairs,
  )
  v_head_dim: int | None = setting(None, "each head's value size d_v; None: head_dim", at_least(1))


@dataclasses.dataclass(frozen=True)
class MLADims:
  """The resolved sizes of a model config's MLA."""

  heads: int
  nope: int  # d_h: the part of q and k without position
  rope: int  # d_R
  value: int  # d_v
  kv_rank: int  # d_c
  q_rank: int | None  # d_c', None: full rank

  @classmethod
  def of(cls, m) -> MLADims:
    s = settings_of(LatentAttention, m.attention)
    h = resolved_head_dim(m)
    return cls(
      heads=m.n_heads,
      nope=h,
      rope=rotary_head_dim(m),
      value=s.v_head_dim or h,
      kv_rank=s.kv_lora_rank or 4 * h,
      q_rank=s.q_lora_rank,
    )


class LatentAttention(Attention):
  """MLA (module docstring). Parameters: `query` (W^Q, or `query_down`, `query_latent_norm`, `query`
  = W^DQ, its norm, W^UQ), `kv_down` ([W^DKV, W^KR], one [d, d_c + d_R] matrix), `kv_norm`,
  `kv_up` ([W^UK, W^UV], [d_c, n, d_h + d_v]), and the base class's `out`, gate and sinks."""

  Settings = MLASettings

  @classmethod
  def check(cls, m, p):
    rules = {
      f'{p}.position.kind': (
        m.position.kind,
        m.position.kind == 'rope',
        "MLA's decoupled RoPE rotates its own dims; allowed: 'rope'",
      ),
      f'{p}.position.rope.fraction': (
        m.position.rope.fraction,
        m.position.rope.fraction == 1.0,
        f'MLA rotates its {p}.attention.mla.rope_head_dim dims; allowed: 1.0',
      ),
      f'{p}.n_kv_heads': (
        m.n_kv_heads,
        m.n_kv_heads == m.n_heads,
        f'MLA expands every head from its latent; allowed: {p}.n_heads={m.n_heads}',
      ),
      f'{p}.attention.qk_norm': (
        m.attention.qk_norm,
        not m.attention.qk_norm,
        "MLA normalizes its latents, not q and k; allowed: False",
      ),
      f'{p}.attention.value_residual': (
        m.attention.value_residual,
        not m.attention.value_residual,
        'MLA has no per-layer values before its latent; allowed: False',
      ),
      f'{p}.attention.use_bias': (
        m.attention.use_bias,
        not m.attention.use_bias,
        "MLA's projections have no biases (DeepSeek); allowed: False",
      ),
      f'{p}.attention.qkv_bias': (
        m.attention.qkv_bias,
        not m.attention.qkv_bias,
        "MLA's projections have no biases (DeepSeek); allowed: False",
      ),
    }
    for key, (value, ok, allowed) in rules.items():
      if not ok:
        raise ConfigError(key, value, f"with {p}.attention.kind='mla': {allowed}")

  @classmethod
  def describe(cls, m):
    dims = MLADims.of(m)
    q = f', q rank {dims.q_rank}' if dims.q_rank else ''
    return f'MLA d_c {dims.kv_rank} + d_R {dims.rope}{q}'

  @classmethod
  def head_dims(cls, m):
    dims = MLADims.of(m)
    return dims.nope + dims.rope, dims.value

  @classmethod
  def cache_dims(cls, m):
    dims = MLADims.of(m)
    return (1, dims.kv_rank), (1, dims.rope)

  def _make_projections(self, cfg, rngs):
    dims = MLADims.of(cfg)
    self.dims = dims
    d, n = cfg.d_model, dims.heads
    qk = dims.nope + dims.rope
    norm_kwargs = dict(eps=cfg.norm.eps, param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)

    def proj(spec, shape, axes, fan_in):
      return projection(cfg, spec, shape, axes, weight_std(cfg, 'in', fan_in=fan_in), rngs=rngs)

    if dims.q_rank is None:
      self.query_down = self.query_latent_norm = None
      self.query = proj('btd,dnh->btnh', (d, n, qk), ('embed', 'heads', 'head_dim'), d)
    else:
      self.query_down = proj('btd,dr->btr', (d, dims.q_rank), ('embed', 'latent'), d)
      self.query_latent_norm = RMSNorm(dims.q_rank, **norm_kwargs)
      self.query = proj(
        'btr,rnh->btnh', (dims.q_rank, n, qk), ('latent', 'heads', 'head_dim'), dims.q_rank
      )
    self.kv_down = proj('btd,dr->btr', (d, dims.kv_rank + dims.rope), ('embed', 'latent'), d)
    self.kv_norm = RMSNorm(dims.kv_rank, **norm_kwargs)
    self.kv_up = proj(
      'btr,rnh->btnh',
      (dims.kv_rank, n, dims.nope + dims.value),
      ('latent', 'heads', 'head_dim'),
      dims.kv_rank,
    )

  def _latents(self, x_BTD, context):
    """(q's position-free part [B, T, N, d_h], its rotated part [B, T, N, d_R], c^KV [B, T, d_c],
    the rotated shared key k^R [B, T, 1, d_R])."""
    dims = self.dims
    if self.query_down is None:
      q_BTNH = self.query(x_BTD)
    else:
      q_BTNH = self.query(self.query_latent_norm(self.query_down(x_BTD)))
    latent_BTR = self.kv_down(x_BTD)
    c_BTC = self.kv_norm(latent_BTR[..., : dims.kv_rank])
    rope_BT1R = context.rotate(latent_BTR[..., None, dims.kv_rank :])
    return q_BTNH[..., : dims.nope], context.rotate(q_BTNH[..., dims.nope :]), c_BTC, rope_BT1R

  def _project(self, x_BTD, context, value_residual=None):
    del value_residual  # validation refuses it with MLA
    q_nope, q_rope, c_BTC, rope_BT1R = self._latents(x_BTD, context)
    kv_BTNH = self.kv_up(c_BTC)
    k_nope, v_BTNH = kv_BTNH[..., : self.dims.nope], kv_BTNH[..., self.dims.nope :]
    k_rope = jnp.broadcast_to(rope_BT1R, (*k_nope.shape[:-1], self.dims.rope))
    q_BTNH = jnp.concatenate([q_nope, q_rope], axis=-1)
    return q_BTNH, jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), v_BTNH

  def _attend_cached(self, x_BTD, context, mask, cache: LayerCache, value_residual=None):
    """Attention over the latent cache with W^UK absorbed into the query (module docstring):
    score = [q^C·W^UKᵀ; q^R]·[c^KV; k^R], output = (P·c^KV)·W^UV."""
    del value_residual
    dims = self.dims
    q_nope, q_rope, c_BTC, rope_BT1R = self._latents(x_BTD, context)
    c_BSC, rope_BS1R, updated = cache.extend(c_BTC[:, :, None, :], rope_BT1R)
    up_CNH = self.kv_up.kernel[...].astype(q_nope.dtype)
    q_latent = jnp.einsum('btnh,cnh->btnc', q_nope, up_CNH[..., : dims.nope])
    q_BTNX = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    k_BS1X = jnp.concatenate([c_BSC, rope_BS1R.astype(c_BSC.dtype)], axis=-1)
    out_BTNC = self._attend(q_BTNX, k_BS1X, c_BSC, context, mask)
    return jnp.einsum('btnc,cnh->btnh', out_BTNC, up_CNH[..., dims.nope :]), updated


ATTENTIONS['mla'] = LatentAttention
CACHE_DIMS['mla'] = LatentAttention.cache_dims
