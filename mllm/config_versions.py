"""The config's schema versions: what a config written in an older one says in this one.

A saved config.json and a suite's ledger line carry the version their config was written in (none
written: version 1). Each change of the schema that moves or renames a key adds one function here,
from the version before to its own; `upgrade` runs a saved config through them in turn. A suite's
runs recorded under an older identity are found again by writing a config back in that version's
shape (`written_in`) and hashing it as that version did (experiments/run.py). So a new key is a
new version too: its downgrade drops the key where it holds the value that computes what the older
version did (any other value stays, so no older run matches), or every committed run stops
matching its config.

Version 1 (until 2026-11-29): each variant's keys flat in its family's section, prefixed
(`model.position.rope_theta`, `t5_num_buckets`, `rope_scaling_factor`, `model.norm.partial_p`).
Version 2: each variant's own section (`model.position.rope.theta`, `model.position.t5.num_buckets`,
`model.position.rope.scaling.yarn.factor`, `model.norm.partial_rmsnorm.p`).
Version 3: MoE an FFN kind with its section `model.ffn.moe` (was `model.moe`), its experts' FFN a
choice of their own (`model.ffn.moe.expert.kind`, was `model.moe.expert_kind`).
Version 4: the optimizer a choice section, `train.optimizer = {kind, muon: {...}}` (AdamW before),
and the parametrization one, `model.parametrization = {kind, mup: {base_d_model, base_head_dim}}`
(standard before); `train.z_loss_coef` (0 before), `model.final_logit_softcap` (None before).
Version 5: `model.attention.logit_softcap` (None before).
Version 6: the standard parametrization's section, `model.parametrization.standard.lr_base_d_model`
(the width the rate is tuned at; the peak is scaled by it / d_model): None before (the rate as
given).
Version 7: `model.position.rope.fraction`, partial RoPE (1.0 before: every dimension rotated);
`model.position.rope.nope_every`, `model.attention.output_gate` and
`model.attention.global_every` (None before); `model.attention.value_residual` and
`model.attention.sinks` and `model.norm.unit_offset` (False before);
`model.attention.qk_norm_over` ('head' before); `model.multi_token_prediction` (False before) and
its loss weights `train.mtp_coef`, `mtp_coef_final`, `mtp_switch_at` (not read before).
Version 8: `model.attention.kind` ('mha' before) and MLA's section `model.attention.mla`;
`model.ffn.moe.routed_scale` (1.0 before), `groups` (1), `top_groups` (None) and `router_bias`
(False); the FFN kind `clamped_swiglu`'s section `model.ffn.clamped_swiglu` (and the experts'
`model.ffn.moe.expert.clamped_swiglu`); YaRN's `truncate` (True before: the ramp's ends rounded).
Version 9: YaRN's `attention_factor` (None before: the paper's 0.1·ln(s) + 1 on cos and sin).
Version 10: `model.position.rope.frequencies`, partial RoPE's ('spread' before: GPT-NeoX's).
"""

from __future__ import annotations

import copy
from typing import Any

VERSION = 10
VERSION_KEY = 'config_version'  # in a saved config.json, beside the config's own sections

# Version 1's keys under `model.` and their version 2 places, except RoPE's scaling factor, whose
# place depends on the scaling chosen (`model.position.rope.scaling.<kind>.factor`).
_V1_TO_V2 = {
  'position.rope_theta': 'position.rope.theta',
  'position.rope_layout': 'position.rope.layout',
  'position.rope_original_max_len': 'position.rope.original_max_len',
  'position.rope_scaling': 'position.rope.scaling.kind',
  'position.yarn_beta_fast': 'position.rope.scaling.yarn.beta_fast',
  'position.yarn_beta_slow': 'position.rope.scaling.yarn.beta_slow',
  'position.llama3_low_freq_factor': 'position.rope.scaling.llama3.low_freq_factor',
  'position.llama3_high_freq_factor': 'position.rope.scaling.llama3.high_freq_factor',
  'position.t5_num_buckets': 'position.t5.num_buckets',
  'position.t5_max_distance': 'position.t5.max_distance',
  'position.shaw_max_distance': 'position.shaw.max_distance',
  'norm.partial_p': 'norm.partial_rmsnorm.p',
}
_V1_FACTOR = 'position.rope_scaling_factor'
# Version 2's sections that version 1 held as the flat keys above.
_V2_SECTIONS = ('position.rope', 'position.t5', 'position.shaw', 'norm.partial_rmsnorm')


def _pop(tree: dict, path: str, default: Any = None) -> Any:
  *parents, leaf = path.split('.')
  for name in parents:
    tree = tree.get(name, {})
  return tree.pop(leaf, default)


def _put(tree: dict, path: str, value: Any) -> None:
  *parents, leaf = path.split('.')
  for name in parents:
    tree = tree.setdefault(name, {})
  tree[leaf] = value


def _has(tree: dict, path: str) -> bool:
  *parents, leaf = path.split('.')
  for name in parents:
    tree = tree.get(name)
    if not isinstance(tree, dict):
      return False
  return leaf in tree


def v1_to_v2(config: dict) -> dict:
  """A version 1 config (as JSON) in version 2's shape: each variant's keys in its section. A key
  version 1 did not read (another variant's, at its default) is dropped."""
  config = copy.deepcopy(config)
  model = config.get('model', {})
  kind = model.get('position', {}).get('rope_scaling', 'none')
  factor = _pop(model, _V1_FACTOR)
  for old, new in _V1_TO_V2.items():
    if _has(model, old):
      _put(model, new, _pop(model, old))
  if factor is not None and kind != 'none':
    _put(model, f'position.rope.scaling.{kind}.factor', factor)
  return config


def v2_to_v3(config: dict) -> dict:
  """A version 2 config (as JSON) in version 3's shape: the MoE section under the FFN's."""
  config = copy.deepcopy(config)
  model = config.get('model', {})
  if 'moe' in model:
    moe = model.pop('moe')
    if 'expert_kind' in moe:
      moe['expert'] = {'kind': moe.pop('expert_kind')}
    model.setdefault('ffn', {})['moe'] = moe
  return config


def v3_as_v2(config: dict) -> dict:
  """A version 3 config (as JSON, every key present) in version 2's shape (which had no settings
  for a dense FFN: an expert's are dropped, as are the sections of FFNs version 2 lacked)."""
  config = copy.deepcopy(config)
  model = config['model']
  moe = model['ffn'].pop('moe')
  moe['expert_kind'] = moe.pop('expert')['kind']
  model['moe'] = moe
  for name in [k for k, v in model['ffn'].items() if isinstance(v, dict)]:
    del model['ffn'][name]
  return config


# Version 4's new keys as every earlier version trained: AdamW, no output z-loss, the standard
# parametrization (the other variants' keys at their version 4 defaults, which later versions do
# not change: that would be a version of its own).
_V4_SECTIONS = {
  'train.optimizer': {
    'kind': 'adamw',
    'muon': {
      'adam_lr_ratio': 1.0,
      'beta': 0.95,
      'consistent_rms': 0.2,
      'nesterov': True,
      'ns_steps': 5,
    },
  },
  'train.z_loss_coef': 0.0,
  'model.final_logit_softcap': None,
  'model.parametrization': {
    'kind': 'standard',
    'mup': {'base_d_model': 256, 'base_head_dim': None},
  },
}


# Version 5's new key as every earlier version trained: no attention-logit soft cap.
_V5_KEYS = {'model.attention.logit_softcap': None}


def _adding(new: dict[str, Any]):
  """(upgrade, downgrade) of a version that only adds the keys `new` (path → the value that
  computes what the version before did): the upgrade puts them in; the downgrade takes out those
  at that value, and any other value stays, so no run of the version before is it."""

  def up(config: dict) -> dict:
    config = copy.deepcopy(config)
    for path, value in new.items():
      _put(config, path, copy.deepcopy(value))
    return config

  def down(config: dict) -> dict:
    config = copy.deepcopy(config)
    for path, value in new.items():
      if _get(config, path) == value:
        _pop(config, path)
    return config

  return up, down


v3_to_v4, v4_as_v3 = _adding(_V4_SECTIONS)  # AdamW, no z-loss, standard
v4_to_v5, v5_as_v4 = _adding(_V5_KEYS)  # no attention-logit soft cap

# Version 6's section as every earlier version trained: the rate as given.
_STANDARD = 'model.parametrization.standard'
_STANDARD_BEFORE = {'lr_base_d_model': None}


def v5_to_v6(config: dict) -> dict:
  """A version 5 config in version 6's shape: the standard parametrization's rate as given (its
  section at its default, 256, where µP is chosen: not read)."""
  config = copy.deepcopy(config)
  # A partial config (laid over a full one later) without a kind says version 5's default.
  kind = config.get('model', {}).get('parametrization', {}).get('kind', 'standard')
  _put(
    config, _STANDARD, dict(_STANDARD_BEFORE) if kind == 'standard' else {'lr_base_d_model': 256}
  )
  return config


def v6_as_v5(config: dict) -> dict:
  """A version 6 config in version 5's shape: without the standard parametrization's section
  where it says what version 5 trained (the rate as given) or is not read (µP chosen)."""
  config = copy.deepcopy(config)
  standard = _get(config, 'model.parametrization.kind') == 'standard'
  if not standard or _get(config, _STANDARD) == _STANDARD_BEFORE:
    _pop(config, _STANDARD)
  return config


# Version 7's new keys as every earlier version trained: every dimension of every layer rotated,
# no output gate, every layer at the window, no value residual, no sinks, gains stored as γ,
# QK-norm per head.
v6_to_v7, v7_as_v6 = _adding(
  {
    'model.position.rope.fraction': 1.0,
    'model.position.rope.nope_every': None,
    'model.attention.output_gate': None,
    'model.attention.global_every': None,
    'model.attention.value_residual': False,
    'model.attention.sinks': False,
    'model.norm.unit_offset': False,
    'model.attention.qk_norm_over': 'head',
    'model.multi_token_prediction': False,
    'train.mtp_coef': 0.3,
    'train.mtp_coef_final': 0.1,
    'train.mtp_switch_at': 0.68,
  }
)

# Version 8's keys as every earlier version trained: n_kv_heads key/value heads, no MLA, the
# routed gates as chosen, every expert group open.
v7_to_v8, v8_as_v7 = _adding(
  {
    'model.position.rope.scaling.yarn.truncate': True,
    'model.ffn.moe.routed_scale': 1.0,
    'model.ffn.moe.router_bias': False,
    'model.ffn.clamped_swiglu': {'alpha': 1.702, 'limit': 7.0},
    'model.ffn.moe.expert.clamped_swiglu': {'alpha': 1.702, 'limit': 7.0},
    'model.ffn.moe.groups': 1,
    'model.ffn.moe.top_groups': None,
    'model.attention.kind': 'mha',
    'model.attention.mla': {
      'kv_lora_rank': None,
      'q_lora_rank': None,
      'rope_head_dim': None,
      'v_head_dim': None,
    },
  }
)

# Version 9's key as every earlier version trained: YaRN's own factor on cos and sin.
v8_to_v9, v9_as_v8 = _adding({'model.position.rope.scaling.yarn.attention_factor': None})

# Version 10's key as every earlier version trained: partial RoPE's frequencies GPT-NeoX's.
v9_to_v10, v10_as_v9 = _adding({'model.position.rope.frequencies': 'spread'})

# version n → the function to version n + 1
UPGRADES = {
  1: v1_to_v2,
  2: v2_to_v3,
  3: v3_to_v4,
  4: v4_to_v5,
  5: v5_to_v6,
  6: v6_to_v7,
  7: v7_to_v8,
  8: v8_to_v9,
  9: v9_to_v10,
}


def version_of(saved: dict) -> int:
  return saved.get(VERSION_KEY, 1)


def upgrade(saved: dict) -> dict:
  """A saved config (as JSON, with its `config_version` if written since version 2) in this
  version's shape, without the version key."""
  version = version_of(saved)
  config = {k: v for k, v in saved.items() if k != VERSION_KEY}
  if not isinstance(version, int) or not 1 <= version <= VERSION:
    raise ValueError(f'{VERSION_KEY}={version!r}; allowed: 1 to {VERSION}')
  for step in range(version, VERSION):
    config = UPGRADES[step](config)
  return config


def written_in(config: dict, version: int) -> dict:
  """A config of this version (as JSON, every key present) in the shape of an older `version`:
  how a run recorded under that version's identity is found again."""
  for step in range(VERSION, version, -1):
    config = DOWNGRADES[step](config)
  return config


def written_in_each(config: dict) -> dict[int, dict]:
  """{version: the config in that older version's shape} for every version before this one, in
  one walk down (each shape is the one before it downgraded once)."""
  shapes = {}
  for step in range(VERSION, 1, -1):
    config = shapes[step - 1] = DOWNGRADES[step](config)
  return shapes


def as_v1(config: dict) -> dict:
  """A config of this version (as JSON, every key present) in version 1's shape."""
  return written_in(config, 1)


def v2_as_v1(config: dict) -> dict:
  """A version 2 config (every key present) in version 1's shape, the inverse of `v1_to_v2` on
  what version 1 could say (a variant's keys not chosen are at their defaults in both)."""
  config = copy.deepcopy(config)
  model = config['model']
  scaling = model['position']['rope']['scaling']
  factor = scaling[scaling['kind']]['factor'] if scaling['kind'] != 'none' else 1.0
  for old, new in _V1_TO_V2.items():
    _put(model, old, _pop(model, new))
  _put(model, _V1_FACTOR, factor)
  _pop(model, 'position.rope.scaling')
  # A section keeps what version 1 had no key for: a later version's key that a downgrade left
  # at another value than the one version 1 computed (partial RoPE), so no version 1 run is it.
  for section in _V2_SECTIONS:
    if not _get(model, section):
      _pop(model, section)
  return config


def _get(tree: dict, path: str) -> Any:
  for name in path.split('.'):
    tree = tree[name]
  return tree


DOWNGRADES = {
  10: v10_as_v9,
  9: v9_as_v8,
  8: v8_as_v7,
  7: v7_as_v6,
  6: v6_as_v5,
  5: v5_as_v4,
  4: v4_as_v3,
  3: v3_as_v2,
  2: v2_as_v1,
}  # version n → the function to version n - 1
