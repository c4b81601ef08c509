"""Initialisation schemes (`model.init`, mllm/layers/parametrization.py): every parameter's empirical std
against the scheme's formula, computed here independently in float64; the config refusals; every
named config builds under every scheme; the jitted normal initializer (mllm/layers/initializers.py)
draws jax's values bit for bit, one program per shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import mllm
from mllm import ConfigError
from mllm.layers.parametrization import INIT_SCHEMES

CONFIGS = Path(__file__).resolve().parents[1] / 'configs'
SCHEMES = ('fixed', 'fan_in', 'small_init')

# Wide enough that every matrix has >= 2,000 entries (the router and T5 table: >= 512), so a
# wrong std shows beyond the sampling error. d_ff and the experts' sizes are set explicitly
# (match_params off), so the fan-ins below do not depend on mllm's sizing code.
# Every fan-in differs from d_model (n_heads·head_dim too), so a wrong one shows.
D, LAYERS, HEADS, HEAD_DIM, D_FF, EXPERT_D_FF, SHARED_D_FF = 64, 3, 4, 32, 192, 48, 128
SMALL = dict(
  model__vocab_size=512,
  model__d_model=D,
  model__n_layers=LAYERS,
  model__n_heads=HEADS,
  model__n_kv_heads=HEADS,
  model__head_dim=HEAD_DIM,
  model__max_seq_len=64,
  data__seq_len=64,
  model__ffn__d_ff=D_FF,
  model__ffn__match_params=False,
)
CASES = {
  'dense': ('', {}),
  'learned_untied_gelu_biases': (
    'pos=learned,ffn=gelu',
    dict(model__tie_embeddings=False, model__attention__use_bias=True, model__ffn__use_bias=True),
  ),
  'shaw': ('pos=shaw', dict(model__position__shaw__max_distance=63)),
  't5_layernorm': (
    'pos=t5,norm=layernorm',
    dict(model__position__t5__num_buckets=256, model__position__t5__max_distance=512),
  ),
  'moe': (
    '',
    dict(
      model__ffn__kind='moe',
      model__ffn__moe__num_experts=8,
      model__ffn__moe__every=2,
      model__ffn__moe__expert_d_ff=EXPERT_D_FF,
      model__ffn__moe__num_shared_experts=1,
      model__ffn__moe__shared_d_ff=SHARED_D_FF,
      model__ffn__moe__noise='noisy_topk',
    ),
  ),
  'no_depth_scaling': ('', dict(model__depth_scaled_init=False)),
}

# Parameter name (after blocks.i.) → (role, fan-in). Biases are zero, norm scales one.
MATRICES = {
  'attention.query.kernel': ('in', D),
  'attention.key.kernel': ('in', D),
  'attention.value.kernel': ('in', D),
  'attention.out.kernel': ('out', HEADS * HEAD_DIM),
  'attention.relative.key': ('table', None),
  'attention.relative.value': ('table', None),
  'ffn.gate.kernel': ('in', D),
  'ffn.up.kernel': ('in', D),
  'ffn.down.kernel': ('out', D_FF),
  'ffn.router': ('in', D),
  'ffn.experts.gate': ('in', D),
  'ffn.experts.up': ('in', D),
  'ffn.experts.down': ('out', EXPERT_D_FF),
  'ffn.shared.gate': ('in', D),
  'ffn.shared.up': ('in', D),
  'ffn.shared.down': ('out', SHARED_D_FF),
}
TABLES = ('embed.embedding', 'head.kernel')


def scheme_std(
  scheme: str, role: str, fan_in: int | None, *, init_std=0.02, depth_scaled=True
) -> float:
  """The formulas of the task, in float64: fixed N(0, init_std) (GPT-2); fan_in 1/√fan_in, tables
  1/√d_model (LeCun); small_init √(2/(5d)) (Nguyen & Salazar 2019); outputs / √(2L)."""
  d = np.float64(D)
  std = {
    'fixed': np.float64(init_std),
    'fan_in': 1 / np.sqrt(d if role == 'table' else np.float64(fan_in)),
    'small_init': np.sqrt(2 / (5 * d)),
  }[scheme]
  if role == 'out' and depth_scaled:
    std = std / np.sqrt(np.float64(2 * LAYERS))
  return float(std)


def expected(name: str, scheme: str, cfg) -> float | str:
  """A parameter's std, or 'zero' / 'one' for those no scheme draws."""
  short = name.split('.', 2)[2] if name.startswith('blocks.') else name
  if name == 'position.table':
    if cfg.model.position.kind == 't5':
      return float(1 / np.sqrt(np.float64(D)))  # HF T5's, under every scheme
    return scheme_std(scheme, 'table', None, init_std=cfg.model.init_std)
  if short == 'ffn.noise_router' or name.endswith('.bias'):
    return 'zero'
  if name.endswith('norm.scale'):
    return 'one'
  role, fan_in = ('table', None) if short in TABLES else MATRICES[short]
  return scheme_std(
    scheme, role, fan_in, init_std=cfg.model.init_std, depth_scaled=cfg.model.depth_scaled_init
  )


def check_stds(model, scheme: str, cfg) -> int:
  """Every parameter against `expected`; the number of drawn ones checked."""
  drawn = 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name = '.'.join(map(str, path))
    x = np.asarray(var[...], np.float64)
    want = expected(name, scheme, cfg)
    if want == 'zero':
      assert not x.any(), name
    elif want == 'one':
      assert (x == 1).all(), name
    else:
      # The mean is 0, so the RMS is the sample std; its relative standard error is √(1/(2n)).
      got = np.sqrt(np.mean(x * x))
      tolerance = 5 * np.sqrt(1 / (2 * x.size))
      assert abs(got / want - 1) < tolerance, (name, x.shape, got, want)
      drawn += 1
  return drawn


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('scheme', SCHEMES)
def test_every_weight_has_the_std_of_its_scheme(scheme, case):
  choices, overrides = CASES[case]
  cfg = tiny_config(choices, **SMALL, **overrides, model__init=scheme)
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  assert check_stds(model, scheme, cfg) >= 6 * LAYERS


def test_fixed_reads_init_std():
  cfg = tiny_config(**SMALL, model__init='fixed', model__init_std=0.05)
  assert check_stds(mllm.build_model(cfg, rngs=nnx.Rngs(0)), 'fixed', cfg)


def test_the_schemes_differ_at_small_width():
  """At d_model 64 the three give distinct stds for an input matrix (the point of the choice)."""
  stds = {scheme_std(s, 'in', D) for s in SCHEMES}
  assert len(stds) == 3


def test_registry_is_what_the_config_allows():
  assert tuple(INIT_SCHEMES) == SCHEMES


def _config_error(overrides) -> str:
  with pytest.raises(ConfigError) as info:
    tiny_config(**overrides)
  msg = str(info.value)
  assert '\n' not in msg, msg
  return msg


def test_unknown_scheme_is_refused():
  msg = _config_error({'model.init': 'xavier'})
  assert msg.startswith("model.init='xavier': ")
  for scheme in SCHEMES:
    assert scheme in msg


@pytest.mark.parametrize('scheme', ['fan_in', 'small_init'])
def test_init_std_with_another_scheme_is_refused(scheme):
  msg = _config_error({'model.init': scheme, 'model.init_std': 0.05})
  assert msg.startswith('model.init_std=0.05: ')
  assert "read only by model.init='fixed'" in msg and repr(scheme) in msg


@pytest.mark.parametrize('scheme', SCHEMES)
def test_default_init_std_is_accepted_by_every_scheme(scheme):
  assert tiny_config(model__init=scheme).model.init == scheme


@pytest.mark.parametrize('scheme', SCHEMES)
@pytest.mark.parametrize(
  'name', sorted(p.stem for p in CONFIGS.glob('*.py') if p.stem != '__init__')
)
def test_every_named_config_builds_under_every_scheme(name, scheme):
  cfg = mllm.load_config(str(CONFIGS / f'{name}.py'), {'model.init': scheme})
  abstract = nnx.eval_shape(lambda: mllm.build_model(cfg, rngs=nnx.Rngs(0)))
  assert nnx.state(abstract, nnx.Param)


# --- mllm/layers/initializers.py: jax's normal initializer, one program per shape -----------------


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_the_jitted_normal_draws_jaxs_values_bit_for_bit_eagerly_and_in_a_trace(dtype):
  import jax
  import jax.numpy as jnp

  from mllm.layers import initializers

  key, std, dtype = jax.random.key(7), 0.0123, jnp.dtype(dtype)
  bits = np.uint16 if dtype.itemsize == 2 else np.uint32
  for shape in [(48, 16), (5, 3, 8), (33,)]:
    want = np.asarray(jax.nn.initializers.normal(std)(key, shape, dtype))  # jax's, eagerly
    eager = np.asarray(initializers.normal(std)(key, shape, dtype))
    traced = np.asarray(jax.jit(lambda k, s=shape: initializers.normal(std)(k, s, dtype))(key))
    assert want.dtype == eager.dtype == traced.dtype == dtype
    for got in (eager, traced):
      np.testing.assert_array_equal(got.view(bits), want.view(bits))
  # the draws are the std asked for (float64 over 10^5 values: a wrong scale shows)
  big = np.asarray(initializers.normal(std)(key, (100_000,), jnp.float32), np.float64)
  assert abs(big.std() / std - 1) < 0.01 and abs(big.mean()) < 0.01 * std


def test_the_normal_initializer_compiles_one_program_per_new_shape():
  import jax

  from mllm.layers import initializers

  keys = list(jax.random.split(jax.random.key(1)))  # indexed here: indexing builds programs too
  programs = []
  listener = lambda event, secs, **_: programs.append(event)  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:  # a shape and std no other test draws (a program in memory already would not count)
    initializers.normal(0.0271)(keys[0], (7, 11, 3))
    first = programs.count('/jax/core/compile/backend_compile_duration')
    initializers.normal(0.0271)(keys[1], (7, 11, 3))  # the same shape and std: no new program
    again = programs.count('/jax/core/compile/backend_compile_duration') - first
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert first == 1 and again == 0, (first, again)
