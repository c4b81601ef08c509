"""Causal self-attention with MHA / GQA / MQA heads, optional QK-norm, logit soft-capping, sliding
windows (per layer: `layer_windows`), sinks, a value residual, an output gate and dropout.

The value residual (`model.attention.value_residual`; ResFormer, Zhou et al. 2024, arXiv
2410.17897, eq. 5, with modded-nanogpt's learned weights): every layer after the first attends
with the values λ₁·V_n + λ₂·V_1, V_1 the first layer's values of the same tokens, (λ₁, λ₂) per
layer learned from (0.5, 0.5) (mllm/model.py's `ValueMix`, one [n_layers − 1, 2] table beside the
blocks).

Attention sinks (`model.attention.sinks`; gpt-oss, OpenAI 2025, after StreamingLLM's sink token,
Xiao et al. 2024): a learned logit per head joins the softmax's normalizer and carries no value,
so a head can attend to nothing (mllm/ops/attention.py).

The output gate (`model.attention.output_gate`; Qiu et al. 2025, "Gated Attention for LLMs",
arXiv 2505.06708, its best position G1): each head's attention output times σ(x·W_gate), computed
from the layer's input x, before the output projection: one scalar per head ('headwise') or one
per head dimension ('elementwise', Qwen3-Next's).

The projections carry logical axis names; the score computation is `mllm.ops.attention.attend`, whose
implementation (`model.attention.impl`) is a registry entry. Positional schemes reach in only
through the `PositionContext` (rotations, shared biases) and an optional per-layer part (Shaw).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.layers import initializers, resolved_head_dim
from mllm.layers.kv_cache import CACHE_DIMS, LayerCache
from mllm.layers.norms import RMSNorm
from mllm.layers.parametrization import attention_scale, weight_std
from mllm.layers.positions import POSITIONS, PositionContext, rotating_layers
from mllm.ops.attention import AttentionMask, attend
from mllm.ops.xla_attention import max_logit

OUTPUT_GATES = ('headwise', 'elementwise')  # `model.attention.output_gate` (None: no gate)
QK_NORM_OVER = ('head', 'projection')  # `model.attention.qk_norm_over`


def layer_windows(cfg) -> tuple[int | None, ...]:
  """Per layer, its sliding window (None: full causal attention): `attention.sliding_window`,
  except every `attention.global_every`-th layer (i + 1 divisible by it), which attends globally
  (Gemma 2: 2, Gemma 3: 6)."""
  window, every = cfg.attention.sliding_window, cfg.attention.global_every
  return tuple(
    None if every is not None and (i + 1) % every == 0 else window for i in range(cfg.n_layers)
  )


def layer_patterns(cfg) -> dict[str, int | None]:
  """The per-layer patterns' periods by their key (None: no such pattern): every
  `attention.global_every`-th layer global, every `position.rope.nope_every`-th without RoPE
  (read only where the scheme is RoPE)."""
  rope = cfg.position.kind == 'rope'
  return {
    'attention.global_every': cfg.attention.global_every,
    'position.rope.nope_every': cfg.position.rope.nope_every if rope else None,
  }


def pattern_period(cfg) -> int:
  """The layers after which the per-layer patterns repeat: the least common multiple of their
  periods (`layer_patterns`; 1 without any)."""
  return math.lcm(*(n or 1 for n in layer_patterns(cfg).values()))


def layer_period(cfg) -> tuple[tuple[int | None, bool], ...]:
  """One period of the per-layer patterns (`pattern_period`) as (window, whether it rotates) of
  its layers. Scanned layers repeat it (validation: n_layers a multiple of it)."""
  windows, rotates = layer_windows(cfg), rotating_layers(cfg)
  return tuple((windows[p], rotates[p]) for p in range(min(pattern_period(cfg), cfg.n_layers)))


def projection(cfg, spec, kernel_shape, axes, std, *, rngs, bias_shape=None) -> nnx.Einsum:
  """A projection `spec` with kernel N(0, std²) and its logical axes; a zero bias of
  `bias_shape` (its axes the kernel's last ones) where given."""
  return nnx.Einsum(
    spec,
    kernel_shape,
    bias_shape,
    dtype=jnp.dtype(cfg.dtype),
    param_dtype=jnp.dtype(cfg.param_dtype),
    kernel_init=initializers.normal(std),
    rngs=rngs,
    kernel_metadata={'logical_axes': axes},
    bias_metadata={'logical_axes': axes[-len(bias_shape) :] if bias_shape else ()},
  )


class Attention(nnx.Module):
  """Multi-head attention with n_kv_heads key/value heads (Shazeer 2019; Ainslie et al. 2023):
  n_kv_heads = n_heads is MHA, 1 is MQA, anything between is GQA. `model.attention.kind='mha'`;
  a subclass that projects q, k and v its own way (MLA: mllm/layers/mla.py) keeps the rest:
  the scores, sinks, the gate, the output projection, the cache's use."""

  @classmethod
  def check(cls, m, p: str) -> None:
    """Raise ConfigError if the model config (m, at prefix p) asks what this kind cannot do."""

  @classmethod
  def describe(cls, m) -> str:
    """Its heads, for the summary's layer table."""
    if m.n_kv_heads == m.n_heads:
      return f'MHA {m.n_heads} heads'
    return f'MQA {m.n_heads}q:1kv' if m.n_kv_heads == 1 else f'GQA {m.n_heads}q:{m.n_kv_heads}kv'

  @classmethod
  def head_dims(cls, m) -> tuple[int, int]:
    """(the query/key head dim, the value head dim) of the model config m."""
    h = resolved_head_dim(m)
    return h, h

  @classmethod
  def cache_dims(cls, m) -> tuple[tuple[int, int], tuple[int, int]]:
    """What the KV cache keeps per token and layer: the (heads, dims) of its `k` and its `v`."""
    return (m.n_kv_heads, resolved_head_dim(m)), (m.n_kv_heads, resolved_head_dim(m))

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    acfg = cfg.attention
    d, n = cfg.d_model, cfg.n_heads
    qk_dim, v_dim = self.head_dims(cfg)
    self._make_projections(cfg, rngs)
    out_std = weight_std(cfg, 'out', fan_in=n * v_dim)
    self.out = projection(
      cfg,
      'btnh,nhd->btd',
      (n, v_dim, d),
      ('heads', 'head_dim', 'embed'),
      out_std,
      rngs=rngs,
      bias_shape=(d,) if acfg.use_bias else None,
    )
    # The output gate's W: [d, n] headwise, [d, n, h] elementwise.
    in_std = weight_std(cfg, 'in', fan_in=d)
    headwise = acfg.output_gate == 'headwise'
    self.gate = (
      projection(
        cfg,
        'btd,dn->btn' if headwise else 'btd,dnh->btnh',
        (d, n) if headwise else (d, n, v_dim),
        ('embed', 'heads') + (() if headwise else ('head_dim',)),
        in_std,
        rngs=rngs,
      )
      if acfg.output_gate is not None
      else None
    )
    # A sink logit per query head (gpt-oss), from 0: one extra key of score 0 that has no value.
    self.sinks = (
      nnx.Param(jnp.zeros((n,), jnp.dtype(cfg.param_dtype)), logical_axes=('heads',))
      if acfg.sinks
      else None
    )
    self.relative = POSITIONS[cfg.position.kind].layer_part(cfg, rngs=rngs)
    self.dropout = nnx.Dropout(acfg.dropout, rngs=rngs)
    self.impl = acfg.impl
    self.block_q, self.block_k = acfg.block_q, acfg.block_k
    self.scale = (
      acfg.softmax_scale if acfg.softmax_scale is not None else attention_scale(cfg, qk_dim)
    )
    self.logit_softcap = acfg.logit_softcap

  def _make_projections(self, cfg, rngs: nnx.Rngs) -> None:
    """q, k, v (biases: `use_bias`, or Qwen2's `qkv_bias`) and QK-norm."""
    acfg = cfg.attention
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, resolved_head_dim(cfg)
    std = weight_std(cfg, 'in', fan_in=d)
    biased = acfg.use_bias or acfg.qkv_bias

    def into_heads(heads, axis):
      return projection(
        cfg,
        'btd,dnh->btnh',
        (d, heads, h),
        ('embed', axis, 'head_dim'),
        std,
        rngs=rngs,
        bias_shape=(heads, h) if biased else None,
      )

    self.query = into_heads(n, 'heads')
    self.key = into_heads(k, 'kv_heads')
    self.value = into_heads(k, 'kv_heads')
    # QK-norm, before the rotation: RMSNorm over each head's q and k (Qwen3), or over the whole
    # q and k projections, all heads at once (OLMo 2: qk_norm_over='projection').
    norm_kwargs = dict(eps=cfg.norm.eps, param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
    self.qk_norm_over = acfg.qk_norm_over
    whole = acfg.qk_norm_over == 'projection'
    self.query_norm = RMSNorm(n * h if whole else h, **norm_kwargs) if acfg.qk_norm else None
    self.key_norm = RMSNorm(k * h if whole else h, **norm_kwargs) if acfg.qk_norm else None

  def _project(self, x_BTD, context: PositionContext, value_residual=None):
    """q, k, v of the tokens: projected, QK-normed, rotated; with `value_residual` = (V_1, mix),
    v is λ₁·v + λ₂·V_1 for mix = (λ₁, λ₂), or V_1 itself for mix None (the first layer, whose
    values the model projected already)."""
    q_BTNH, k_BTKH = self.query(x_BTD), self.key(x_BTD)
    if value_residual is None:
      v_BTKH = self.value(x_BTD)
    else:
      first_BTKH, mix = value_residual
      v_BTKH = first_BTKH
      if mix is not None:
        v_BTKH = self.value(x_BTD)
        mix = mix.astype(v_BTKH.dtype)
        v_BTKH = mix[0] * v_BTKH + mix[1] * first_BTKH.astype(v_BTKH.dtype)
    if self.query_norm is not None and self.qk_norm_over == 'projection':
      q_BTNH = self.query_norm(q_BTNH.reshape(*q_BTNH.shape[:2], -1)).reshape(q_BTNH.shape)
      k_BTKH = self.key_norm(k_BTKH.reshape(*k_BTKH.shape[:2], -1)).reshape(k_BTKH.shape)
    elif self.query_norm is not None:
      q_BTNH, k_BTKH = self.query_norm(q_BTNH), self.key_norm(k_BTKH)
    return context.rotate(q_BTNH), context.rotate(k_BTKH), v_BTKH

  def __call__(
    self,
    x_BTD: jax.Array,
    context: PositionContext,
    mask: AttentionMask,
    cache: LayerCache | None = None,
    value_residual: tuple[jax.Array, jax.Array | None] | None = None,
    probe: bool = False,
  ):
    """The attention output [B, T, D]; with a `cache`, (output, the layer's updated (k, v)); with
    `probe` (no cache), (output, the largest allowed attention logit: `xla_attention.max_logit`,
    from this call's own q and k). value_residual: (the first layer's values [B, T, K, H], this
    layer's (λ₁, λ₂), or None in the first layer itself)."""
    if cache is not None:
      out_BTNH, updated = self._attend_cached(x_BTD, context, mask, cache, value_residual)
      return self._decode_output(self._gated(x_BTD, out_BTNH)), updated
    q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, context, value_residual)
    out_BTD = self.out(self._gated(x_BTD, self._attend(q_BTNH, k_BTKH, v_BTKH, context, mask)))
    if not probe:
      return out_BTD
    return out_BTD, max_logit(q_BTNH, k_BTKH, mask, self.scale)

  def _attend_cached(self, x_BTD, context, mask, cache: LayerCache, value_residual=None):
    """(the heads' outputs [B, T, N, H] over [past ; new] keys, ordered by position
    (mask.kv_positions), the layer's updated cache (k, v))."""
    q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, context, value_residual)
    k_BSKH, v_BSKH, updated = cache.extend(k_BTKH, v_BTKH)
    return self._attend(q_BTNH, k_BSKH, v_BSKH, context, mask), updated

  def _attend(self, q_BTNH, k_BSKH, v_BSKH, context: PositionContext, mask: AttentionMask):
    """softmax(q·kᵀ·scale + biases)·v by the configured implementation (mllm/ops/attention.py)."""
    bias, rel_values = context.bias, None
    if self.relative is not None:
      bias, rel_values = self.relative(q_BTNH, context, self.scale)
    dropout_rng = None
    if self.dropout.rate > 0 and not self.dropout.deterministic:
      dropout_rng = self.dropout.rngs()
    return attend(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      mask=mask,
      bias=bias,
      rel_values=rel_values,
      scale=self.scale,
      softcap=self.logit_softcap,
      sinks=None if self.sinks is None else self.sinks[...],
      impl=self.impl,
      dropout_rate=self.dropout.rate,
      dropout_rng=dropout_rng,
      block_q=self.block_q,
      block_k=self.block_k,
    )

  def _gated(self, x_BTD, out_BTNH):
    """The heads' outputs times the output gate σ(x·W_gate), where there is one."""
    if self.gate is None:
      return out_BTNH
    gate = jax.nn.sigmoid(self.gate(x_BTD))
    return out_BTNH * (gate[..., None] if gate.ndim == 3 else gate).astype(out_BTNH.dtype)

  def _decode_output(self, out_BTNH):
    """The output projection as one [N·H, D] matmul on a bitcast of the kernel. Through the
    einsum, XLA:CPU picks the attention output's layout and then transposes the [N, H, D] kernel
    to match at every decode step (10% of a 32M model's decode step)."""
    B, T, N, H = out_BTNH.shape
    kernel = self.out.kernel[...].reshape(N * H, -1)
    out_BTD = out_BTNH.reshape(B, T, N * H) @ kernel.astype(out_BTNH.dtype)
    if self.out.bias is not None:
      out_BTD = out_BTD + self.out.bias[...].astype(out_BTD.dtype)
    return out_BTD


# `model.attention.kind` → its class; 'mla' registers itself (mllm/layers/mla.py).
ATTENTIONS: dict[str, type[Attention]] = {'mha': Attention}
CACHE_DIMS['mha'] = Attention.cache_dims
