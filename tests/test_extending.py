"""Adding a variant touches no library file: a position scheme with a parameter of its own and an
FFN, defined and registered here, are configured, validated, trained and summarised like the
built-in ones (docs/extending.md walks through the same example)."""

from __future__ import annotations

import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from rich.console import Console

import mllm
from mllm.layers.ffn import FFNS, MLP, GatedMLP
from mllm.layers.positions import POSITIONS, PositionScheme, sinusoidal_embedding
from mllm.summary import layer_table
from mllm.train.step import benchmark_step
from mllm.variant_config import setting, settings_of


def _positive(name, value):
  if not value > 0:
    raise mllm.ConfigError(name, value, 'the starting scale must be > 0')


class ScaledSinusoidal(PositionScheme):
  """Sinusoids times one learned scalar, started at init/√d_model, added to the embedding."""

  @dataclasses.dataclass(frozen=True)
  class Settings:  # its own config section: model.position.scaled_sinusoidal.init
    init: float = setting(1.0, 'the scale starts at init/√d_model', _positive)

  def __init__(self, cfg, *, rngs):
    del rngs
    init = settings_of(self, cfg.position).init
    self.scale = nnx.Param(jnp.full((), init * cfg.d_model**-0.5, cfg.param_dtype))

  def embed(self, x_BTD, positions_BT):
    waves = sinusoidal_embedding(positions_BT, x_BTD.shape[-1])
    return x_BTD + (self.scale[...] * waves).astype(x_BTD.dtype)

  @classmethod
  def check(cls, m, p):
    if m.d_model % 4:
      raise mllm.ConfigError(f'{p}.d_model', m.d_model, 'scaled sinusoids need a multiple of 4')

  @classmethod
  def describe(cls, m):
    return f'scaled sinusoids (d={m.d_model})'


class SquaredReLU(MLP):
  """Primer's FFN: max(0, x)² (So et al. 2021, sec. 4)."""

  activation = staticmethod(lambda x: jnp.square(jax.nn.relu(x)))


@pytest.fixture
def registered(monkeypatch):
  monkeypatch.setitem(POSITIONS, 'scaled_sinusoidal', ScaledSinusoidal)
  monkeypatch.setitem(FFNS, 'relu2', SquaredReLU)


def test_a_new_position_scheme_and_ffn_validate_train_and_summarise(registered):
  config = tiny_config('pos=scaled_sinusoidal,ffn=relu2')
  with pytest.raises(mllm.ConfigError, match='scaled sinusoids need a multiple of 4'):
    tiny_config('pos=scaled_sinusoidal', model__d_model=18, model__n_heads=2, model__n_kv_heads=1)
  with pytest.raises(mllm.ConfigError, match=r'unknown FFN; allowed: .*relu2'):
    tiny_config('ffn=relu3')

  # Its section, in the schema since it registered: its key set by a unique tail of its dotted
  # path, range-checked by its rule where the scheme is chosen, refused where it is not (it would
  # do nothing there), and reset when another scheme is chosen after it.
  assert config.model.position.scaled_sinusoidal.init == 1.0
  doubled = tiny_config('pos=scaled_sinusoidal,scaled_sinusoidal.init=2.0')
  model = mllm.build_model(doubled, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(float(model.position.scale[...]), 2.0 / 16**0.5, rtol=1e-6)
  with pytest.raises(
    mllm.ConfigError, match=r'model\.position\.scaled_sinusoidal\.init=-1\.0: the starting scale'
  ):
    tiny_config('pos=scaled_sinusoidal', model__position__scaled_sinusoidal__init=-1.0)
  with pytest.raises(
    mllm.ConfigError, match=r"init=2\.0: read only by model\.position\.kind='scaled_sinusoidal'"
  ):
    tiny_config('pos=rope', model__position__scaled_sinusoidal__init=2.0)
  assert (
    tiny_config('scaled_sinusoidal.init=2.0,pos=rope').model.position.scaled_sinusoidal.init == 1
  )

  step, state, batch = benchmark_step(config)
  before = float(state['params']['position']['scale'][...])  # the step donates `state`
  state, metrics = step(state, batch)
  assert np.isfinite(float(metrics['loss']))
  assert float(state['params']['position']['scale'][...]) != before  # the scheme's parameter trains

  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  out = io.StringIO()
  Console(file=out, width=200).print(layer_table(config, model))
  assert 'scaled sinusoids (d=16)' in out.getvalue()
  assert 'relu2' in out.getvalue()


def test_the_new_ffn_computes_its_activation(registered):
  """The registered FFN runs its own activation: down(relu(up(x))²) against NumPy."""
  ffn = FFNS['relu2'](8, 16, use_bias=False, init_std=0.5, out_std=0.5, rngs=nnx.Rngs(0))
  x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
  up, down = np.asarray(ffn.up.kernel[...]), np.asarray(ffn.down.kernel[...])
  want = np.square(np.maximum(x.astype(np.float64) @ up, 0)) @ down
  np.testing.assert_allclose(np.asarray(ffn(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# A gated FFN with a parameter of its own, a position scheme with two, and an MoE whose experts
# are that FFN: each defined and registered here, no library file changed.
# ---------------------------------------------------------------------------------------------


class SwishBetaGLU(GatedMLP):
  """A gated FFN whose gate is Swish_β(x) = x·σ(βx) (Shazeer 2020, eq. 6, with Ramachandran et
  al.'s β; β = 1 is SwiGLU)."""

  @dataclasses.dataclass(frozen=True)
  class Settings:  # its section: model.ffn.swish_beta_glu
    beta: float = setting(1.0, 'β of the gate x·σ(βx)', _positive)

  @staticmethod
  def activation(x, beta=1.0):
    return x * jax.nn.sigmoid(beta * x)


class BasedSinusoids(PositionScheme):
  """scale · PE(pos) with a wavelength base of its own (Vaswani et al. 2017, sec. 3.5: 10000)."""

  @dataclasses.dataclass(frozen=True)
  class Settings:  # its section: model.position.based_sinusoids
    base: float = setting(10000.0, 'the wavelength base', _positive)
    scale: float = setting(1.0, 'the sinusoids are multiplied by it', _positive)

  def __init__(self, cfg, *, rngs):
    del rngs
    self.settings = settings_of(type(self), cfg.position)

  def embed(self, x_BTD, positions_BT):
    d = x_BTD.shape[-1]
    inv_freq = 1.0 / self.settings.base ** (jnp.arange(0, d, 2) / d)
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    waves = jnp.stack([jnp.sin(angles), jnp.cos(angles)], -1).reshape(*positions_BT.shape, d)
    return x_BTD + (self.settings.scale * waves).astype(x_BTD.dtype)


@pytest.fixture
def registered_more(monkeypatch):
  monkeypatch.setitem(FFNS, 'swish_beta_glu', SwishBetaGLU)
  monkeypatch.setitem(POSITIONS, 'based_sinusoids', BasedSinusoids)


def _swish_beta_glu(x, gate, up, down, beta):
  """float64 NumPy: down((x·gate)·σ(β·x·gate) ⊙ x·up)."""
  g = x.astype(np.float64) @ gate
  return (g / (1 + np.exp(-beta * g)) * (x.astype(np.float64) @ up)) @ down


def test_a_gated_ffn_with_a_parameter_of_its_own(registered_more):
  config = tiny_config('ffn=swish_beta_glu,ffn.swish_beta_glu.beta=2.0')
  assert config.model.ffn.swish_beta_glu.beta == 2.0
  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  ffn = model.blocks[0].ffn
  x = np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)
  weights = [np.asarray(w.kernel[...], np.float64) for w in (ffn.gate, ffn.up, ffn.down)]
  want = _swish_beta_glu(x, *weights, beta=2.0)
  np.testing.assert_allclose(np.asarray(ffn(jnp.asarray(x))), want, rtol=2e-5, atol=2e-5)
  assert not np.allclose(want, _swish_beta_glu(x, *weights, beta=1.0), atol=1e-3)  # β matters
  with pytest.raises(mllm.ConfigError, match=r'swish_beta_glu\.beta=-1\.0: the starting scale'):
    tiny_config('ffn=swish_beta_glu,ffn.swish_beta_glu.beta=-1.0')
  with pytest.raises(mllm.ConfigError, match=r"read only by model\.ffn\.kind='swish_beta_glu'"):
    tiny_config('ffn=swiglu,ffn.swish_beta_glu.beta=2.0')
  step, state, batch = benchmark_step(config)
  assert np.isfinite(float(step(state, batch)[1]['loss']))


def test_a_position_scheme_with_two_parameters(registered_more):
  config = tiny_config('pos=based_sinusoids,based_sinusoids.base=100.0,based_sinusoids.scale=0.5')
  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  positions = np.arange(5)[None]
  got = np.asarray(model.position.embed(jnp.zeros((1, 5, 16)), jnp.asarray(positions)))
  angles = positions[..., None] * (1.0 / 100.0 ** (np.arange(0, 16, 2) / 16))
  want = 0.5 * np.stack([np.sin(angles), np.cos(angles)], -1).reshape(1, 5, 16)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  with pytest.raises(mllm.ConfigError, match=r"read only by model\.position\.kind='based_sinu"):
    tiny_config('pos=rope,based_sinusoids.scale=2.0')
  step, state, batch = benchmark_step(config)
  assert np.isfinite(float(step(state, batch)[1]['loss']))


def test_an_moe_whose_experts_are_the_new_ffn(registered_more):
  """`model.ffn.moe.expert` chooses the experts' FFN with its own settings: each expert computes
  Swish_β with the configured β."""
  config = tiny_config(
    'ffn=moe',
    model__ffn__moe__expert__kind='swish_beta_glu',
    model__ffn__moe__expert__swish_beta_glu__beta=3.0,
    model__ffn__moe__num_experts=2,
  )
  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  experts = model.blocks[0].ffn.experts
  x = np.random.default_rng(1).standard_normal((2, 4, 16)).astype(np.float32)  # [E, C, D]
  got = np.asarray(experts.grouped(jnp.asarray(x)))
  for e in range(2):
    weights = [np.asarray(w[...][e], np.float64) for w in (experts.gate, experts.up, experts.down)]
    np.testing.assert_allclose(
      got[e], _swish_beta_glu(x[e], *weights, beta=3.0), rtol=2e-5, atol=2e-5
    )
  with pytest.raises(mllm.ConfigError, match=r"read only by model\.ffn\.moe\.expert\.kind='swish"):
    tiny_config('ffn=moe', model__ffn__moe__expert__swish_beta_glu__beta=3.0)
  step, state, batch = benchmark_step(config)
  assert np.isfinite(float(step(state, batch)[1]['loss']))
