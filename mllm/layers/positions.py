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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from mllm.checks import ConfigError, positive
from mllm.layers import initializers, resolved_head_dim, rotary_head_dim
from mllm.layers.parametrization import weight_std
from mllm.layers.rope import (
  ROPE_LAYOUTS,
  ROPE_SCALINGS,
  rope_angles,
  rope_hf_fields,
  rope_keys_from_hf,
  rope_math,
  rotate,
)
from mllm.ops.attention import RelativeValues, ScoreBias
from mllm.variant_config import (
  Chosen,
  at_least,
  check_variant_keys,
  choice,
  one_of_these,
  setting,
  settings_of,
)

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

  def without_rotation(self) -> PositionContext:
    """This context for a NoPE layer: its biases, no rotation."""
    return self.replace(cos=None, sin=None)


class PositionScheme(nnx.Module):
  """Base scheme: acts nowhere (NoPE). Subclasses override what they need: the four points above,
  `Settings` (the config keys it reads: mllm/variant_config.py), `check` (its rules across keys),
  `describe` (one line) and `hf_math` (what Hugging Face export must reproduce)."""

  max_positions: int | None = None  # size of a learned table of absolute positions, if any
  learned_bias = False  # its score bias is learned: only 'xla', 'blockwise' (autodiff) run it

  @classmethod
  def check(cls, m, p: str) -> None:
    """Raise ConfigError if `model` (m, at prefix p) breaks this scheme's rules."""

  @classmethod
  def describe(cls, m) -> str:
    """One line for the summary's tables."""
    return m.position.kind

  @classmethod
  def hf_math(cls, m) -> dict:
    """Its settings beyond `position.kind` that change the network, keyed by mllm key and
    resolved: what HF export compares after mapping its config.json back (`math_of`)."""
    return {}

  @classmethod
  def from_config(cls, cfg, *, rngs: nnx.Rngs) -> PositionScheme:
    """This scheme as the model config `cfg` sets it (the protocol of every layer registry)."""
    return cls(cfg, rngs=rngs)

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

  @classmethod
  def hf_math(cls, m):
    return {'max_seq_len': m.max_seq_len}  # the table's size: a model of another size differs

  def __init__(self, cfg, *, rngs):
    init = initializers.normal(weight_std(cfg, 'table'))
    self.max_positions = cfg.max_seq_len
    self.table = nnx.Param(
      init(rngs.params(), (cfg.max_seq_len, cfg.d_model), cfg.param_dtype),
      logical_axes=('positions', 'embed'),
    )

  def embed(self, x_BTD, positions_BT):
    return x_BTD + jnp.take(self.table[...], positions_BT, axis=0).astype(x_BTD.dtype)


class SinusoidalPositions(PositionScheme):
  """Fixed sinusoids added to the token embedding (Vaswani et al. 2017, sec. 3.5)."""

  @classmethod
  def check(cls, m, p):
    if m.d_model % 2:
      raise ConfigError(f'{p}.d_model', m.d_model, 'sinusoidal positions need an even d_model')

  def embed(self, x_BTD, positions_BT):
    return x_BTD + sinusoidal_embedding(positions_BT, x_BTD.shape[-1]).astype(x_BTD.dtype)


def _rotated_fraction(name: str, value) -> None:
  if not 0.0 < value <= 1.0:
    raise ConfigError(
      name, value, "the fraction of each head's dimensions RoPE rotates; allowed: 0 < fraction <= 1"
    )


def _every_nth(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 2:
    raise ConfigError(name, value, 'every N-th layer; allowed: an integer >= 2, or None')


def rotating_layers(cfg) -> tuple[bool, ...]:
  """Per layer, whether the positional scheme's rotation applies: not in RoPE's NoPE layers
  (`position.rope.nope_every`); every layer otherwise (a scheme without rotation ignores it)."""
  every = cfg.position.rope.nope_every if cfg.position.kind == 'rope' else None
  return tuple(every is None or (i + 1) % every != 0 for i in range(cfg.n_layers))


# Partial RoPE's frequencies (`position.rope.frequencies`), read where fraction < 1.
PARTIAL_FREQUENCIES = ('spread', 'highest')


def rotated_dims(head_dim: int, fraction: float) -> int:
  """The head dimensions partial RoPE rotates: the first int(fraction·head_dim), as GPT-NeoX's
  rotary_ndims and transformers' partial_rotary_factor count them."""
  return int(head_dim * fraction)


class RotaryPositions(PositionScheme):
  """RoPE: q and k rotated by angles m·θ_i, so q_m·k_n depends on m − n only (Su et al. 2021)."""

  # Its Hugging Face mapping, in rope.py beside the scalings it names: config.json's
  # rope_parameters → position keys (refusing what mllm lacks), position keys → those fields, and
  # the settings export compares.
  keys_from_hf = staticmethod(rope_keys_from_hf)
  hf_fields = staticmethod(rope_hf_fields)
  hf_math = staticmethod(rope_math)

  @dataclasses.dataclass(frozen=True)
  class Settings:
    theta: float = setting(10000.0, 'the base θ of θ_i = θ^(−2(i−1)/d)', positive)
    layout: str = setting(
      'half',
      'half (HF/Qwen) | interleaved (paper/Meta)',
      one_of_these(ROPE_LAYOUTS, 'RoPE layout'),
    )
    scaling: Chosen = choice(ROPE_SCALINGS, 'none', 'RoPE scaling')  # noqa: RUF009 (a field)
    # Also the "pre-training context" experiments measure lengths in, with or without a scaling.
    original_max_len: int | None = setting(
      None,
      'the trained context a scaling extends; None: max_seq_len',
      positive,
    )
    nope_every: int | None = setting(
      None,
      'every N-th layer (i + 1 divisible by N) rotates nothing: NoPE layers among RoPE ones '
      "(Llama 4's iRoPE, SmolLM3: 4); None: every layer rotates",
      _every_nth,
    )
    fraction: float = setting(
      1.0,
      "the fraction of each head's dimensions rotated, the first int(fraction·head_dim) (GPT-NeoX's "
      'rotary_pct, HF partial_rotary_factor; p-RoPE); the rest carry no position',
      _rotated_fraction,
    )
    frequencies: str = setting(
      'spread',
      "partial RoPE's frequencies on its r rotated dims: spread, θ^(−2i/r) over the whole range "
      "(GPT-NeoX, HF partial_rotary_factor) | highest, full RoPE's r/2 highest θ^(−2i/head_dim), "
      'the lowest removed (p-RoPE, Barbero et al. 2024 §6)',
      one_of_these(PARTIAL_FREQUENCIES, 'partial RoPE frequencies'),
    )

  @classmethod
  def check(cls, m, p):
    rope = settings_of(cls, m.position)
    rope.scaling.settings.check(f'{p}.position.rope.scaling')
    if rope.frequencies != 'spread' and rope.fraction == 1.0:
      raise ConfigError(
        f'{p}.position.rope.frequencies',
        rope.frequencies,
        "chooses which frequencies partial RoPE keeps; at fraction 1 every one is kept; allowed "
        f"with {p}.position.rope.fraction=1.0: 'spread'",
      )
    if m.attention.kind == 'mla':  # its own rotated part (mllm/layers/mla.py checks the rest)
      dims = rotary_head_dim(m)
      if dims % 2:
        raise ConfigError(
          f'{p}.attention.mla.rope_head_dim',
          m.attention.mla.rope_head_dim,
          f'resolves to {dims} (head_dim // 2); RoPE rotates pairs of features: allowed: an even '
          'number',
        )
      return
    head_dim = resolved_head_dim(m)
    if head_dim % 2:
      derived = (
        '' if m.head_dim else f' (derived as d_model // n_heads = {m.d_model} // {m.n_heads})'
      )
      raise ConfigError(
        f'{p}.head_dim',
        head_dim,
        f'RoPE rotates pairs of features, so head_dim must be even{derived}',
      )
    rotated = rotated_dims(head_dim, rope.fraction)
    if rotated < 2 or rotated % 2:
      raise ConfigError(
        f'{p}.position.rope.fraction',
        rope.fraction,
        f'rotates int({rope.fraction:g}·{head_dim}) = {rotated} of the head dim {head_dim}; allowed: '
        'a fraction that rotates an even number of dimensions, at least 2',
      )

  @classmethod
  def describe(cls, m):
    rope = settings_of(cls, m.position)
    text = f'rope θ={rope.theta:g} {rope.layout}'
    if rope.fraction != 1.0:
      text += f' on {rope.fraction:g} of each head'
      if rope.frequencies == 'highest':
        text += ' (p-RoPE: its highest frequencies)'
    if rope.nope_every:
      text += f', none in every {rope.nope_every}th layer'
    if rope.scaling.kind != 'none':
      text += f' {rope.scaling.kind}×{rope.scaling.settings.factor:g}'
    return text

  def __init__(self, cfg, *, rngs):
    del rngs
    settings = settings_of(self, cfg.position)
    # p-RoPE's r/2 frequencies are full RoPE's first (highest); GPT-NeoX's are those of an r-dim head.
    self.frequency_dims = rotary_head_dim(cfg) if settings.frequencies == 'highest' else None
    self.rotated_dims = rotated_dims(rotary_head_dim(cfg), settings.fraction)
    self.theta = settings.theta
    self.layout = settings.layout
    self.scaling = settings.scaling.settings
    self.original_max_len = settings.original_max_len or cfg.max_seq_len

  def context(self, q_positions_BT, kv_positions_BS):
    cos, sin = rope_angles(
      q_positions_BT,
      self.frequency_dims or self.rotated_dims,
      self.theta,
      self.scaling,
      self.original_max_len,
    )
    pairs = self.rotated_dims // 2
    return PositionContext(cos=cos[..., :pairs], sin=sin[..., :pairs], layout=self.layout)


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

  learned_bias = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    num_buckets: int = setting(32, 'distance buckets', at_least(2))
    max_distance: int = setting(128, 'distances beyond share the last bucket')

  @classmethod
  def check(cls, m, p):
    t5 = settings_of(cls, m.position)
    if t5.max_distance <= t5.num_buckets // 2:
      raise ConfigError(
        f'{p}.position.t5.max_distance',
        t5.max_distance,
        f'must exceed num_buckets // 2 = {t5.num_buckets // 2}, where the exact buckets end',
      )

  @classmethod
  def describe(cls, m):
    t5 = settings_of(cls, m.position)
    return f't5 {t5.num_buckets} buckets ≤{t5.max_distance}'

  def __init__(self, cfg, *, rngs):
    settings = settings_of(self, cfg.position)
    self.num_buckets = settings.num_buckets
    self.max_distance = settings.max_distance
    # HF T5's initialization under every model.init: a bias per head, not a projection.
    init = initializers.normal(cfg.d_model**-0.5)
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
    init = initializers.normal(init_std)
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

  learned_bias = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    max_distance: int = setting(16, 'the clipping distance k', at_least(0))

  @classmethod
  def describe(cls, m):
    return f'shaw k={settings_of(cls, m.position).max_distance}'

  def __init__(self, cfg, *, rngs):
    del rngs
    self.max_distance = settings_of(self, cfg.position).max_distance

  def context(self, q_positions_BT, kv_positions_BS):
    return PositionContext(
      relative_index=shaw_relative_index(q_positions_BT, kv_positions_BS, self.max_distance)
    )

  @staticmethod
  def layer_part(cfg, *, rngs):
    return ShawTables(
      2 * settings_of(ShawPositions, cfg.position).max_distance + 1,
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


def check_position_config(m, p: str = 'model') -> None:
  """`model.position`: the scheme's declared keys (its `Settings`, and those of the RoPE scaling
  it chooses), no other scheme's key moved off its default, then the scheme's own rules."""
  check_variant_keys(m.position, f'{p}.position', POSITIONS, 'position scheme')
  POSITIONS[m.position.kind].check(m, p)
