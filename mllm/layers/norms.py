"""Every normalization (`model.norm.kind`): layernorm, rmsnorm, partial_rmsnorm, none.

The model builds whichever the config names as `NORMS[kind].from_config(cfg, dim, rngs=rngs)`, the
constructor protocol of every layer registry (FFNS, POSITIONS, MoE alike). `from_config` hands the
constructor `(dim, *, eps, use_bias, fp32, param_dtype, rngs)` plus the fields of the norm's own
`Settings` (partial RMSNorm's p: mllm/variant_config.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.checks import ConfigError, one_of, positive
from mllm.variant_config import check_variant_keys, setting, settings_of


class Norm(nnx.Module):
  """What every registered norm shares: how the model builds it and what HF export reads."""

  @classmethod
  def from_config(cls, cfg, dim: int, *, rngs: nnx.Rngs) -> Norm:
    """This norm, for vectors of size `dim`, as the model config's `norm` section sets it."""
    n = cfg.norm
    kwargs = dict(
      eps=n.eps,
      fp32=n.fp32,
      unit_offset=n.unit_offset,
      param_dtype=jnp.dtype(cfg.param_dtype),
      rngs=rngs,
    )
    if n.use_bias is not None:
      kwargs['use_bias'] = n.use_bias
    if hasattr(cls, 'Settings'):
      kwargs.update(dataclasses.asdict(settings_of(cls, n)))
    return cls(dim, **kwargs)

  @classmethod
  def hf_math(cls, m) -> dict:
    """Its settings beyond `norm.kind`, eps and bias that change the network, for HF export."""
    return {}


class ScaledNorm(Norm):
  """A normalization with a learned gain γ (`scale`) and, optionally, a learned shift β (`bias`);
  a subclass gives `normalize`. With `unit_offset` the parameter is w in γ = 1 + w, from 0
  (Gemma's RMSNorm, Qwen3-Next's "zero-centered" gain: weight decay pulls γ towards 1)."""

  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-6,
    use_bias: bool = False,
    fp32: bool = True,
    unit_offset: bool = False,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs | None = None,
  ):
    del rngs  # Deterministic init: γ = 1, β = 0.
    self.eps = eps
    self.fp32 = fp32
    self.unit_offset = unit_offset
    start = jnp.zeros if unit_offset else jnp.ones
    self.scale = nnx.Param(start((dim,), param_dtype), logical_axes=('norm',))
    self.bias = (
      nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=('norm',)) if use_bias else None
    )

  def normalize(self, x: jax.Array) -> jax.Array:
    raise NotImplementedError

  def __call__(self, x: jax.Array) -> jax.Array:
    # fp32=True is the notebook's `qwen3_compatible` flag: statistics in float32 whatever x's dtype.
    in_dtype = x.dtype
    if self.fp32:
      x = x.astype(jnp.float32)
    gain = self.scale[...].astype(x.dtype)
    y = self.normalize(x) * (1.0 + gain if self.unit_offset else gain)
    if self.bias is not None:
      y = y + self.bias[...].astype(x.dtype)
    return y.astype(in_dtype)


class LayerNorm(ScaledNorm):
  """y = (x − E[x]) / √(Var[x] + ε) · γ + β  (Ba et al. 2016, eq. 4; biased variance, as PyTorch)."""

  def __init__(self, dim: int, *, use_bias: bool = True, **kwargs):
    super().__init__(dim, use_bias=use_bias, **kwargs)

  def normalize(self, x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + self.eps)


class RMSNorm(ScaledNorm):
  """y = x / √(mean(x²) + ε) · γ  (Zhang & Sennrich 2019, eq. 4; ε inside the root, as Llama/HF)."""

  def normalize(self, x):
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(mean_square + self.eps)


def _fraction(name: str, value) -> None:
  if not 0.0 < value <= 1.0:
    raise ConfigError(
      name, value, 'partial RMSNorm uses the first p fraction of features; allowed: 0 < p <= 1'
    )


class PartialRMSNorm(ScaledNorm):
  """pRMSNorm: the RMS is estimated from the first k = ⌈p·d⌉ features only (Zhang & Sennrich 2019,
  eq. 6); every feature is then divided by it. p = 1 is RMSNorm."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    p: float = setting(0.0625, 'the fraction of features in the RMS (paper: 6.25%)', _fraction)

  def __init__(self, dim: int, *, p: float = 0.0625, **kwargs):
    super().__init__(dim, **kwargs)
    self.p = p

  @classmethod
  def hf_math(cls, m):
    return {'norm.partial_rmsnorm.p': settings_of(cls, m.norm).p}

  def normalize(self, x):
    k = max(1, math.ceil(self.p * x.shape[-1]))
    mean_square = jnp.mean(jnp.square(x[..., :k]), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(mean_square + self.eps)


class Identity(Norm):
  """No normalization (the 'Baseline' row of the RMSNorm paper)."""

  def __init__(self, dim: int, **kwargs):
    del dim, kwargs

  def __call__(self, x):
    return x


NORMS: dict[str, type[Norm]] = {
  'layernorm': LayerNorm,
  'rmsnorm': RMSNorm,
  'partial_rmsnorm': PartialRMSNorm,
  'none': Identity,
}

# Where a block's norms sit around each sublayer (mllm/model.py's docstring has the equations).
PLACEMENTS = ('pre', 'post', 'sandwich', 'output')


def check_norm_config(m, p: str = 'model') -> None:
  """`model.norm`: a registered kind with its declared keys, a placement and a positive eps."""
  n = m.norm
  check_variant_keys(n, f'{p}.norm', NORMS, 'norm')
  one_of(f'{p}.norm.placement', n.placement, PLACEMENTS, 'norm placement')
  positive(f'{p}.norm.eps', n.eps)
  if n.unit_offset and not issubclass(NORMS[n.kind], ScaledNorm):
    raise ConfigError(
      f'{p}.norm.unit_offset',
      True,
      f'{p}.norm.kind={n.kind!r} has no gain to offset; allowed: False, or a norm with a gain',
    )
