"""Dotted keys of an ml_collections config: read, write and parse `model.ffn.kind=swiglu`, and the
choice strings of `--config=configs/base.py:pos=alibi,ffn=geglu`."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from typing import Any

from ml_collections import config_dict

from mllm.checks import ConfigError


def leaf_paths(config: config_dict.ConfigDict, prefix: str = '') -> Iterable[str]:
  for key in config:
    value = config[key]  # placeholders read as None, sub-configs as ConfigDicts
    if isinstance(value, config_dict.ConfigDict):
      yield from leaf_paths(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}'


def flatten(config: config_dict.ConfigDict) -> dict[str, Any]:
  """{'model.n_layers': 4, ...} for every leaf."""
  return {path: get_path(config, path) for path in leaf_paths(config)}


def get_path(config, path: str) -> Any:
  node = config
  for part in path.split('.'):
    node = node[part]
  return node


def field_info(config, path: str) -> tuple[Any, type | None, bool]:
  """(current value, declared type, nullable) of a leaf; (None, None, False) if unknown.

  nullable: declared with `placeholder(type)`, so 'none' on the command line means unset; a
  plain string field such as model.position.kind takes 'none' as a variant name.
  """
  *parents, leaf = path.split('.')
  try:
    node = get_path(config, '.'.join(parents)) if parents else config
    # ConfigDict keeps a placeholder as a FieldReference in _fields (no public accessor).
    field = node._fields.get(leaf)
    nullable = isinstance(field, config_dict.FieldReference)
    return node[leaf], node.get_type(leaf), nullable
  except (KeyError, AttributeError, TypeError):
    return None, None, False


def set_path(config: config_dict.ConfigDict, path: str, value: Any) -> None:
  """config[path] = value, with a ConfigError naming the key for unknown keys or wrong types."""
  *parents, leaf = path.split('.')
  node = config
  for depth, name in enumerate(parents + [leaf]):
    child = node.get(name) if name in node else None
    if name not in node or (depth < len(parents) and not isinstance(child, config_dict.ConfigDict)):
      where = '.'.join(parents[:depth]) or 'the config'
      raise ConfigError(path, value, f'no such key; keys under {where}: ' + ', '.join(sorted(node)))
    if depth < len(parents):
      node = child
  if isinstance(node[leaf], config_dict.ConfigDict):
    raise ConfigError(
      path,
      value,
      'is a section, not a value; set one of its keys: '
      + ', '.join(f'{path}.{k}' for k in sorted(node[leaf])),
    )
  try:
    with node.unlocked():
      node[leaf] = value
  except (TypeError, ValueError) as err:
    declared = field_info(config, path)[1]  # also known for an unset placeholder
    expected = declared.__name__ if declared else 'a value of the declared type'
    raise ConfigError(path, value, f'wrong type, expected {expected} ({err})') from None


def parse_value(
  text: str, current: Any = None, declared: type | None = None, nullable: bool = False
) -> Any:
  """'4' → 4, '0.5' → 0.5, 'true' → True, 'none' → None, anything else stays a string.

  When the field being set currently holds a string (a variant name), the text is taken as is, so
  `pos=none` chooses the variant named 'none' rather than None; unless the field is `nullable` (a
  placeholder such as data.cache_dir), where 'none' unsets it. `field_info` gives all three.
  For a float field (`current` a float, or `declared` float), 'nan' and '[+-]inf' become floats,
  so validation names the key ("must be finite") instead of reporting a wrong type.
  """
  lowered = text.strip().lower()
  if isinstance(current, str) and not (nullable and lowered in ('none', 'null')):
    return text.strip()
  is_float = isinstance(current, float) or declared is float
  if is_float and lowered.lstrip('+-') in ('nan', 'inf', 'infinity'):
    return float(lowered)  # as absl's float parser reads it; validate() then refuses it
  if lowered in ('none', 'null'):
    return None
  if lowered in ('true', 'false'):
    return lowered == 'true'
  try:
    return ast.literal_eval(text.strip())
  except Exception:  # literal_eval raises ValueError, SyntaxError, TypeError, MemoryError, ...
    return text.strip()


# Short names accepted in `--config=configs/base.py:pos=alibi,ffn=geglu,...`. Any dotted path
# (`model.n_layers=4`) and any leaf name or tail of a path that is unique in the config
# (`n_kv_heads=2`, `t5.num_buckets=64`) work too.
CHOICES = {
  'pos': 'model.position.kind',
  'ffn': 'model.ffn.kind',
  'norm': 'model.norm.kind',
  'placement': 'model.norm.placement',
  'attn': 'model.attention.impl',
  'attention': 'model.attention.kind',
  'window': 'model.attention.sliding_window',
  'rope_scaling': 'model.position.rope.scaling.kind',
  'opt': 'train.optimizer.kind',
  'param': 'model.parametrization.kind',
}


def resolve_choice_key(config: config_dict.ConfigDict, key: str, value: Any = None) -> str:
  """A choice key → the dotted path it sets (alias, dotted path, or unique leaf name)."""
  if key in CHOICES:
    return CHOICES[key]
  paths = list(leaf_paths(config))
  if key in paths:
    return key
  matches = [p for p in paths if p.endswith('.' + key)]  # a leaf name, or its tail: t5.num_buckets
  if len(matches) == 1:
    return matches[0]
  if len(matches) > 1:
    raise ConfigError(key, value, 'ambiguous choice key; use one of ' + ', '.join(matches))
  raise ConfigError(
    key,
    value,
    'unknown choice key; allowed: '
    + ', '.join(CHOICES)
    + ', a dotted path such as model.n_layers, or a unique leaf name or tail (t5.num_buckets)',
  )


def join_choices(*args: str | None) -> str:
  """Join comma-separated choice strings; later ones win (named configs put the user's last)."""
  return ','.join(a for a in args if a)


def apply_choices(
  config: config_dict.ConfigDict,
  arg: str | None,
  after_set: Callable[[config_dict.ConfigDict, str], None] | None = None,
) -> config_dict.ConfigDict:
  """Apply `--config=path:arg` choices such as 'pos=alibi,ffn=geglu,n_layers=2', in order;
  `after_set(config, path)` runs after each (the schema resets the keys a newly chosen variant
  does not read)."""
  for item in filter(None, (s.strip() for s in (arg or '').split(','))):
    key, sep, text = item.partition('=')
    if not sep:
      raise ConfigError('config arg', item, 'expected key=value pairs, e.g. pos=alibi,ffn=geglu')
    path = resolve_choice_key(config, key.strip(), parse_value(text))
    set_path(config, path, parse_value(text, *field_info(config, path)))
    if after_set is not None:
      after_set(config, path)
  return config
