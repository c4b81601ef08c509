"""Tests for the config system: mllm.load_config, choices, overrides, validation, parse_value,
config_diff and build_model's validate-first contract."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from ml_collections import config_dict

import mllm
from mllm import ConfigError
from mllm import model as model_lib
from mllm.config import RunConfig, config_diff
from mllm.config_keys import CHOICES, flatten, get_path, parse_value
from mllm.layers.ffn import FFNS
from mllm.layers.norms import NORMS, PLACEMENTS
from mllm.layers.positions import POSITIONS, ROPE_LAYOUTS, ROPE_SCALINGS
from mllm.ops.attention import ATTENTION_IMPLS
from mllm.validation import DTYPES, validate

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / 'configs'
NAMED = ('base', 'rope_swiglu', 'gpt2', 'mistral_like', 'alibi_gelu', 'qwen3_like', 'mixtral_like')


def spec(name: str, arg: str | None = None) -> str:
  """An absolute `--config=` spec, so the tests do not depend on the working directory."""
  path = str(CONFIGS / f'{name}.py')
  return path if arg is None else f'{path}:{arg}'


def load(name: str = 'base', arg: str | None = None, overrides=None):
  return mllm.load_config(spec(name, arg), overrides)


def check_error(err: BaseException, key: str, value, allowed=()) -> str:
  """The ConfigError contract: exact type, one line, names the key, the value and what is allowed."""
  assert type(err) is ConfigError, f'{type(err).__name__}: {err}'
  assert isinstance(err, ValueError)
  msg = str(err)
  assert '\n' not in msg and '\r' not in msg, msg
  assert msg.startswith(f'{key}='), msg
  assert f'{key}={value!r}' in msg, msg
  assert err.key == key
  assert err.value == value or (value != value and err.value != err.value)
  for text in allowed:
    assert text in msg, f'{text!r} not in {msg!r}'
  return msg


def raises_config_error(fn, *args, **kwargs) -> ConfigError:
  """Run fn and return the exception; fails (not errors) if it is not exactly a ConfigError."""
  try:
    fn(*args, **kwargs)
  except Exception as err:
    assert type(err) is ConfigError, f'expected ConfigError, got {type(err).__name__}: {err}'
    return err
  pytest.fail('no ConfigError raised')


# --------------------------------------------------------------------------------------------
# 1. Named configs.
# --------------------------------------------------------------------------------------------

EXPECTED = {
  'base': {
    'model.position.kind': 'rope',
    'model.ffn.kind': 'swiglu',
    'model.norm.kind': 'rmsnorm',
    'model.norm.placement': 'pre',
    'model.n_heads': 8,
    'model.n_kv_heads': 8,
    'model.attention.sliding_window': None,
    'model.attention.impl': 'auto',
  },
  'rope_swiglu': {
    'model.position.kind': 'rope',
    'model.ffn.kind': 'swiglu',
    'model.norm.kind': 'rmsnorm',
    'model.norm.placement': 'pre',
    'model.n_heads': 8,
    'model.n_kv_heads': 2,
    'model.attention.sliding_window': None,
  },
  'gpt2': {
    'model.position.kind': 'learned',
    'model.ffn.kind': 'gelu',
    'model.norm.kind': 'layernorm',
    'model.norm.placement': 'pre',
    'model.ffn.use_bias': True,
    'model.attention.use_bias': True,
    'model.norm.eps': 1e-5,
    'model.n_kv_heads': 8,
    'train.learning_rate': 1.5e-3,
  },
  'mistral_like': {
    'model.position.kind': 'rope',
    'model.ffn.kind': 'swiglu',
    'model.norm.kind': 'rmsnorm',
    'model.norm.placement': 'pre',
    'model.n_heads': 8,
    'model.n_kv_heads': 2,
    'model.attention.sliding_window': 64,
    'model.norm.eps': 1e-5,
  },
  'alibi_gelu': {
    'model.position.kind': 'alibi',
    'model.ffn.kind': 'gelu',
    'model.norm.kind': 'layernorm',
    'model.norm.placement': 'pre',
    'train.learning_rate': 1.5e-3,
  },
  'qwen3_like': {
    'model.position.kind': 'rope',
    'model.ffn.kind': 'swiglu',
    'model.norm.kind': 'rmsnorm',
    'model.norm.placement': 'pre',
    'model.n_heads': 8,
    'model.n_kv_heads': 2,
    'model.attention.qk_norm': True,
    'model.position.rope.theta': 1e6,
  },
  'mixtral_like': {
    'model.position.kind': 'rope',
    'model.ffn.kind': 'moe',
    'model.ffn.moe.num_experts': 8,
    'model.ffn.moe.top_k': 2,
    'model.ffn.moe.expert.kind': 'swiglu',
    'model.ffn.moe.renormalize': True,
    'model.n_kv_heads': 2,
    'model.attention.sliding_window': 64,
    'model.norm.eps': 1e-5,
    'train.learning_rate': 1.5e-3,
  },
}


def test_every_named_config_is_tested():
  assert sorted(p.stem for p in CONFIGS.glob('*.py') if p.stem != '__init__') == sorted(NAMED)


@pytest.mark.parametrize('name', NAMED)
def test_named_config_documented_choices(name):
  cfg = load(name)
  assert isinstance(cfg, config_dict.ConfigDict)
  for path, expected in EXPECTED[name].items():
    assert get_path(cfg, path) == expected, path
  validate(cfg)  # already valid: re-validating is a no-op


@pytest.mark.parametrize('name', NAMED)
def test_named_config_is_frozen(name):
  cfg = load(name)
  assert isinstance(cfg, RunConfig)
  for section in (cfg, cfg.model, cfg.model.attention, cfg.model.position.rope):
    with pytest.raises(AttributeError, match='immutable'):
      section.new_key = 1
    with pytest.raises(AttributeError, match='immutable'):
      section['new_key'] = 1
  with pytest.raises(AttributeError, match='immutable'):
    cfg.model.n_layers = 1  # a key it has cannot change either
  assert 'new_key' not in cfg and 'new_key' not in cfg.model


@pytest.mark.parametrize('name', ['rope_swiglu', 'mistral_like', 'qwen3_like', 'mixtral_like'])
def test_gqa_configs_have_fewer_kv_heads(name):
  cfg = load(name)
  assert cfg.model.n_kv_heads < cfg.model.n_heads
  assert cfg.model.n_heads % cfg.model.n_kv_heads == 0


def test_loads_are_independent():
  a = load('rope_swiglu')
  b = mllm.load_config(a, {'model.n_layers': 1})  # a new config from a loaded one
  assert (a.model.n_layers, b.model.n_layers) == (4, 1)
  assert load('rope_swiglu').model.n_layers == 4
  err = raises_config_error(mllm.load_config, a, {'model.n_kv_heads': 3})  # validated again
  check_error(err, 'model.n_kv_heads', 3)


def test_relative_spec_from_repo_root(monkeypatch):
  monkeypatch.chdir(ROOT)
  cfg = mllm.load_config('configs/gpt2.py:model.n_layers=2')
  assert cfg.model.position.kind == 'learned' and cfg.model.n_layers == 2


# --------------------------------------------------------------------------------------------
# 2. Choices and overrides.
# --------------------------------------------------------------------------------------------


def test_short_choice_names_set_their_keys():
  cfg = load('base', 'pos=alibi,ffn=geglu,norm=layernorm,placement=post')
  assert cfg.model.position.kind == 'alibi'
  assert cfg.model.ffn.kind == 'geglu'
  assert cfg.model.norm.kind == 'layernorm'
  assert cfg.model.norm.placement == 'post'
  # Nothing else changed.
  assert set(config_diff(cfg, load('base'))) == {
    'model.position.kind',
    'model.ffn.kind',
    'model.norm.kind',
    'model.norm.placement',
  }


def test_other_short_choice_names():
  cfg = load('base', 'attn=xla,window=32,rope_scaling=linear,linear.factor=2.0')
  assert cfg.model.attention.impl == 'xla'
  assert cfg.model.attention.sliding_window == 32
  assert cfg.model.position.rope.scaling.kind == 'linear'
  assert cfg.model.position.rope.scaling.linear.factor == 2.0


def test_choice_aliases_point_at_real_keys():
  cfg = load('base')
  paths = set(flatten(cfg))
  for alias, path in CHOICES.items():
    assert path in paths, (alias, path)


def test_dotted_path_choice():
  cfg = load('base', 'model.n_layers=3')
  assert cfg.model.n_layers == 3 and type(cfg.model.n_layers) is int


def test_unique_leaf_choice():
  cfg = load('base', 'n_kv_heads=2,theta=500000.0,qk_norm=true')
  assert cfg.model.n_kv_heads == 2
  assert cfg.model.position.rope.theta == 500000.0
  assert cfg.model.attention.qk_norm is True


@pytest.mark.parametrize(
  'arg,path,value',
  [
    ('pos=t5,t5.num_buckets=8', 'model.position.t5.num_buckets', 8),
    ('pos=t5,position.t5.num_buckets=8', 'model.position.t5.num_buckets', 8),
    ('pos=shaw,shaw.max_distance=4', 'model.position.shaw.max_distance', 4),
    ('rope.theta=1e6', 'model.position.rope.theta', 1e6),
    ('rope_scaling=yarn,yarn.factor=4.0', 'model.position.rope.scaling.yarn.factor', 4.0),
    (
      'rope_scaling=yarn,scaling.yarn.beta_fast=16.0',
      'model.position.rope.scaling.yarn.beta_fast',
      16.0,
    ),
    ('norm=partial_rmsnorm,partial_rmsnorm.p=0.5', 'model.norm.partial_rmsnorm.p', 0.5),
  ],
)
def test_unique_tail_of_a_dotted_path_choice(arg, path, value):
  """A choice key may be any tail of a dotted path that only one path ends with."""
  cfg = load('base', arg)
  assert get_path(cfg, path) == value
  changed = set(config_diff(cfg, load('base')))
  kinds = {'model.position.kind', 'model.norm.kind', 'model.position.rope.scaling.kind'}
  assert path in changed and changed - kinds == {path}


@pytest.mark.parametrize(
  'arg,key,value,paths',
  [
    (
      'pos=t5,max_distance=8',
      'max_distance',
      8,
      ['model.position.t5.max_distance', 'model.position.shaw.max_distance'],
    ),
    (
      'rope_scaling=yarn,factor=4.0',
      'factor',
      4.0,
      [f'model.position.rope.scaling.{s}.factor' for s in ROPE_SCALINGS if s != 'none'],
    ),
  ],
)
def test_ambiguous_tail_choice_lists_the_candidates(arg, key, value, paths):
  """A tail several paths end with is refused in one line naming them all, not guessed (even where
  only one of them is read, as T5's max_distance is with pos=t5)."""
  err = raises_config_error(load, 'base', arg)
  msg = check_error(err, key, value, ['ambiguous choice key; use one of '])
  assert sorted(msg.split('use one of ')[1].split(', ')) == sorted(paths)


def test_a_tail_must_start_at_a_dot():
  """'um_buckets' is part of a leaf name, not a tail of a dotted path."""
  err = raises_config_error(load, 'base', 'pos=t5,um_buckets=8')
  check_error(err, 'um_buckets', 8, ['unknown choice key'])


def test_none_choice_value_clears_a_placeholder():
  cfg = load('mistral_like', 'window=none')
  assert cfg.model.attention.sliding_window is None


def test_empty_items_and_whitespace_are_ignored():
  cfg = load('base', ' pos = alibi ,, n_layers = 2 ,')
  assert cfg.model.position.kind == 'alibi' and cfg.model.n_layers == 2


def test_later_choices_win():
  assert load('base', 'n_layers=2,n_layers=3').model.n_layers == 3
  assert load('base', 'pos=alibi,pos=t5').model.position.kind == 't5'


@pytest.mark.parametrize(
  'name,arg,path,value',
  [
    ('rope_swiglu', 'n_kv_heads=4', 'model.n_kv_heads', 4),
    ('rope_swiglu', 'ffn=geglu', 'model.ffn.kind', 'geglu'),
    ('gpt2', 'pos=rope', 'model.position.kind', 'rope'),
    ('gpt2', 'model.ffn.use_bias=false', 'model.ffn.use_bias', False),
    ('gpt2', 'train.learning_rate=6e-3', 'train.learning_rate', 6e-3),
    ('mistral_like', 'window=128', 'model.attention.sliding_window', 128),
    ('alibi_gelu', 'norm=rmsnorm', 'model.norm.kind', 'rmsnorm'),
    ('qwen3_like', 'qk_norm=false', 'model.attention.qk_norm', False),
  ],
)
def test_user_arg_overrides_named_defaults(name, arg, path, value):
  cfg = load(name, arg)
  assert get_path(cfg, path) == value
  # The rest of the named config's defaults stay.
  for other, expected in EXPECTED[name].items():
    if other != path:
      assert get_path(cfg, other) == expected, other


def test_overrides_mapping():
  cfg = load('base', overrides={'model.n_layers': 3})
  assert cfg.model.n_layers == 3
  assert isinstance(cfg, RunConfig)


def test_overrides_apply_after_choices():
  cfg = load('rope_swiglu', 'n_layers=2', overrides={'model.n_layers': 3, 'model.n_kv_heads': 1})
  assert cfg.model.n_layers == 3 and cfg.model.n_kv_heads == 1


def test_int_override_of_float_field_is_accepted():
  cfg = load('base', overrides={'model.position.rope.theta': 5})
  assert cfg.model.position.rope.theta == 5.0


# --------------------------------------------------------------------------------------------
# 3. ConfigError cases.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'arg,key,value,allowed',
  [
    ('pos=nope', 'model.position.kind', 'nope', list(POSITIONS)),
    ('ffn=nope', 'model.ffn.kind', 'nope', list(FFNS)),
    ('norm=nope', 'model.norm.kind', 'nope', list(NORMS)),
    ('placement=middle', 'model.norm.placement', 'middle', list(PLACEMENTS)),
    ('attn=flash', 'model.attention.impl', 'flash', list(ATTENTION_IMPLS)),
    ('layout=diagonal', 'model.position.rope.layout', 'diagonal', list(ROPE_LAYOUTS)),
    ('rope_scaling=magic', 'model.position.rope.scaling.kind', 'magic', list(ROPE_SCALINGS)),
    ('dtype=float16', 'model.dtype', 'float16', list(DTYPES)),
    ('param_dtype=float64', 'model.param_dtype', 'float64', list(DTYPES)),
    ('pos=', 'model.position.kind', '', list(POSITIONS)),
  ],
)
def test_unknown_variant_names(arg, key, value, allowed):
  err = raises_config_error(load, 'base', arg)
  msg = check_error(err, key, value, allowed)
  assert 'allowed:' in msg


def test_bad_position_kind_lists_rope():
  err = raises_config_error(load, 'base', 'pos=rotary')
  assert 'rope' in str(err).split('allowed:')[1]


@pytest.mark.parametrize('kind', list(POSITIONS))
def test_every_position_kind_is_accepted(kind):
  cfg = load('base', overrides={'model.position.kind': kind})
  assert cfg.model.position.kind == kind
  if kind != 'none':  # see test_none_named_variant_via_choice
    assert load('base', f'pos={kind}').model.position.kind == kind


@pytest.mark.parametrize('kind', list(FFNS))
def test_every_ffn_is_accepted(kind):
  assert load('base', f'ffn={kind}').model.ffn.kind == kind


@pytest.mark.parametrize('kind', list(NORMS))
@pytest.mark.parametrize('placement', list(PLACEMENTS))
def test_every_norm_and_placement_is_accepted(kind, placement):
  cfg = load('base', overrides={'model.norm.kind': kind, 'model.norm.placement': placement})
  assert (cfg.model.norm.kind, cfg.model.norm.placement) == (kind, placement)
  if kind != 'none':  # see test_none_named_variant_via_choice
    cfg = load('base', f'norm={kind},placement={placement}')
    assert (cfg.model.norm.kind, cfg.model.norm.placement) == (kind, placement)


@pytest.mark.parametrize('scaling', list(ROPE_SCALINGS))
def test_every_rope_scaling_is_accepted(scaling):
  factor = f'model.position.rope.scaling.{scaling}.factor'
  factors = {} if scaling == 'none' else {factor: 2.0}
  cfg = load('base', overrides={'model.position.rope.scaling.kind': scaling, **factors})
  assert cfg.model.position.rope.scaling.kind == scaling
  if scaling != 'none':  # see test_none_named_variant_via_choice
    assert get_path(cfg, factor) == 2.0
    cfg = load('base', f'rope_scaling={scaling},{scaling}.factor=2.0')
    assert cfg.model.position.rope.scaling.kind == scaling
    assert get_path(cfg, factor) == 2.0


@pytest.mark.parametrize('layout', list(ROPE_LAYOUTS))
def test_every_rope_layout_is_accepted(layout):
  assert load('base', f'layout={layout}').model.position.rope.layout == layout


@pytest.mark.parametrize('dtype', list(DTYPES))
def test_every_dtype_is_accepted(dtype):
  cfg = load('base', f'dtype={dtype},param_dtype={dtype}')
  assert cfg.model.dtype == cfg.model.param_dtype == dtype


@pytest.mark.parametrize(
  'n_heads,n_kv_heads,divisors',
  [
    (8, 3, '1, 2, 4, 8'),
    (8, 5, '1, 2, 4, 8'),
    (6, 4, '1, 2, 3, 6'),
    (8, 16, '1, 2, 4, 8'),  # more KV heads than query heads
    (7, 8, '1, 7'),
  ],
)
def test_n_kv_heads_must_divide_n_heads(n_heads, n_kv_heads, divisors):
  d_model = 8 * n_heads  # keep d_model divisible by n_heads and head_dim even
  err = raises_config_error(
    load, 'base', f'd_model={d_model},n_heads={n_heads},n_kv_heads={n_kv_heads}'
  )
  msg = check_error(
    err, 'model.n_kv_heads', n_kv_heads, [f'model.n_heads={n_heads}', f'allowed: {divisors}']
  )
  assert msg.endswith(f'allowed: {divisors}')


@pytest.mark.parametrize('n_kv_heads', [1, 2, 4, 8])
def test_divisor_n_kv_heads_are_accepted(n_kv_heads):
  assert load('base', f'n_kv_heads={n_kv_heads}').model.n_kv_heads == n_kv_heads


def test_n_heads_must_divide_d_model_without_head_dim():
  err = raises_config_error(load, 'base', 'd_model=100,n_heads=8,n_kv_heads=8')
  check_error(
    err,
    'model.n_heads',
    8,
    ['model.d_model=100', 'model.head_dim', '1, 2, 4, 5, 10, 20, 25, 50, 100'],
  )


def test_explicit_head_dim_lifts_the_d_model_divisibility_rule():
  cfg = load('base', 'd_model=100,n_heads=8,n_kv_heads=8,head_dim=16')
  assert cfg.model.head_dim == 16


@pytest.mark.parametrize('arg', ['head_dim=33', 'd_model=264'])  # explicit / derived (264 / 8)
def test_odd_head_dim_with_rope(arg):
  err = raises_config_error(load, 'base', arg)
  check_error(err, 'model.head_dim', 33, ['RoPE', 'even'])


@pytest.mark.parametrize('pos', [k for k in POSITIONS if k != 'rope'])
def test_odd_head_dim_without_rope_is_accepted(pos):
  cfg = load('base', 'head_dim=33', {'model.position.kind': pos})
  assert cfg.model.head_dim == 33


def test_rope_scaling_needs_rope():
  err = raises_config_error(load, 'base', 'pos=alibi,rope_scaling=linear')
  check_error(
    err,
    'model.position.rope.scaling.kind',
    'linear',
    ["model.position.kind='rope'", "'alibi'", "allowed here: its default 'none'"],
  )


@pytest.mark.parametrize('factor', [0.5, 0.0, -2.0])
def test_rope_scaling_factor_below_one(factor):
  err = raises_config_error(load, 'base', f'rope_scaling=linear,linear.factor={factor}')
  check_error(
    err,
    'model.position.rope.scaling.linear.factor',
    factor,
    ['the context extension factor must be >= 1'],
  )


def test_a_choice_only_other_variants_read_must_stay_at_its_default():
  # The scaling it asks for would silently not run.
  err = raises_config_error(load, 'base', 'pos=alibi,rope_scaling=yarn,yarn.factor=2.0')
  check_error(
    err,
    'model.position.rope.scaling.kind',
    'yarn',
    ["read only by model.position.kind='rope'", "allowed here: its default 'none'"],
  )


@pytest.mark.parametrize(
  'arg,key,value,reader',
  [
    ('pos=alibi,rope.theta=5e5', 'rope.theta', 5e5, "kind='rope'"),
    ('pos=rope,t5.num_buckets=1', 't5.num_buckets', 1, "kind='t5'"),
    ('pos=rope,t5.max_distance=1', 't5.max_distance', 1, "kind='t5'"),
    ('pos=t5,shaw.max_distance=3', 'shaw.max_distance', 3, "kind='shaw'"),
    ('yarn.factor=4.0', 'rope.scaling.yarn.factor', 4.0, "rope.scaling.kind='yarn'"),
    ('yarn.factor=0.5', 'rope.scaling.yarn.factor', 0.5, "rope.scaling.kind='yarn'"),
    (
      'rope_scaling=linear,linear.factor=2.0,yarn.beta_slow=40.0',
      'rope.scaling.yarn.beta_slow',
      40.0,
      "rope.scaling.kind='yarn'",
    ),
  ],
)
def test_a_key_of_a_variant_not_chosen_is_refused_naming_the_chosen_ones(arg, key, value, reader):
  """A key another variant reads would do nothing: one line naming it, its reader, and the keys
  the chosen variant reads."""
  err = raises_config_error(load, 'base', arg)
  check_error(err, f'model.position.{key}', value, [f'read only by model.position.{reader}'])
  assert 'reads: ' in str(err)


ROPE_READS = [
  'model.position.rope.theta',
  'model.position.rope.layout',
  'model.position.rope.scaling.kind',
  'model.position.rope.original_max_len',
  'model.position.rope.nope_every',
  'model.position.rope.fraction',
  'model.position.rope.frequencies',
]
YARN_READS = [
  f'model.position.rope.scaling.yarn.{k}'
  for k in ('factor', 'beta_fast', 'beta_slow', 'truncate', 'attention_factor')
]


@pytest.mark.parametrize(
  'arg,key,value,chooser,reads',
  [
    (
      'pos=rope,t5.num_buckets=64',
      'model.position.t5.num_buckets',
      64,
      'model.position.kind',
      ROPE_READS,
    ),
    (
      'rope_scaling=yarn,t5.num_buckets=64',
      'model.position.t5.num_buckets',
      64,
      'model.position.kind',
      ROPE_READS[:3] + YARN_READS + ROPE_READS[3:],
    ),
    (
      'rope_scaling=yarn,linear.factor=2.0',
      'model.position.rope.scaling.linear.factor',
      2.0,
      'model.position.rope.scaling.kind',
      YARN_READS,
    ),
    (
      'pos=t5,shaw.max_distance=3',
      'model.position.shaw.max_distance',
      3,
      'model.position.kind',
      [
        'model.position.t5.num_buckets',
        'model.position.t5.max_distance',
      ],
    ),
  ],
)
def test_the_refusal_lists_only_the_chosen_variants_keys(arg, key, value, chooser, reads):
  """After 'reads: ' the refusal names exactly the keys the chosen variant reads (a chosen RoPE
  scaling's among them), in order, and no key of a variant not chosen."""
  err = raises_config_error(load, 'base', arg)
  msg = check_error(err, key, value, [f"; {chooser}='"])
  listed = msg.split(' reads: ', 1)[1].split(', ')
  assert listed == reads
  for other in ('t5.', 'shaw.', 'scaling.linear.', 'scaling.ntk.', 'scaling.llama3.'):
    if not any(other in r for r in reads):
      assert not any(other in r for r in listed), (other, listed)


def test_the_refusal_with_a_variant_of_no_keys_says_so():
  err = raises_config_error(load, 'base', 'rope_scaling=none,yarn.beta_fast=8.0')
  check_error(
    err,
    'model.position.rope.scaling.yarn.beta_fast',
    8.0,
    [
      "read only by model.position.rope.scaling.kind='yarn' (it is 'none'), so it would do "
      'nothing; allowed here: its default 32.0; '
      "model.position.rope.scaling.kind='none' reads: no keys of its own"
    ],
  )


def test_a_norm_key_and_an_moe_key_off_their_variant_are_refused():
  err = raises_config_error(load, 'base', 'norm=rmsnorm,partial_rmsnorm.p=0.5')
  check_error(
    err,
    'model.norm.partial_rmsnorm.p',
    0.5,
    ["read only by model.norm.kind='partial_rmsnorm'", "model.norm.kind='rmsnorm' reads: no keys"],
  )
  err = raises_config_error(load, 'base', overrides={'model.ffn.moe.num_experts': 4})
  check_error(err, 'model.ffn.moe.num_experts', 4, ["read only by model.ffn.kind='moe'"])


def test_choosing_a_variant_resets_the_keys_of_the_one_it_replaces():
  """A named config's settings of one variant do not follow into an ablation of it: the choice
  resets them (Qwen3's RoPE θ with pos=alibi; a T5 setting once pos moves on; Mixtral's experts
  with ffn=swiglu), while keys set after the choice stay and are checked."""
  qwen = load('qwen3_like')
  assert qwen.model.position.rope.theta == 1e6
  ablated = load('qwen3_like', 'pos=alibi')
  assert ablated.model.position.kind == 'alibi'
  assert ablated.model.position.rope.theta == load('base').model.position.rope.theta
  assert load('base', 'pos=t5,t5.num_buckets=8,pos=rope').model.position.t5.num_buckets == 32
  scaled = load('base', 'rope_scaling=yarn,yarn.factor=4.0,rope_scaling=none')
  assert scaled.model.position.rope.scaling.kind == 'none'
  assert scaled.model.position.rope.scaling.yarn.factor == 1.0
  # A key set after the choice stays, and is checked against the variant chosen.
  kept = load('base', 'rope_scaling=yarn,yarn.factor=4.0')
  assert kept.model.position.rope.scaling.yarn.factor == 4.0
  err = raises_config_error(load, 'qwen3_like', 'pos=alibi,rope.theta=1e6')
  check_error(err, 'model.position.rope.theta', 1e6, ["read only by model.position.kind='rope'"])
  dense = load('mixtral_like', 'ffn=swiglu')
  assert dense.model.ffn.moe.num_experts == load('base').model.ffn.moe.num_experts


def test_rope_scaling_factor_one_is_accepted():
  cfg = load('base', 'rope_scaling=linear,linear.factor=1.0')
  assert cfg.model.position.rope.scaling.linear.factor == 1.0


def test_yarn_betas_must_be_ordered():
  err = raises_config_error(load, 'base', 'rope_scaling=yarn,yarn.factor=2.0,yarn.beta_slow=40.0')
  check_error(
    err,
    'model.position.rope.scaling.yarn.beta_slow',
    40.0,
    ['YaRN needs 0 < beta_slow < beta_fast=32.0'],
  )


def test_llama3_freq_factors_must_be_ordered():
  err = raises_config_error(
    load, 'base', 'rope_scaling=llama3,llama3.factor=2.0,llama3.low_freq_factor=5.0'
  )
  check_error(
    err,
    'model.position.rope.scaling.llama3.low_freq_factor',
    5.0,
    ['llama3 scaling needs 0 < low_freq_factor < high_freq_factor=4.0'],
  )


@pytest.mark.parametrize('p', [0.0, -0.1, 1.5])
def test_partial_p_outside_unit_interval(p):
  err = raises_config_error(load, 'base', f'norm=partial_rmsnorm,partial_rmsnorm.p={p}')
  check_error(err, 'model.norm.partial_rmsnorm.p', p, ['0 < p <= 1'])


@pytest.mark.parametrize('p', [1.0, 1, 0.0625, 1e-3])
def test_partial_p_in_range_is_accepted(p):
  cfg = load('base', f'norm=partial_rmsnorm,partial_rmsnorm.p={p}')
  assert cfg.model.norm.partial_rmsnorm.p == p


@pytest.mark.parametrize(
  'key,value',
  [
    ('model.d_model', 0),
    ('model.n_layers', -1),
    ('model.n_layers', 0),
    ('model.vocab_size', 0),
    ('model.n_heads', 0),
    ('model.n_kv_heads', 0),
    ('model.max_seq_len', 0),
    ('model.n_layers', True),
    ('model.n_layers', None),
  ],
)
def test_sizes_must_be_positive_integers(key, value):
  err = raises_config_error(load, 'base', overrides={key: value})
  check_error(err, key, value, ['positive integer'])


@pytest.mark.parametrize(
  'arg,key,value',
  [
    ('d_model=0', 'model.d_model', 0),
    ('n_layers=-1', 'model.n_layers', -1),
  ],
)
def test_sizes_must_be_positive_via_choices(arg, key, value):
  check_error(raises_config_error(load, 'base', arg), key, value, ['positive integer'])


@pytest.mark.parametrize(
  'key,value',
  [
    ('model.init_std', 0.0),
    ('model.norm.eps', 0.0),
    ('model.attention.softmax_scale', -1.0),
    ('model.position.rope.theta', 0.0),
  ],
)
def test_positive_numbers(key, value):
  err = raises_config_error(load, 'base', overrides={key: value})
  check_error(err, key, value, ['must be a positive number'])


@pytest.mark.parametrize(
  'key,value',
  [
    ('model.head_dim', 0),
    ('model.head_dim', -2),
    ('model.ffn.d_ff', 0),
    ('model.ffn.multiple_of', 0),
    ('model.attention.sliding_window', 0),
    ('data.seq_len', 0),
    ('data.batch_size', 0),
  ],
)
def test_positive_integers(key, value):
  err = raises_config_error(load, 'base', overrides={key: value})
  check_error(err, key, value, ['must be a positive integer'])


@pytest.mark.parametrize('key', ['model.dropout', 'model.embed_dropout', 'model.attention.dropout'])
@pytest.mark.parametrize('rate', [1.0, -0.1, 1.5])
def test_dropout_rate_range(key, rate):
  err = raises_config_error(load, 'base', f'{key}={rate}')
  check_error(err, key, rate, ['[0, 1)'])


@pytest.mark.parametrize('rate', [0.0, 0.1, 0.99])
def test_dropout_rate_in_range_is_accepted(rate):
  assert load('base', f'model.dropout={rate}').model.dropout == rate


@pytest.mark.parametrize('window', [0, -4])
def test_sliding_window_must_be_positive(window):
  err = raises_config_error(load, 'base', f'window={window}')
  check_error(err, 'model.attention.sliding_window', window, ['positive', 'None'])


@pytest.mark.parametrize('max_distance', [16, 8, 0])
def test_t5_max_distance_must_exceed_exact_buckets(max_distance):
  err = raises_config_error(load, 'base', f'pos=t5,t5.max_distance={max_distance}')
  check_error(
    err,
    'model.position.t5.max_distance',
    max_distance,
    ['must exceed num_buckets // 2 = 16, where the exact buckets end'],
  )


def test_t5_max_distance_just_above_exact_buckets_is_accepted():
  assert load('base', 'pos=t5,t5.max_distance=17').model.position.t5.max_distance == 17


@pytest.mark.parametrize('buckets', [1, 0])
def test_t5_num_buckets_at_least_two(buckets):
  err = raises_config_error(load, 'base', f'pos=t5,t5.num_buckets={buckets}')
  check_error(err, 'model.position.t5.num_buckets', buckets, ['>= 2'])


def test_shaw_max_distance_negative():
  err = raises_config_error(load, 'base', 'pos=shaw,shaw.max_distance=-1')
  check_error(err, 'model.position.shaw.max_distance', -1, ['>= 0'])


def test_shaw_max_distance_zero_is_accepted():
  assert load('base', 'pos=shaw,shaw.max_distance=0').model.position.shaw.max_distance == 0


def test_sinusoidal_needs_even_d_model():
  err = raises_config_error(load, 'base', 'pos=sinusoidal,d_model=255,n_heads=5,n_kv_heads=5')
  check_error(err, 'model.d_model', 255, ['even'])


@pytest.mark.parametrize('arg,value', [('bogus=1', 1), ('bogus=x', 'x')])
def test_unknown_choice_key(arg, value):
  err = raises_config_error(load, 'base', arg)
  msg = check_error(err, 'bogus', value, ['unknown choice key'])
  for alias in CHOICES:
    assert alias in msg
  assert 'dotted path' in msg and 'unique leaf name' in msg


@pytest.mark.parametrize(
  'key,paths',
  [
    ('dropout', ['model.dropout', 'model.attention.dropout']),
    ('kind', ['model.position.kind', 'model.ffn.kind', 'model.norm.kind']),
    ('use_bias', ['model.attention.use_bias', 'model.ffn.use_bias', 'model.norm.use_bias']),
  ],
)
def test_ambiguous_choice_key_lists_the_candidates(key, paths):
  err = raises_config_error(load, 'base', f'{key}=0')
  msg = check_error(err, key, 0, ['ambiguous'])
  for path in paths:
    assert path in msg


@pytest.mark.parametrize(
  'arg,item', [('pos', 'pos'), ('pos=alibi,ffn', 'ffn'), ('n_layers:2', 'n_layers:2')]
)
def test_malformed_choice_item(arg, item):
  err = raises_config_error(load, 'base', arg)
  check_error(err, 'config arg', item, ['key=value'])


@pytest.mark.parametrize(
  'key,where,listed',
  [
    ('model.n_layerz', 'keys under model:', ['n_layers', 'd_model', 'n_kv_heads', 'attention']),
    ('modl.n_layers', 'keys under the config:', ['model', 'data', 'seed']),
    ('model.atention.impl', 'keys under model:', ['attention', 'position']),
    ('model.attention.implementation', 'keys under model.attention:', ['impl', 'sliding_window']),
    ('model.n_layers.x', 'keys under model:', ['n_layers']),
  ],
)
def test_unknown_override_key(key, where, listed):
  err = raises_config_error(load, 'base', overrides={key: 2})
  check_error(err, key, 2, ['no such key', where, *listed])


@pytest.mark.parametrize(
  'key,value,expected',
  [
    ('model.n_layers', 'four', 'int'),
    ('model.n_layers', 2.5, 'int'),
    ('model.position.kind', 3, 'str'),
    ('model.head_dim', 'x', 'expected int'),  # an unset placeholder knows its declared type
  ],
)
def test_wrong_type_override(key, value, expected):
  err = raises_config_error(load, 'base', overrides={key: value})
  check_error(err, key, value, ['wrong type', expected])


def test_section_cannot_be_replaced_by_a_value():
  err = raises_config_error(load, 'base', overrides={'model.attention': 3})
  check_error(err, 'model.attention', 3, ['is a section', 'model.attention.impl'])


def test_wrong_type_choice():
  err = raises_config_error(load, 'base', 'n_layers=four')
  check_error(err, 'model.n_layers', 'four', ['wrong type', 'int'])


@pytest.mark.parametrize('arg', [None, 'pos=rope'])
def test_missing_config_file(arg):
  bad = str(CONFIGS / 'no_such_config.py') + ('' if arg is None else f':{arg}')
  err = raises_config_error(mllm.load_config, bad)
  check_error(err, 'config', bad, ['no such config file', 'configs/base.py'])


def test_config_file_without_get_config(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, 'path', list(sys.path))  # load_config may prepend a path
  path = tmp_path / 'empty_config.py'
  path.write_text('X = 1\n')
  err = raises_config_error(mllm.load_config, str(path))
  check_error(err, 'config', str(path), ['get_config'])


def test_learned_positions_cover_seq_len():
  err = raises_config_error(load, 'gpt2', 'seq_len=512')
  check_error(err, 'data.seq_len', 512, ['model.max_seq_len=256', 'allowed: <='])
  err = raises_config_error(load, 'base', 'pos=learned', {'data.seq_len': 300})
  check_error(err, 'data.seq_len', 300, ['model.max_seq_len=256'])


def test_learned_positions_ok_when_table_is_large_enough():
  cfg = load('gpt2', 'seq_len=512,max_seq_len=512')
  assert cfg.data.seq_len == cfg.model.max_seq_len == 512
  assert load('gpt2', 'seq_len=256').data.seq_len == 256


@pytest.mark.parametrize('pos', [k for k in POSITIONS if k != 'learned'])
def test_seq_len_beyond_max_seq_len_ok_without_learned_positions(pos):
  assert load('base', 'seq_len=512', {'model.position.kind': pos}).data.seq_len == 512


# Inputs that once escaped as TypeError or chose the wrong value: each must be a ConfigError (or,
# for variants named 'none', select that variant).


@pytest.mark.parametrize(
  'arg,key',
  [
    ('pos=t5,t5.max_distance=none', 'model.position.t5.max_distance'),
    ('rope_scaling=linear,linear.factor=none', 'model.position.rope.scaling.linear.factor'),
    (
      'rope_scaling=yarn,yarn.factor=2.0,yarn.beta_slow=none',
      'model.position.rope.scaling.yarn.beta_slow',
    ),
    (
      'rope_scaling=llama3,llama3.factor=2.0,llama3.high_freq_factor=none',
      'model.position.rope.scaling.llama3.high_freq_factor',
    ),
  ],
)
def test_none_numeric_values_raise_config_error(arg, key):
  check_error(raises_config_error(load, 'base', arg), key, None, ['must be set'])


@pytest.mark.parametrize(
  'arg,path',
  [
    ('pos=none', 'model.position.kind'),
    ('norm=none', 'model.norm.kind'),
    (
      'rope_scaling=linear,linear.factor=2.0,rope_scaling=none',
      'model.position.rope.scaling.kind',
    ),
  ],
)
def test_none_named_variant_via_choice(arg, path):
  assert get_path(load('base', arg), path) == 'none'


def test_none_section_override_raises_config_error():
  raises_config_error(load, 'base', overrides={'model': None})


def test_unhashable_literal_choice_raises_config_error():
  raises_config_error(load, 'base', 'pos={[1]: 2}')


# --------------------------------------------------------------------------------------------
# 4. parse_value.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'text,expected',
  [
    ('4', 4),
    ('-3', -3),
    (' 4 ', 4),
    ('0.5', 0.5),
    ('1e-5', 1e-5),
    ('1000000.0', 1e6),
    ('true', True),
    ('True', True),
    ('TRUE', True),
    ('false', False),
    ('False', False),
    ('None', None),
    ('none', None),
    ('null', None),
    ('rope', 'rope'),
    ('float32', 'float32'),
    ("'4'", '4'),
    ('', ''),
  ],
)
def test_parse_value(text, expected):
  result = parse_value(text)
  assert result == expected
  assert type(result) is type(expected)


# --------------------------------------------------------------------------------------------
# 5. config_diff.
# --------------------------------------------------------------------------------------------


def test_config_diff_identical_is_empty():
  assert config_diff(load('base'), load('base')) == {}


def test_config_diff_one_override():
  assert config_diff(load('base', overrides={'model.n_layers': 3}), load('base')) == {
    'model.n_layers': (4, 3)
  }


def test_config_diff_rope_swiglu_vs_base():
  assert config_diff(load('rope_swiglu'), load('base')) == {'model.n_kv_heads': (8, 2)}


def test_config_diff_gpt2_vs_base():
  assert config_diff(load('gpt2'), load('base')) == {
    'model.position.kind': ('rope', 'learned'),
    'model.ffn.kind': ('swiglu', 'gelu'),
    'model.norm.kind': ('rmsnorm', 'layernorm'),
    'model.ffn.use_bias': (False, True),
    'model.attention.use_bias': (False, True),
    'model.norm.eps': (1e-6, 1e-5),
    'train.learning_rate': (3e-3, 1.5e-3),
  }


def test_config_diff_placeholder_and_direction():
  mistral, base = load('mistral_like'), load('base')
  assert config_diff(mistral, base) == {
    'model.n_kv_heads': (8, 2),
    'model.attention.sliding_window': (None, 64),
    'model.norm.eps': (1e-6, 1e-5),
  }
  assert config_diff(base, mistral) == {
    'model.n_kv_heads': (2, 8),
    'model.attention.sliding_window': (64, None),
    'model.norm.eps': (1e-5, 1e-6),
  }


# --------------------------------------------------------------------------------------------
# 6. build_model validates first.
# --------------------------------------------------------------------------------------------


class _NoRngs:
  """Stands in for nnx.Rngs: any use (i.e. any parameter being created) fails the test."""

  def __getattr__(self, name):
    raise AssertionError(f'rngs.{name} used: build_model started building before validating')

  def __call__(self, *args, **kwargs):
    raise AssertionError('rngs used: build_model started building before validating')


@pytest.fixture
def no_transformer(monkeypatch):
  calls = []

  def spy(*args, **kwargs):
    calls.append((args, kwargs))
    raise AssertionError('Transformer constructed before validation')

  monkeypatch.setattr(model_lib, 'Transformer', spy)
  return calls


def _base_module(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT))
  return importlib.import_module('configs.base')


@pytest.mark.parametrize('part', ['full', 'model'])
def test_build_model_validates_a_changed_copy_of_a_loaded_config(part, no_transformer):
  cfg = mllm.load_config(spec('base')).as_configdict()
  cfg.model.n_kv_heads = 3
  err = raises_config_error(mllm.build_model, cfg if part == 'full' else cfg.model, rngs=_NoRngs())
  check_error(err, 'model.n_kv_heads', 3, ['1, 2, 4, 8'])
  assert no_transformer == []


@pytest.mark.parametrize(
  'field,value,key',
  [
    ('n_kv_heads', 3, 'model.n_kv_heads'),
    ('head_dim', 33, 'model.head_dim'),
    ('dropout', 1.0, 'model.dropout'),
  ],
)
def test_build_model_validates_get_config(monkeypatch, no_transformer, field, value, key):
  cfg = _base_module(monkeypatch).get_config()  # unvalidated, unlocked
  cfg.model[field] = value
  err = raises_config_error(mllm.build_model, cfg, rngs=_NoRngs())
  check_error(err, key, value)
  assert no_transformer == []


def test_build_model_rejects_bad_variant_before_lookup(monkeypatch, no_transformer):
  cfg = _base_module(monkeypatch).get_config('ffn=nope')
  err = raises_config_error(mllm.build_model, cfg, rngs=_NoRngs())
  check_error(err, 'model.ffn.kind', 'nope', list(FFNS))
  assert no_transformer == []


def test_build_model_tiny_valid_config():
  """A valid config builds (traced abstractly: eager CPU init would take seconds per op)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  cfg = load(
    'rope_swiglu',
    'vocab_size=32,d_model=16,n_layers=1,n_heads=4,n_kv_heads=2,max_seq_len=16,seq_len=16',
  )
  model = nnx.eval_shape(lambda: mllm.build_model(cfg, rngs=nnx.Rngs(0)))
  assert isinstance(model, mllm.Transformer)
  assert len(model.blocks) == 1
  logits = jax.eval_shape(
    lambda t: mllm.build_model(cfg, rngs=nnx.Rngs(0))(t), jax.ShapeDtypeStruct((1, 4), jnp.int32)
  )
  assert logits.shape == (1, 4, 32) and logits.dtype == jnp.float32


def test_train_state_refuses_an_unloaded_config(monkeypatch, no_transformer):
  from mllm.train.state import abstract_state

  cfg = _base_module(monkeypatch).get_config()  # valid, but never through load_config
  err = raises_config_error(abstract_state, cfg)
  check_error(err, 'config', 'ConfigDict', ['mllm.load_config'])
  assert no_transformer == []
