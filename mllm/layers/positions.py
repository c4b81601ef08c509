"""Every positional scheme (`model.position.kind`): none, learned, sinusoidal, shaw, t5, rope, alibi.

A scheme may act at four points, each optional:
  1. add to the token embedding           `PositionScheme.embed`              learned, sinusoidal
  2. rotate queries and keys              `PositionContext.rotate`            rope (+ PI/NTK/YaRN/llama3)
  3. add a bias to the attention scores   `PositionContext.bias`              alibi, t5
                                          `layer_part()(...)` per layer       shaw (key term)
  4. add a term to the attention output   `layer_part()(...)` per layer       shaw (value term)
The model owns one `PositionScheme`; once per forward pass it turns the explicit token positions
into a `PositionContext` (rotation angles, shared biases) that every layer reads. Shaw's relative
embeddings are per layer, so that scheme also gives each attention layer a small module of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from mllm.layers import resolved_head_dim
from mllm.layers.init import weight_std
from mllm.ops.attention import RelativeValues, ScoreBias

# ---------------------------------------------------------------------------------------------
# RoPE (Su et al. 2021) and its context-extension scalings.
# ---------------------------------------------------------------------------------------------

ROPE_LAYOUTS = ('half', 'interleaved')
ROPE_SCALINGS = ('none', 'linear', 'ntk', 'yarn', 'llama3')


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How RoPE's frequencies are changed to reach a context `factor` times the trained one.

  linear: Position Interpolation (Chen et al. 2023): positions / factor.
  ntk:    NTK-aware base change (bloc97 2023): θ' = θ·factor^(d/(d−2)).
  yarn:   YaRN (Peng et al. 2023, eqs. 17-20): per-frequency ramp between interpolation and
          extrapolation (beta_fast = β, beta_slow = α) and attention temperature 0.1·ln(s) + 1.
  llama3: Llama 3.1's wavelength-banded interpolation (low/high_freq_factor, original_max_len).
  """

  kind: str = 'none'
  factor: float = 1.0
  original_max_len: int = 2048
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0

  @classmethod
  def of(cls, scaling: RopeScaling | Mapping[str, Any] | str | None) -> RopeScaling:
    if scaling is None:
      return cls()
    if isinstance(scaling, RopeScaling):
      return scaling
    if isinstance(scaling, str):
      return cls(kind=scaling)
    return cls(**dict(scaling))


def rope_inverse_frequencies(
  head_dim: int, theta: float = 10000.0, scaling: RopeScaling | Mapping | str | None = None
) -> tuple[np.ndarray, float]:
  """θ_i = base^(−2(i−1)/d), i = 1..d/2, after `scaling`; and the factor that multiplies cos and sin
  (YaRN's temperature, 1 otherwise). Computed in float64 NumPy: these are static."""
  s = RopeScaling.of(scaling)
  exponents = np.arange(0, head_dim, 2, dtype=np.float64)[: head_dim // 2] / head_dim
  if s.kind == 'ntk':
    theta = theta * s.factor ** (head_dim / (head_dim - 2))
  inv_freq = 1.0 / theta**exponents
  attention_factor = 1.0
  if s.kind == 'linear':
    inv_freq = inv_freq / s.factor
  elif s.kind == 'yarn':

    def correction_dim(n_rotations):  # the dimension whose wavelength fits n_rotations in L_orig
      return (
        head_dim
        * math.log(s.original_max_len / (n_rotations * 2 * math.pi))
        / (2 * math.log(theta))
      )

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), head_dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1: keep the original frequency; 0: interpolate it by the factor
    inv_freq = inv_freq / s.factor * (1.0 - extrapolate) + inv_freq * extrapolate
    attention_factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
  elif s.kind == 'llama3':
    low_freq_wavelen = s.original_max_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor
    )
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    inv_freq = np.where(medium, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)
  elif s.kind not in ('none', 'ntk'):
    raise ValueError(f"rope scaling={s.kind!r}; allowed: {', '.join(ROPE_SCALINGS)}")
  return inv_freq, attention_factor


def rope_angles(
  positions: jax.Array,
  head_dim: int,
  theta: float = 10000.0,
  scaling: RopeScaling | Mapping | str | None = None,
) -> tuple[jax.Array, jax.Array]:
  """cos and sin of m·θ_i for positions [..., T] → two arrays [..., T, head_dim // 2]."""
  inv_freq, attention_factor = rope_inverse_frequencies(head_dim, theta, scaling)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def rotate(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array, layout: str) -> jax.Array:
  """Apply the rotation R_{Θ,m} (Su et al. 2021, eq. 34) with precomputed angles.

  'interleaved' rotates pairs (x1, x2), (x3, x4), ... (the paper, Meta's and Mistral's code);
  'half' rotates (x_i, x_{i+d/2}) (GPT-NeoX, HF Llama/Qwen). They differ by a fixed permutation of
  the head dimension, which is why checkpoints of one do not load into the other.
  """
  cos = cos_BTh[..., None, :]  # broadcast over heads
  sin = sin_BTh[..., None, :]
  x = x_BTNH.astype(jnp.float32)
  if layout == 'half':
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  elif layout == 'interleaved':
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
  else:
    raise ValueError(f"rope layout={layout!r}; allowed: {', '.join(ROPE_LAYOUTS)}")
  return out.astype(x_BTNH.dtype)


def apply_rope(
  x: jax.Array,
  positions: jax.Array,
  *,
  theta: float = 10000.0,
  layout: str = 'half',
  scaling: RopeScaling | Mapping | str | None = None,
) -> jax.Array:
  """Rotary position embedding of x [B, T, heads, head_dim] at positions [B, T] (or [T])."""
  if x.shape[-1] % 2:
    raise ValueError(f'RoPE needs an even head_dim, got {x.shape[-1]}')
  cos, sin = rope_angles(jnp.asarray(positions), x.shape[-1], theta, scaling)
  return rotate(x, cos, sin, layout)


def rope_frequencies_2d(
  head_dim: int, height: int, width: int, theta: float = 10000.0
) -> jax.Array:
  """2-D RoPE for an image grid (Pixtral, from the Mistral notes): angles [height, width, head_dim//2].

  Of the d/2 base frequencies, the even-indexed ones rotate with the row and the odd-indexed ones
  with the column; the two halves are concatenated.
  """
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  rows = np.outer(np.arange(height), freqs[0::2])  # [height, ·]
  cols = np.outer(np.arange(width), freqs[1::2])  # [width, ·]
  angles = np.concatenate(
    [np.repeat(rows[:, None, :], width, axis=1), np.repeat(cols[None, :, :], height, axis=0)],
    axis=-1,
  )
  return jnp.asarray(angles, jnp.float32)


# ---------------------------------------------------------------------------------------------
# ALiBi (Press et al. 2022), T5 buckets (Raffel et al. 2020), Shaw et al. (2018), sinusoids.
# ---------------------------------------------------------------------------------------------


def alibi_slopes(n_heads: int) -> np.ndarray:
  """m_h = 2^(−8h/H), h = 1..H (8 heads: 1/2 … 1/256). For H not a power of two the paper takes the
  slopes of the power of two below it and fills from every other slope of twice that count."""

  def power_of_two(n):
    return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

  if math.log2(n_heads).is_integer():
    return np.asarray(power_of_two(n_heads))
  below = 2 ** math.floor(math.log2(n_heads))
  return np.asarray(power_of_two(below) + list(alibi_slopes(2 * below)[0::2][: n_heads - below]))


def sinusoidal_embedding(positions: jax.Array, dim: int) -> jax.Array:
  """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(·) (Vaswani et al. 2017, sec. 3.5)."""
  inv_freq = jnp.asarray(1.0 / 10000.0 ** (np.arange(0, dim, 2) / dim), jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, dim)


def t5_relative_bucket(
  relative_position: jax.Array,
  *,
  bidirectional: bool = False,
  num_buckets: int = 32,
  max_distance: int = 128,
) -> jax.Array:
  """T5's bucket of relative_position = pos_key − pos_query (Raffel et al. 2020, sec. 2.1).

  Half the buckets hold exact distances 0 … n/2 − 1; the rest grow logarithmically up to
  max_distance, beyond which all distances share the last bucket. Causal models use one direction.
  """
  buckets = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (relative_position > 0).astype(relative_position.dtype) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  safe = jnp.maximum(distance, 1).astype(jnp.float32)  # log(0) is masked by is_small anyway
  large = max_exact + (
    jnp.log(safe / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  ).astype(relative_position.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(is_small, distance, large)


def shaw_relative_index(q_positions, kv_positions, max_distance: int) -> jax.Array:
  """clip(pos_k − pos_q, −k, k) + k ∈ [0, 2k]  (Shaw et al. 2018, eqs. 5-6): [B, T, S] int32."""
  rel = kv_positions[:, None, :] - q_positions[:, :, None]
  return (jnp.clip(rel, -max_distance, max_distance) + max_distance).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# The scheme objects the model uses.
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class PositionContext:
  """What every layer reads from the positional scheme in one forward pass."""

  cos: jax.Array | None = None  # [B, T, head_dim // 2], for the tokens of this pass
  sin: jax.Array | None = None
  layout: str = struct.field(pytree_node=False, default='half')
  bias: ScoreBias | None = None  # shared by all layers (ALiBi, T5)
  relative_index: jax.Array | None = None  # [B, T, S] (Shaw)

  def rotate(self, x_BTNH: jax.Array) -> jax.Array:
    if self.cos is None:
      return x_BTNH
    return rotate(x_BTNH, self.cos, self.sin, self.layout)


class PositionScheme(nnx.Module):
  """Base scheme: acts nowhere (NoPE). Subclasses override what they need."""

  max_positions: int | None = None  # size of a learned table of absolute positions, if any

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    del cfg, rngs

  def embed(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    return x_BTD

  def context(self, q_positions_BT: jax.Array, kv_positions_BS: jax.Array) -> PositionContext:
    return PositionContext()

  @staticmethod
  def layer_part(cfg, *, rngs: nnx.Rngs) -> nnx.Module | None:
    """A per-layer module, called as `part(q, context, scale) -> (ScoreBias, RelativeValues)`."""
    return None


class NoPositions(PositionScheme):
  """NoPE: the causal mask alone carries order (Haviv et al. 2022; Kazemnejad et al. 2023)."""


class LearnedPositions(PositionScheme):
  """A learned vector per absolute position, added to the token embedding (GPT-2)."""

  def __init__(self, cfg, *, rngs):
    init = nnx.initializers.normal(weight_std(cfg, 'table'))
    self.max_positions = cfg.max_seq_len
    self.table = nnx.Param(
      init(rngs.params(), (cfg.max_seq_len, cfg.d_model), cfg.param_dtype),
      logical_axes=('positions', 'embed'),
    )

  def embed(self, x_BTD, positions_BT):
    return x_BTD + jnp.take(self.table[...], positions_BT, axis=0).astype(x_BTD.dtype)


class SinusoidalPositions(PositionScheme):
  """Fixed sinusoids added to the token embedding (Vaswani et al. 2017, sec. 3.5)."""

  def embed(self, x_BTD, positions_BT):
    return x_BTD + sinusoidal_embedding(positions_BT, x_BTD.shape[-1]).astype(x_BTD.dtype)


class RotaryPositions(PositionScheme):
  """RoPE: q and k rotated by angles m·θ_i, so q_m·k_n depends on m − n only (Su et al. 2021)."""

  def __init__(self, cfg, *, rngs):
    del rngs
    pos = cfg.position
    self.head_dim = resolved_head_dim(cfg)
    self.theta = pos.rope_theta
    self.layout = pos.rope_layout
    self.scaling = RopeScaling(
      kind=pos.rope_scaling,
      factor=pos.rope_scaling_factor,
      original_max_len=pos.rope_original_max_len or cfg.max_seq_len,
      beta_fast=pos.yarn_beta_fast,
      beta_slow=pos.yarn_beta_slow,
      low_freq_factor=pos.llama3_low_freq_factor,
      high_freq_factor=pos.llama3_high_freq_factor,
    )

  def context(self, q_positions_BT, kv_positions_BS):
    cos, sin = rope_angles(q_positions_BT, self.head_dim, self.theta, self.scaling)
    return PositionContext(cos=cos, sin=sin, layout=self.layout)


class ALiBiPositions(PositionScheme):
  """ALiBi: score += m_h·(pos_k − pos_q), a fixed per-head slope (Press et al. 2022)."""

  def __init__(self, cfg, *, rngs):
    del rngs
    self.n_heads = cfg.n_heads

  def context(self, q_positions_BT, kv_positions_BS):
    slopes = jnp.asarray(alibi_slopes(self.n_heads), jnp.float32)
    return PositionContext(
      bias=ScoreBias(alibi_slopes=slopes, q_positions=q_positions_BT, kv_positions=kv_positions_BS)
    )


class T5Positions(PositionScheme):
  """T5 bias: one learned scalar per head per log-spaced distance bucket, shared by all layers."""

  def __init__(self, cfg, *, rngs):
    self.num_buckets = cfg.position.t5_num_buckets
    self.max_distance = cfg.position.t5_max_distance
    # HF T5's initialization under every model.init: a bias per head, not a projection.
    init = nnx.initializers.normal(cfg.d_model**-0.5)
    self.table = nnx.Param(
      init(rngs.params(), (self.num_buckets, cfg.n_heads), cfg.param_dtype),
      logical_axes=('relpos_buckets', 'heads'),
    )

  def context(self, q_positions_BT, kv_positions_BS):
    rel_BTS = kv_positions_BS[:, None, :] - q_positions_BT[:, :, None]
    bucket_BTS = t5_relative_bucket(
      rel_BTS, num_buckets=self.num_buckets, max_distance=self.max_distance
    )
    bias_BTSN = jnp.take(self.table[...], bucket_BTS, axis=0)
    return PositionContext(bias=ScoreBias(dense=jnp.transpose(bias_BTSN, (0, 3, 1, 2))))


class ShawTables(nnx.Module):
  """One layer's relative embeddings a^K, a^V ∈ R^{(2k+1) × head_dim}, shared by its heads."""

  def __init__(self, n_relative: int, head_dim: int, *, init_std: float, param_dtype, rngs):
    init = nnx.initializers.normal(init_std)
    self.key = nnx.Param(
      init(rngs.params(), (n_relative, head_dim), param_dtype),
      logical_axes=('relpos_buckets', 'head_dim'),
    )
    self.value = nnx.Param(
      init(rngs.params(), (n_relative, head_dim), param_dtype),
      logical_axes=('relpos_buckets', 'head_dim'),
    )

  def __call__(self, q_BTNH, context: PositionContext, scale: float):
    """Shaw eq. 4's key term q_i·a^K_ij·scale as a dense bias, and eq. 3's value term."""
    qa_BNTR = jnp.einsum(
      'btnh,rh->bntr',
      q_BTNH,
      self.key[...].astype(q_BTNH.dtype),
      preferred_element_type=jnp.float32,
    )
    index_BTS = context.relative_index
    bias_BNTS = jnp.take_along_axis(qa_BNTR, index_BTS[:, None], axis=-1) * scale
    return ScoreBias(dense=bias_BNTS), RelativeValues(table=self.value[...], index=index_BTS)


class ShawPositions(PositionScheme):
  """Relative key and value embeddings, distances clipped at ±k (Shaw et al. 2018)."""

  def __init__(self, cfg, *, rngs):
    del rngs
    self.max_distance = cfg.position.shaw_max_distance

  def context(self, q_positions_BT, kv_positions_BS):
    return PositionContext(
      relative_index=shaw_relative_index(q_positions_BT, kv_positions_BS, self.max_distance)
    )

  @staticmethod
  def layer_part(cfg, *, rngs):
    return ShawTables(
      2 * cfg.position.shaw_max_distance + 1,
      resolved_head_dim(cfg),
      init_std=weight_std(cfg, 'table'),
      param_dtype=cfg.param_dtype,
      rngs=rngs,
    )


POSITIONS: dict[str, type[PositionScheme]] = {
  'none': NoPositions,
  'learned': LearnedPositions,
  'sinusoidal': SinusoidalPositions,
  'shaw': ShawPositions,
  't5': T5Positions,
  'rope': RotaryPositions,
  'alibi': ALiBiPositions,
}
