"""A variant's own config keys, declared where the variant lives.

A variant with parameters (RoPE and its scalings, T5's buckets, Shaw's clipping distance, partial
RMSNorm's p, ...) declares them as a small frozen dataclass, its `Settings`, whose fields carry
the config key they are read from, a default, the rule on the value and one line of docs:

    @dataclasses.dataclass(frozen=True)
    class Settings:
      num_buckets: int = key('t5_num_buckets', 32, 'distance buckets', at_least(2))

As in Levanter's per-variant config classes, but flattened into the variant family's one config
section (`model.position.t5_num_buckets`), so the keys, `--config.KEY=VALUE`, the `pos=...` choices
and every committed config hash stay what they were. The schema (config_schema.py) adds every
registered variant's keys to its section; validation checks the chosen variant's keys by their
declared rules and refuses, in one line naming the chosen variant's keys, a key of another
variant set off its default: it would silently do nothing. Choosing a variant by its short choice
(`pos=alibi`, applied in order with a named config's own) resets the keys the new variant does
not read (`reset_unread`), so `configs/qwen3_like.py:pos=alibi` drops Qwen3's RoPE θ.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ml_collections import config_dict

from mllm.checks import ConfigError, one_of

Check = Callable[[str, Any], None]  # (dotted key, value) -> None, or raise a one-line ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class Key:
  """One config key a variant reads."""

  name: str  # the key in the variant family's section, e.g. 't5_num_buckets'
  default: Any
  doc: str
  check: Check | None = None  # the rule on its value (the type is checked from the annotation)
  choices: Mapping[str, Any] | None = None  # a registry: the value names one of its variants
  type: type | None = None  # filled from the settings field's annotation


def key(
  name: str,
  default: Any,
  doc: str,
  check: Check | None = None,
  *,
  choices: Mapping[str, Any] | None = None,
) -> Any:
  """A settings field read from config key `name` (see the module docstring)."""
  return dataclasses.field(
    default=default, metadata={'key': Key(name, default, doc, check, choices)}
  )


# Rules a key may name; each raises ConfigError(key, value, what is allowed).


def at_least(minimum: float, what: str = '') -> Check:
  def check(name: str, value: Any) -> None:
    if not value >= minimum:
      raise ConfigError(name, value, f'must be >= {minimum:g}' + (f' ({what})' if what else ''))

  return check


def one_of_these(allowed, what: str) -> Check:
  return lambda name, value: one_of(name, value, allowed, what)


# ---------------------------------------------------------------------------------------------
# Reading declarations.
# ---------------------------------------------------------------------------------------------


def _base_type(annotation) -> type:
  """int → int; int | None → int (None is allowed where the default is None)."""
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  return args[0] if args else annotation


def keys_of(variant: Any) -> tuple[Key, ...]:
  """The keys a variant declares in its `Settings` (a variant may be a settings class itself)."""
  settings = getattr(variant, 'Settings', variant)
  if not dataclasses.is_dataclass(settings):
    return ()
  hints = typing.get_type_hints(settings)
  out = []
  for field in dataclasses.fields(settings):
    declared = field.metadata.get('key')
    if declared is not None:
      out.append(dataclasses.replace(declared, type=_base_type(hints[field.name])))
  return tuple(out)


def settings_of(variant: Any, section) -> Any:
  """The variant's `Settings`, read from its family's config section (a ConfigDict or mapping)."""
  settings = getattr(variant, 'Settings', variant)
  values = {}
  for field in dataclasses.fields(settings):
    declared = field.metadata.get('key')
    if declared is not None:
      values[field.name] = section[declared.name]
  return settings(**values)


def all_keys(registry: Mapping[str, Any]) -> dict[str, Key]:
  """Every key the registry's variants declare, those of nested choices included, by name. Two
  variants may share a key (RoPE's scalings share the factor) only by declaring it alike."""
  out: dict[str, Key] = {}
  for variant in registry.values():
    for k in keys_of(variant):
      seen = out.setdefault(k.name, k)
      if (seen.default, seen.type, seen.doc) != (k.default, k.type, k.doc):
        raise TypeError(f'config key {k.name!r} is declared twice, differently')
      if k.choices is not None:
        out.update(all_keys(k.choices))
  return out


def add_keys(section: config_dict.ConfigDict, registry: Mapping[str, Any]) -> None:
  """Add every key the registry's variants declare to `section`, at its default (the schema)."""
  for k in all_keys(registry).values():
    section[k.name] = config_dict.placeholder(k.type) if k.default is None else k.default


def section_of(settings: type) -> config_dict.ConfigDict:
  """A config section holding one settings class's keys at their defaults (the schema's
  `model.moe`)."""
  section = config_dict.ConfigDict()
  add_keys(section, {'': settings})
  return section


def active_keys(variant: Any, section) -> list[Key]:
  """The keys the chosen variant reads, and those of the variants its choice keys choose."""
  out = []
  for k in keys_of(variant):
    out.append(k)
    if k.choices is not None and section[k.name] in k.choices:
      out.extend(active_keys(k.choices[section[k.name]], section))
  return out


def _check_type(name: str, k: Key, value: Any) -> None:
  if value is None:
    if k.default is not None:
      raise ConfigError(name, value, f'must be set; default {k.default!r}')
    return
  if k.type is bool:
    ok = isinstance(value, bool)
  elif k.type is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  else:
    ok = isinstance(value, k.type) and not (k.type is int and isinstance(value, bool))
  if not ok:
    what = {int: 'an integer', float: 'a number', bool: 'true or false', str: 'a string'}
    raise ConfigError(name, value, 'must be ' + what.get(k.type, k.type.__name__))


def check_keys(section, prefix: str, keys) -> None:
  """Each of `keys` in `section` has its declared type and passes its rule."""
  for k in keys:
    name, value = f'{prefix}.{k.name}', section[k.name]
    _check_type(name, k, value)
    if k.choices is not None:
      one_of(name, value, k.choices, k.doc)
    elif value is not None and k.check is not None:
      k.check(name, value)


def check_variant_keys(
  section, prefix: str, kind_key: str, registry: Mapping[str, Any], what: str
) -> None:
  """`section[kind_key]` is a registered variant; its keys pass their rules; a key that only
  other variants read is at its default."""
  kind = section[kind_key]
  one_of(f'{prefix}.{kind_key}', kind, registry, what)
  active = active_keys(registry[kind], section)
  check_keys(section, prefix, active)
  read = {k.name for k in active}
  for k in all_keys(registry).values():
    if k.name not in read and section[k.name] != k.default:
      chooser, names = _readers(registry, k.name, kind_key)
      reads = ', '.join(sorted(read)) or 'none of its own'
      raise ConfigError(
        f'{prefix}.{k.name}',
        section[k.name],
        f'read only by {prefix}.{chooser}='
        + ' or '.join(repr(n) for n in names)
        + f' (it is {section[chooser]!r}), so it would do nothing; allowed here: its default '
        f'{k.default!r}; {prefix}.{kind_key}={kind!r} reads: {reads}',
      )


def reset_unread(section, kind_key: str, registry: Mapping[str, Any]) -> None:
  """Set every key of `registry`'s variants that the chosen one does not read to its default (an
  unknown variant is left for validation to name)."""
  if section[kind_key] not in registry:
    return
  read = {k.name for k in active_keys(registry[section[kind_key]], section)}
  reset_keys(section, [k for k in all_keys(registry).values() if k.name not in read])


def reset_keys(section, keys) -> None:
  """Set each of `keys` in `section` to its default."""
  with section.unlocked():
    for k in keys:
      section[k.name] = k.default


def _readers(registry: Mapping[str, Any], name: str, kind_key: str) -> tuple[str, list[str]]:
  """The key that chooses the variants reading key `name`, and their names: ('kind', ['t5']),
  or ('rope_scaling', ['yarn']) for a key of a nested choice."""
  for variant in registry.values():
    for k in keys_of(variant):
      if k.choices is not None and name in all_keys(k.choices):
        return _readers(k.choices, name, k.name)
  return kind_key, [n for n, v in registry.items() if any(k.name == name for k in keys_of(v))]
