"""Every position-wise feed-forward network (`model.ffn.kind`).

Two-matrix FFNs (Vaswani et al. 2017, eq. 2):  FFN(x) = act(x·W_up + b) · W_down + b
Gated FFNs (Shazeer 2020, eqs. 5-6):           FFN(x) = (act(x·W_gate) ⊗ x·W_up) · W_down
A gated FFN has three matrices; with `match_params` its hidden size is 2/3 of the ungated one (rounded
to `multiple_of`), so both have the same parameter count, as in Shazeer's comparison.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from mllm.checks import integer, positive
from mllm.layers import initializers
from mllm.layers.parametrization import weight_std
from mllm.variant_config import check_variant_keys, setting, settings_of

# GELU here is the exact x·Φ(x) (Hendrycks & Gimpel 2016), as in Shazeer's table; GPT-2 used tanh.
gelu = functools.partial(jax.nn.gelu, approximate=False)
gelu_tanh = functools.partial(jax.nn.gelu, approximate=True)  # GPT-2's "gelu_new"


def _linear(d_in, d_out, axes, *, use_bias, std, dtype, param_dtype, rngs):
  return nnx.Linear(
    d_in,
    d_out,
    use_bias=use_bias,
    dtype=dtype,
    param_dtype=param_dtype,
    kernel_init=initializers.normal(std),
    rngs=rngs,
    kernel_metadata={'logical_axes': axes},
    bias_metadata={'logical_axes': axes[1:]},
  )


class FeedForward(nnx.Module):
  """The FFN of both families; a variant subclass sets `activation` and `gated`.

  Ungated: down(act(up(x))). Gated: down(act(gate(x)) ⊗ up(x)). Parameter names are gate/up/down.
  """

  gated = False
  # The names transformers gives this FFN's activation (config.json's hidden_act, which for a
  # gated FFN names the gate's, or GPT-2's activation_function); HF export writes the first.
  hf_activations: tuple[str, ...] = ()
  # A variant may declare `Settings` (its section, `model.ffn.<name>`: mllm/variant_config.py);
  # `activation` then takes their fields as keyword arguments.

  @staticmethod
  def activation(x):
    raise NotImplementedError

  @classmethod
  def activation_with(cls, settings) -> Callable:
    """The activation with the variant's settings bound."""
    if settings is None:
      return cls.activation
    return functools.partial(cls.activation, **dataclasses.asdict(settings))

  @classmethod
  def hidden_with(cls, settings) -> Callable:
    """`hidden(pre_gate, pre_up)`: the hidden layer from its pre-activations, the variant's
    settings bound (the dense FFN and the experts use it; pre_gate None when ungated)."""
    return functools.partial(ffn_hidden, activation=cls.activation_with(settings))

  @classmethod
  def dense_kind(cls, m) -> str:
    """The FFN kind of the model's dense layers: this one (an MoE names its experts')."""
    return m.ffn.kind

  @classmethod
  def dense_layer(cls, cfg, *, rngs: nnx.Rngs) -> nnx.Module:
    """A dense layer of the model whose `ffn.kind` this is (an MoE builds its experts' FFN)."""
    return cls.from_config(cfg, rngs=rngs)

  def __init__(
    self,
    d_model: int,
    d_ff: int,
    *,
    use_bias: bool,
    init_std: float,
    out_std: float,
    dtype=None,
    param_dtype=jnp.float32,
    settings=None,
    rngs: nnx.Rngs,
  ):
    self.settings = settings  # the variant's frozen Settings record, or None
    common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate = (
      _linear(d_model, d_ff, ('embed', 'mlp'), std=init_std, **common) if self.gated else None
    )
    self.up = _linear(d_model, d_ff, ('embed', 'mlp'), std=init_std, **common)
    self.down = _linear(d_ff, d_model, ('mlp', 'embed'), std=out_std, **common)

  @classmethod
  def from_config(cls, cfg, *, section=None, rngs: nnx.Rngs) -> FeedForward:
    """The FFN of this kind that the model config `cfg` describes: `hidden_dim` wide, initialised
    as `model.init` says (gate and up read d_model features, down the hidden ones), its settings
    read from the choice section `section` (default `cfg.ffn`; an MoE's dense layers: its
    expert's)."""
    d_ff = _hidden_size(cfg.ffn, cfg.d_model, cls.gated)
    return cls(
      cfg.d_model,
      d_ff,
      use_bias=cfg.ffn.use_bias,
      init_std=weight_std(cfg, 'in', fan_in=cfg.d_model),
      out_std=weight_std(cfg, 'out', fan_in=d_ff),
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=jnp.dtype(cfg.param_dtype),
      settings=settings_of(cls, cfg.ffn if section is None else section),
      rngs=rngs,
    )

  def __call__(self, x_BTD):
    hidden = self.hidden_with(self.settings)
    if self.up.bias is None:
      # Without biases: the same products through `_ffn`, whose backward XLA:CPU runs without
      # transposing the [tokens, d_ff] activations (see there).
      dtype = self.up.dtype or jnp.result_type(x_BTD.dtype, self.up.kernel.dtype)
      kernel = lambda linear: linear.kernel[...].astype(dtype)  # noqa: E731
      return _ffn(
        x_BTD.astype(dtype),
        kernel(self.gate) if self.gated else None,
        kernel(self.up),
        kernel(self.down),
        hidden,
      )
    return self.down(hidden(self.gate(x_BTD) if self.gated else None, self.up(x_BTD)))


# ---------------------------------------------------------------------------------------------
# The bias-free FFN with a hand-written backward. Autodiff of down(act(gate(x)) ⊗ up(x)) leaves
# XLA:CPU's layout assignment free to transpose the [tokens, d_ff] gradient of the hidden layer
# for the weight gradients xᵀ·dH, and it fuses that transpose into the elementwise activation
# backward, a strided write that cost more than the three matmuls of the layer (d 256, 2048
# tokens: 60 ms against ~10 ms per matmul). Written out, the weight gradients read x and the hidden
# activations as they are, and the hidden activations are recomputed from the saved
# pre-activations (cheap elementwise work) instead of being stored.
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ffn(x, w_gate, w_up, w_down, hidden):
  return _ffn_fwd(x, w_gate, w_up, w_down, hidden)[0]


def ffn_hidden(pre_gate, pre_up, activation):
  """The hidden layer from its pre-activations: act(x W_up), or act(x W_gate) ⊙ x W_up when
  gated (Shazeer 2020, eq. 5-6). The dense FFN and the MoE experts share it."""
  return activation(pre_up) if pre_gate is None else activation(pre_gate) * pre_up


def _ffn_fwd(x, w_gate, w_up, w_down, hidden_of):
  pre_gate = None if w_gate is None else x @ w_gate
  pre_up = x @ w_up
  y = hidden_of(pre_gate, pre_up) @ w_down
  return y, (x, w_gate, w_up, w_down, pre_gate, pre_up)


def _ffn_bwd(hidden_of, residuals, dy):
  x, w_gate, w_up, w_down, pre_gate, pre_up = residuals
  d_model, d_ff = w_up.shape
  hidden, hidden_vjp = jax.vjp(hidden_of, pre_gate, pre_up)
  dy = dy.astype(hidden.dtype)
  d_hidden = dy @ w_down.T
  d_gate, d_up = hidden_vjp(d_hidden)
  x2, dy2 = x.reshape(-1, d_model), dy.reshape(-1, d_model)
  dw_down = hidden.reshape(-1, d_ff).T @ dy2
  dw_up = x2.T @ d_up.reshape(-1, d_ff)
  dx = d_up @ w_up.T
  dw_gate = None
  if w_gate is not None:
    dw_gate = (x2.T @ d_gate.reshape(-1, d_ff)).astype(w_gate.dtype)
    dx = dx + d_gate @ w_gate.T
  return dx, dw_gate, dw_up.astype(w_up.dtype), dw_down.astype(w_down.dtype)


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


class MLP(FeedForward):
  """Two-matrix FFN."""

  gated = False


class GatedMLP(FeedForward):
  """Three-matrix gated FFN."""

  gated = True


class ReLU(MLP):
  """FFN_ReLU (Shazeer 2020, eq. 1)."""

  activation = staticmethod(jax.nn.relu)


class ReLUSquared(MLP):
  """FFN with a squared ReLU, max(0, x)² (So et al. 2021, "Primer", sec. 3 and Fig. 2: ahead of
  GELU at equal parameters; modded-nanogpt's FFN)."""

  activation = staticmethod(lambda x: jnp.square(jax.nn.relu(x)))
  hf_activations = ('relu2',)


class GELU(MLP):
  """FFN_GELU (Shazeer 2020, eq. 2)."""

  activation = staticmethod(gelu)
  hf_activations = ('gelu',)


class GELUTanh(MLP):
  """FFN_GELU with GELU's tanh approximation (Hendrycks & Gimpel 2016, sec. 2; GPT-2)."""

  activation = staticmethod(gelu_tanh)
  hf_activations = ('gelu_new', 'gelu_pytorch_tanh')


class Swish(MLP):
  """FFN_Swish with β = 1, i.e. SiLU (Shazeer 2020, eq. 3)."""

  activation = staticmethod(jax.nn.silu)


class GLU(GatedMLP):
  """FFN_GLU: sigmoid gate (Dauphin et al. 2017; Shazeer 2020, eq. 5)."""

  activation = staticmethod(jax.nn.sigmoid)


class Bilinear(GatedMLP):
  """FFN_Bilinear: no activation on the gate (Shazeer 2020, eq. 5)."""

  activation = staticmethod(lambda x: x)


class GEGLU(GatedMLP):
  """FFN_GEGLU: GELU gate (Shazeer 2020, eq. 6)."""

  activation = staticmethod(gelu)


class GEGLUTanh(GatedMLP):
  """FFN_GEGLU with GELU's tanh approximation on the gate (Gemma, Gemma 2: gelu_pytorch_tanh)."""

  activation = staticmethod(gelu_tanh)
  hf_activations = ('gelu_pytorch_tanh',)


class SwiGLU(GatedMLP):
  """FFN_SwiGLU: Swish gate (Shazeer 2020, eq. 6; Llama, Mistral, Qwen)."""

  activation = staticmethod(jax.nn.silu)
  hf_activations = ('silu',)


class ReGLU(GatedMLP):
  """FFN_ReGLU: ReLU gate (Shazeer 2020, eq. 5)."""

  activation = staticmethod(jax.nn.relu)


def _clamped_swiglu_hidden(pre_gate, pre_up, *, alpha: float, limit: float):
  gate = jnp.minimum(pre_gate, limit)
  up = jnp.clip(pre_up, -limit, limit)
  return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


class ClampedSwiGLU(GatedMLP):
  """gpt-oss's SwiGLU (OpenAI 2025, arXiv 2508.10925; its reference code and transformers'
  GptOssExperts): h = (clip(u, −L, L) + 1) ⊗ g·σ(α·g) with g = min(gate, L), u the up projection;
  the +1 makes the up path a residual around 1, the clamps bound both."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    alpha: float = setting(1.702, 'α of the gate g·σ(α·g) (1.702: the sigmoid GELU)', positive)
    limit: float = setting(7.0, 'L: the gate clipped above at L, the up path to [−L, L]', positive)

  @classmethod
  def hidden_with(cls, settings):
    s = settings or cls.Settings()
    return functools.partial(_clamped_swiglu_hidden, alpha=s.alpha, limit=s.limit)


# The FFN kinds; mllm/layers/moe.py adds 'moe' (`MoE`, whose experts are any of these).
FFNS: dict[str, type[nnx.Module]] = {
  'relu': ReLU,
  'relu2': ReLUSquared,
  'gelu': GELU,
  'gelu_tanh': GELUTanh,
  'swish': Swish,
  'glu': GLU,
  'bilinear': Bilinear,
  'geglu': GEGLU,
  'geglu_tanh': GEGLUTanh,
  'swiglu': SwiGLU,
  'reglu': ReGLU,
  'clamped_swiglu': ClampedSwiGLU,
}


class _DenseFFNs(Mapping):
  """FFNS without the kinds built of experts (mllm/layers/moe.py registers 'moe'): what an
  expert may be. A live view, so a variant registered later is one too."""

  def _dense(self):
    return {k: v for k, v in FFNS.items() if not getattr(v, 'holds_experts', False)}

  def __getitem__(self, kind: str):
    return self._dense()[kind]

  def __iter__(self):
    return iter(self._dense())

  def __len__(self) -> int:
    return len(self._dense())


DENSE_FFNS = _DenseFFNs()


def hidden_dim(ffn_cfg, d_model: int, kind: str | None = None) -> int:
  """The hidden size of an FFN of `kind` (default `ffn_cfg.kind`): d_ff (default 4·d_model), times
  2/3 for a gated FFN with match_params, rounded to the nearest multiple of `multiple_of`."""
  return _hidden_size(ffn_cfg, d_model, FFNS[kind or ffn_cfg.kind].gated)


def _hidden_size(ffn_cfg, d_model: int, gated: bool) -> int:
  d_ff = ffn_cfg.d_ff if ffn_cfg.d_ff is not None else 4 * d_model
  if gated and ffn_cfg.match_params:
    m = ffn_cfg.multiple_of
    d_ff = max(m, m * round(2 * d_ff / 3 / m))
  return d_ff


def check_ffn_config(m, p: str = 'model') -> None:
  """`model.ffn`: a registered kind (read now: a registry may have grown since import) with its
  section's keys, no other kind's key off its default, the sizes, then the kind's own rules."""
  check_variant_keys(m.ffn, f'{p}.ffn', FFNS, 'FFN')
  integer(f'{p}.ffn.d_ff', m.ffn.d_ff, optional=True)
  integer(f'{p}.ffn.multiple_of', m.ffn.multiple_of)
  check = getattr(FFNS[m.ffn.kind], 'check', None)
  if check is not None:
    check(m, p)
