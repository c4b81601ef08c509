"""RoPE (Su et al. 2021): rotation angles, the two feature layouts, the context-extension
scalings of its frequencies (PI, NTK, YaRN, llama3), and their Hugging Face mapping.
`RotaryPositions` in positions.py applies it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from mllm.checks import ConfigError, positive
from mllm.hf_errors import HFImportError
from mllm.variant_config import keys_of, setting, settings_of

# ---------------------------------------------------------------------------------------------
# RoPE (Su et al. 2021) and its context-extension scalings.
# ---------------------------------------------------------------------------------------------

ROPE_LAYOUTS = ('half', 'interleaved')


def _extension_factor(name: str, value) -> None:
  if not value >= 1.0:
    raise ConfigError(name, value, 'the context extension factor must be >= 1')


# The key every scaling but none reads, declared once (each scaling's section holds its own).
FACTOR = setting(1.0, 'the context extension factor s', _extension_factor)


# Each scaling is its own settings: a frozen dataclass of the keys it reads (variant_config.py),
# registered in ROPE_SCALINGS under its `model.position.rope.scaling.kind` name. `frequencies` takes
# RoPE's θ_i and returns the scaled ones and the factor on cos and sin (YaRN's temperature).


@dataclasses.dataclass(frozen=True)
class NoScaling:
  """RoPE's own frequencies."""

  # Its Hugging Face spelling: `rope_type` (None: transformers has no such scaling; each settings
  # field is the rope_parameters field of its own name), and whether it reads the pretrained
  # length (`original_max_position_embeddings`, mllm's `rope.original_max_len`).
  hf_type: ClassVar[str | None] = 'default'
  reads_original_len: ClassVar[bool] = False

  @classmethod
  def hf_value(cls, params: dict, field: str, hf: dict) -> float:
    """A field's value from `rope_parameters` (an HFImportError if it is missing)."""
    if params.get(field) is None:
      raise HFImportError(
        f'rope_parameters.{field}: missing for rope_type={cls.hf_type!r}; allowed: a number'
      )
    return float(params[field])

  def frequencies(self, inv_freq, head_dim: int, theta: float, original_max_len: int):
    return inv_freq, 1.0

  def check(self, prefix: str) -> None:
    """Rules across its keys (each key's own rule is declared with it)."""


@dataclasses.dataclass(frozen=True)
class PositionInterpolation(NoScaling):
  """PI (Chen et al. 2023, eq. 4): positions / s, i.e. every θ_i / s."""

  hf_type: ClassVar[str | None] = 'linear'

  factor: float = FACTOR

  def frequencies(self, inv_freq, head_dim, theta, original_max_len):
    return inv_freq / self.factor, 1.0


@dataclasses.dataclass(frozen=True)
class NTKAware(NoScaling):
  """NTK-aware base change (bloc97 2023): θ' = θ·s^(d/(d−2))."""

  hf_type: ClassVar[str | None] = None  # transformers' 'dynamic' is another method
  reads_original_len: ClassVar[bool] = True

  factor: float = FACTOR

  def frequencies(self, inv_freq, head_dim, theta, original_max_len):
    exponents = np.arange(0, head_dim, 2, dtype=np.float64)[: head_dim // 2] / head_dim
    return 1.0 / (theta * self.factor ** (head_dim / (head_dim - 2))) ** exponents, 1.0


@dataclasses.dataclass(frozen=True)
class YaRN(NoScaling):
  """YaRN (Peng et al. 2023, eqs. 17-20): a per-frequency ramp between interpolation and
  extrapolation (beta_fast = β, beta_slow = α) and the attention temperature √(1/t) = 0.1·ln(s) + 1
  on cos and sin (eq. 22), or another factor there (`attention_factor`: DeepSeek's mscale ratio)."""

  hf_type: ClassVar[str | None] = 'yarn'
  reads_original_len: ClassVar[bool] = True

  factor: float = FACTOR
  beta_fast: float = setting(32.0, 'YaRN β: rotations above it extrapolate', positive)
  beta_slow: float = setting(1.0, 'YaRN α: rotations below it interpolate', positive)
  truncate: bool = setting(
    True,
    "the ramp's ends rounded to whole dimensions (floor, ceil: YaRN's code); False: as computed "
    '(gpt-oss)',
  )
  attention_factor: float | None = setting(
    None,
    "the factor on cos and sin; None: the paper's 0.1·ln(s) + 1 (DeepSeek's checkpoints set "
    'mscale(s, mscale) / mscale(s, mscale_all_dim))',
    positive,
  )

  @classmethod
  def hf_value(cls, params, field, hf):
    """transformers reads an unset or 0 beta as its default, and an unset factor as
    max_position_embeddings / original_max_position_embeddings; `attention_factor` as
    transformers' `_compute_yarn_parameters` infers it."""
    if field == 'factor' and not params.get('factor'):
      return hf['max_position_embeddings'] / params['original_max_position_embeddings']
    if field == 'truncate':
      return params.get('truncate', True)
    if field == 'attention_factor':
      return hf_attention_factor(params, cls.hf_value(params, 'factor', hf))
    if field != 'factor' and not params.get(field):
      return {f.name: f.default for f in dataclasses.fields(cls)}[field]
    return super().hf_value(params, field, hf)

  def check(self, prefix):
    if not self.beta_slow < self.beta_fast:
      raise ConfigError(
        f'{prefix}.yarn.beta_slow',
        self.beta_slow,
        f'YaRN needs 0 < beta_slow < beta_fast={self.beta_fast}',
      )

  def frequencies(self, inv_freq, head_dim, theta, original_max_len):
    def correction_dim(n_rotations):  # the dimension whose wavelength fits n_rotations in L_orig
      return (
        head_dim * math.log(original_max_len / (n_rotations * 2 * math.pi)) / (2 * math.log(theta))
      )

    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1: keep the original frequency; 0: interpolate it by the factor
    inv_freq = inv_freq / self.factor * (1.0 - extrapolate) + inv_freq * extrapolate
    if self.attention_factor is not None:
      return inv_freq, self.attention_factor
    return inv_freq, yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's temperature √(1/t) = 0.1·ln(s) + 1 (eq. 22), with DeepSeek's multiplier `mscale` on
  the log; 1 where nothing is extended."""
  return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def hf_attention_factor(params: Mapping[str, Any], factor: float) -> float | None:
  """YaRN's factor on cos and sin as transformers infers it from `rope_parameters`: its
  `attention_factor`, else mscale(s, mscale) / mscale(s, mscale_all_dim) where both are set
  (DeepSeek-V2/V3), else the paper's (None)."""
  if params.get('attention_factor') is not None:
    return float(params['attention_factor'])
  mscale, mscale_all_dim = params.get('mscale'), params.get('mscale_all_dim')
  if mscale and mscale_all_dim:
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  return None


# DeepSeek-V2/V3 also scale the softmax by mscale(s, mscale_all_dim)² wherever RoPE is scaled
# (transformers' `yarn_apply_mscale`): mllm's `attention.softmax_scale`, computed as they do.


def deepseek_softmax_scale(qk_dim: int, factor: float, mscale_all_dim: float) -> float:
  """DeepSeek's scores scale: qk_dim^(-1/2) · mscale(s, mscale_all_dim)², in transformers' order."""
  mscale = yarn_mscale(factor, mscale_all_dim)
  return qk_dim ** (-0.5) * mscale * mscale


def deepseek_mscale_all_dim(scale: float, qk_dim: int, factor: float) -> float | None:
  """The `mscale_all_dim` whose DeepSeek softmax scale is `scale`, exactly where a float is (the
  formula's inverse misses by a few ulps, so it is found by bisection around it: the scale grows
  with mscale_all_dim), else the nearest (its scale an ulp off: export's check refuses it); None
  for the plain scale or no scaling."""
  if factor <= 1 or scale <= 0:
    return None
  guess = ((scale * qk_dim**0.5) ** 0.5 - 1.0) / (0.1 * math.log(factor))
  if guess == 0:  # the plain scale: DeepSeek reads 0 as no mscale
    return None
  for digits in range(1, 16):  # the shortest decimal that gives it (0.77, not 0.7700000000000006)
    short = round(guess, digits)
    if deepseek_softmax_scale(qk_dim, factor, short) == scale:
      return short
  low, high = guess - abs(guess) * 1e-9, guess + abs(guess) * 1e-9
  nearest, miss = guess, abs(deepseek_softmax_scale(qk_dim, factor, guess) - scale)
  for _ in range(100):
    middle = (low + high) / 2
    got = deepseek_softmax_scale(qk_dim, factor, middle)
    if got == scale:
      return middle
    if abs(got - scale) < miss:
      nearest, miss = middle, abs(got - scale)
    low, high = (middle, high) if got < scale else (low, middle)
  return nearest


@dataclasses.dataclass(frozen=True)
class Llama3(NoScaling):
  """Llama 3.1's wavelength bands: wavelengths beyond L_orig/low_freq_factor interpolate by s,
  below L_orig/high_freq_factor stay, and a smooth blend in between."""

  hf_type: ClassVar[str | None] = 'llama3'
  reads_original_len: ClassVar[bool] = True

  factor: float = FACTOR
  low_freq_factor: float = setting(1.0, 'llama3: the low band edge', positive)
  high_freq_factor: float = setting(4.0, 'llama3: the high band edge')

  def check(self, prefix):
    if not self.low_freq_factor < self.high_freq_factor:
      raise ConfigError(
        f'{prefix}.llama3.low_freq_factor',
        self.low_freq_factor,
        f'llama3 scaling needs 0 < low_freq_factor < high_freq_factor={self.high_freq_factor}',
      )

  def frequencies(self, inv_freq, head_dim, theta, original_max_len):
    low_freq_wavelen = original_max_len / self.low_freq_factor
    high_freq_wavelen = original_max_len / self.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_len / wavelen - self.low_freq_factor) / (
      self.high_freq_factor - self.low_freq_factor
    )
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
    medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    inv_freq = np.where(medium, (1 - smooth) * inv_freq / self.factor + smooth * inv_freq, scaled)
    return inv_freq, 1.0


ROPE_SCALINGS: dict[str, type[NoScaling]] = {
  'none': NoScaling,
  'linear': PositionInterpolation,
  'ntk': NTKAware,
  'yarn': YaRN,
  'llama3': Llama3,
}


def rope_scaling(spec: NoScaling | Mapping[str, Any] | str | None) -> NoScaling:
  """A scaling from its name, or {'kind': name, field: value, ...} (fields by their short names),
  or the scaling itself."""
  if spec is None:
    return NoScaling()
  if isinstance(spec, NoScaling):
    return spec
  if isinstance(spec, str):
    spec = {'kind': spec}
  fields = dict(spec)
  kind = fields.pop('kind')
  if kind not in ROPE_SCALINGS:
    raise ValueError(f"rope scaling={kind!r}; allowed: {', '.join(ROPE_SCALINGS)}")
  return ROPE_SCALINGS[kind](**fields)


def rope_inverse_frequencies(
  head_dim: int,
  theta: float = 10000.0,
  scaling: NoScaling | Mapping | str | None = None,
  original_max_len: int = 2048,
) -> tuple[np.ndarray, float]:
  """θ_i = base^(−2(i−1)/d), i = 1..d/2, after `scaling`; and the factor that multiplies cos and sin
  (YaRN's temperature, 1 otherwise). `original_max_len`: the trained context the scaling extends
  (YaRN, llama3). Computed in float64 NumPy: these are static."""
  exponents = np.arange(0, head_dim, 2, dtype=np.float64)[: head_dim // 2] / head_dim
  inv_freq = 1.0 / theta**exponents
  return rope_scaling(scaling).frequencies(inv_freq, head_dim, theta, original_max_len)


def rope_angles(
  positions: jax.Array,
  head_dim: int,
  theta: float = 10000.0,
  scaling: NoScaling | Mapping | str | None = None,
  original_max_len: int = 2048,
) -> tuple[jax.Array, jax.Array]:
  """cos and sin of m·θ_i for positions [..., T] → two arrays [..., T, head_dim // 2]."""
  inv_freq, attention_factor = rope_inverse_frequencies(head_dim, theta, scaling, original_max_len)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def rotate(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array, layout: str) -> jax.Array:
  """Apply the rotation R_{Θ,m} (Su et al. 2021, eq. 34) with precomputed angles.

  'interleaved' rotates pairs (x1, x2), (x3, x4), ... (the paper, Meta's and Mistral's code);
  'half' rotates (x_i, x_{i+d/2}) (GPT-NeoX, HF Llama/Qwen). They differ by a fixed permutation of
  the head dimension, which is why checkpoints of one do not load into the other.
  Angles for r < head_dim / 2 pairs rotate the first 2r dimensions only and pass the rest through
  (partial RoPE: GPT-NeoX's rotary_pct, the layout applying within those 2r).
  """
  rotated = 2 * cos_BTh.shape[-1]
  if rotated < x_BTNH.shape[-1]:
    head = rotate(x_BTNH[..., :rotated], cos_BTh, sin_BTh, layout)
    return jnp.concatenate([head, x_BTNH[..., rotated:]], axis=-1)
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
  scaling: NoScaling | Mapping | str | None = None,
  original_max_len: int = 2048,
) -> jax.Array:
  """Rotary position embedding of x [B, T, heads, head_dim] at positions [B, T] (or [T])."""
  if x.shape[-1] % 2:
    raise ValueError(f'RoPE needs an even head_dim, got {x.shape[-1]}')
  cos, sin = rope_angles(jnp.asarray(positions), x.shape[-1], theta, scaling, original_max_len)
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
# RoPE's Hugging Face mapping (`RotaryPositions.keys_from_hf`, `hf_fields`, `hf_math`):
# config.json's `rope_parameters` ↔ `model.position.*`, exactly or refused in one line.
# ---------------------------------------------------------------------------------------------


def _typed(scaling: type[NoScaling], field: str, value):
  """A scaling's field value as its settings declare it: a flag stays a bool, an unset optional
  one None, the rest floats."""
  if value is None:
    return None
  default = {f.name: f.default for f in dataclasses.fields(scaling)}[field]
  return bool(value) if isinstance(default, bool) else float(value)


def _declared(scaling: type[NoScaling]) -> list[str]:
  """The fields of a scaling's section (`model.position.rope.scaling.<its name>`)."""
  return [k.name for k in keys_of(scaling)]


def hf_rope_params(hf: dict) -> dict[str, Any]:
  """config.json's RoPE fields in transformers 5's shape (`rope_parameters`), whichever spelling
  it uses (transformers 4's `rope_theta` + `rope_scaling`, whose kind may be called `type`)."""
  params = dict(hf.get('rope_parameters') or {})
  if not params:
    params = dict(hf.get('rope_scaling') or {})
    params.setdefault('rope_theta', hf.get('rope_theta', 10000.0))
  params['rope_type'] = params.get('rope_type', params.get('type', 'default'))
  return params


def rope_keys_from_hf(hf: dict, partial: bool = False) -> dict[str, Any]:
  """Position keys from `rope_parameters` (transformers ≥ 5) or `rope_theta` + `rope_scaling`:
  the scaling whose `hf_type` is the rope_type reads its own fields. `partial`: the family
  rotates `partial_rotary_factor` of each head (StableLM, GPT-NeoX); elsewhere it is refused."""
  params = hf_rope_params(hf)
  kind = params['rope_type']
  fraction = params.get('partial_rotary_factor', hf.get('partial_rotary_factor'))
  if fraction not in (None, 1, 1.0) and not partial:
    raise HFImportError(
      f'partial_rotary_factor={fraction!r}: not computed by this family in transformers; allowed: 1'
    )
  by_hf = {cls.hf_type: (name, cls) for name, cls in ROPE_SCALINGS.items() if cls.hf_type}
  if kind not in by_hf:
    allowed = ', '.join(by_hf)
    raise HFImportError(f'rope_type={kind!r}: not mapped to mllm yet; allowed: {allowed}')
  name, scaling = by_hf[kind]
  out = {
    'position.kind': 'rope',
    'position.rope.layout': 'half',
    'position.rope.theta': float(params['rope_theta']),
    'position.rope.fraction': 1.0 if fraction is None else float(fraction),
  }
  if scaling is NoScaling:
    return out
  original = params.get('original_max_position_embeddings')
  if scaling.reads_original_len and original is None:
    if scaling is not YaRN:
      raise HFImportError(
        f'rope_parameters.original_max_position_embeddings: missing for rope_type={kind!r}; '
        'allowed: the length the model was pretrained at'
      )
    original = params['original_max_position_embeddings'] = hf['max_position_embeddings']
  out['position.rope.scaling.kind'] = name
  for field in _declared(scaling):
    out[f'position.rope.scaling.{name}.{field}'] = _typed(
      scaling, field, scaling.hf_value(params, field, hf)
    )
  if scaling.reads_original_len:
    out['position.rope.original_max_len'] = int(original)
  return out


def _scaling_of(m) -> tuple[type[NoScaling], NoScaling]:
  """The scaling class of model config `m` and its settings."""
  section = m.position.rope.scaling
  cls = ROPE_SCALINGS[section.kind]
  return cls, settings_of(cls, section)


def rope_hf_fields(m) -> dict[str, Any]:
  """config.json's RoPE fields for model config `m` (its `position.rope`, whatever the kind): the
  scaling's `hf_type` and its fields."""
  rope = m.position.rope
  cls, scaling = _scaling_of(m)
  # A scaling transformers lacks (NTK) is written as plain RoPE; export refuses it, since the
  # model transformers would build computes something else (interop/hf.py's math check).
  params: dict[str, Any] = {
    'rope_type': cls.hf_type or 'default',
    'rope_theta': float(rope.theta),
  }
  if cls.hf_type is not None:
    fields = {f: _typed(cls, f, getattr(scaling, f)) for f in _declared(cls)}
    params.update({f: v for f, v in fields.items() if v is not None})  # unset: transformers' own
    if cls.reads_original_len:
      params['original_max_position_embeddings'] = int(rope.original_max_len or m.max_seq_len)
  # Both spellings: transformers ≥ 5 reads rope_parameters, earlier versions rope_theta and
  # rope_scaling.
  legacy = (
    None
    if params['rope_type'] == 'default'
    else {k: v for k, v in params.items() if k != 'rope_theta'}
  )
  return {'rope_parameters': params, 'rope_theta': params['rope_theta'], 'rope_scaling': legacy}


def rope_math(m) -> dict[str, Any]:
  """RoPE's settings that change the network, resolved, for HF export's `math_of`."""
  rope = m.position.rope
  cls, scaling = _scaling_of(m)
  kind = rope.scaling.kind
  out = {
    'position.rope.theta': float(rope.theta),
    'position.rope.layout': rope.layout,
    'position.rope.scaling.kind': kind,
    'position.rope.fraction': float(rope.fraction),
    'position.rope.frequencies': rope.frequencies,
    'position.rope.nope_every': rope.nope_every,
  }
  for field in _declared(cls):
    out[f'position.rope.scaling.{kind}.{field}'] = _typed(cls, field, getattr(scaling, field))
  if cls.reads_original_len:
    out['position.rope.original_max_len'] = rope.original_max_len or m.max_seq_len
  return out
