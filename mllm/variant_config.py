"""A variant's own config section, declared where the variant lives.

A variant with parameters (RoPE and its scalings, T5's buckets, Shaw's clipping distance, partial
RMSNorm's p, ...) declares them as a small frozen dataclass, its `Settings`: each field is one key
of the variant's own section, with a default, the rule on its value and one line of docs:

    @dataclasses.dataclass(frozen=True)
    class Settings:
      num_buckets: int = setting(32, 'distance buckets', at_least(2))

A family of variants is a *choice section*: `kind` names the chosen variant, and each registered
variant with settings has a section of its own under its registry name, as in Levanter's
per-variant config classes in a choice registry:

    model.position = {kind: 't5', t5: {num_buckets: 32, max_distance: 128}, shaw: {...}, ...}

A setting may itself be a choice (RoPE's `scaling`: `model.position.rope.scaling = {kind: 'yarn',
yarn: {factor, beta_fast, beta_slow}, ...}`). Every variant's section is in the schema, so
`--config.model.position.t5.num_buckets=64` works whatever the order of the flags; validation
checks the chosen variant's keys by their declared rules and refuses, in one line naming the
chosen variant's keys, another variant's key set off its default: it would silently do nothing.
Choosing a variant (`pos=alibi`, applied in order with a named config's own) resets the sections
of those not chosen (`reset_unread`), so `configs/qwen3_like.py:pos=alibi` drops Qwen3's RoPE θ.

Code reads a variant's settings as its typed, frozen record: `settings_of(variant, section)`.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ml_collections import config_dict

from mllm.checks import ConfigError, one_of

Check = Callable[[str, Any], None]  # (dotted key, value) -> None, or raise a one-line ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class Key:
  """One key of a variant's section."""

  name: str  # the settings field, and its key in the variant's section
  default: Any  # for a choice: the default variant's name
  doc: str
  check: Check | None = None  # the rule on its value (the type is checked from the annotation)
  choices: Mapping[str, Any] | None = None  # a registry: the key is a choice section of its own
  type: type | None = None  # filled from the settings field's annotation
  nullable: bool = False  # annotated `X | None`: None is a value it takes (filled from it too)


def setting(default: Any, doc: str, check: Check | None = None) -> Any:
  """A settings field: one key of the variant's section (see the module docstring)."""
  return dataclasses.field(default=default, metadata={'key': Key('', default, doc, check)})


@dataclasses.dataclass(frozen=True)
class Chosen:
  """A choice setting's value in a record: the chosen variant's name and its settings (None for a
  variant without any)."""

  kind: str
  settings: Any = None


def choice(registry: Mapping[str, Any], default: str, doc: str) -> Any:
  """A settings field that chooses a variant of `registry`: in the config a choice section
  (`kind` and the variants' sections), in the record a `Chosen`."""
  return dataclasses.field(
    default_factory=lambda: Chosen(default, _default_settings(registry[default])),
    metadata={'key': Key('', default, doc, choices=registry)},
  )


def _default_settings(variant: Any) -> Any:
  settings = _settings_class(variant)
  return None if settings is None else settings()


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


def _settings_class(variant: Any) -> type | None:
  settings = getattr(variant, 'Settings', variant)
  return settings if isinstance(settings, type) and dataclasses.is_dataclass(settings) else None


def keys_of(variant: Any) -> tuple[Key, ...]:
  """The keys of a variant's section (a variant may be a settings class itself)."""
  settings = _settings_class(variant)
  return () if settings is None else _declared_keys(settings)


@functools.cache  # a class's declarations never change; every config load reads them many times
def _declared_keys(settings: type) -> tuple[Key, ...]:
  hints = typing.get_type_hints(settings)
  out = []
  for field in dataclasses.fields(settings):
    declared = field.metadata.get('key')
    if declared is not None:
      hint = hints[field.name]
      kind = str if declared.choices is not None else _base_type(hint)
      nullable = type(None) in typing.get_args(hint)
      out.append(dataclasses.replace(declared, name=field.name, type=kind, nullable=nullable))
  return tuple(out)


def sectioned(registry: Mapping[str, Any]) -> dict[str, Any]:
  """The registry's variants that have a section: those whose settings declare keys."""
  return {name: v for name, v in registry.items() if keys_of(v)}


# ---------------------------------------------------------------------------------------------
# The schema's sections, and the typed records read from them.
# ---------------------------------------------------------------------------------------------


def variant_section(variant: Any) -> config_dict.ConfigDict:
  """A variant's section, every key at its default."""
  section = config_dict.ConfigDict()
  for k in keys_of(variant):
    if k.choices is not None:
      section[k.name] = choice_section(k.choices, k.default)
    else:
      # A nullable key is a FieldReference (as placeholder()'s), so 'none' unsets it.
      nullable = k.nullable or k.default is None
      section[k.name] = config_dict.FieldReference(k.default, k.type) if nullable else k.default
  return section


def choice_section(registry: Mapping[str, Any], kind: str) -> config_dict.ConfigDict:
  """A nested choice's section: `kind` and each variant's section, at their defaults."""
  section = config_dict.ConfigDict({'kind': kind})
  add_sections(section, registry)
  return section


def add_sections(section: config_dict.ConfigDict, registry: Mapping[str, Any]) -> None:
  """Add each of the registry's variants' sections to a choice section, at their defaults."""
  for name, variant in sectioned(registry).items():
    if name in section:
      raise TypeError(f'variant {name!r} is named like a key of its family section')
    section[name] = variant_section(variant)


def settings_of(variant: Any, section) -> Any:
  """The chosen `variant`'s settings (its typed, frozen record; None if it declares none), read
  from its family's choice section (`section.kind` names it); a choice setting holds a `Chosen`."""
  settings = _settings_class(variant)
  if settings is None:
    return None
  own = section.get(section['kind'], {})
  values = {}
  for k in keys_of(variant):
    if k.choices is not None:
      sub = own[k.name]
      values[k.name] = Chosen(sub['kind'], settings_of(k.choices[sub['kind']], sub))
    else:
      values[k.name] = own[k.name]
  return settings(**values)


# ---------------------------------------------------------------------------------------------
# Validation and resetting.
# ---------------------------------------------------------------------------------------------


def _check_type(name: str, k: Key, value: Any) -> None:
  if value is None:
    if not (k.nullable or k.default is None):
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
  """Each of `keys` in `section` has its declared type and passes its rule; a choice key's own
  choice section is checked as one (`check_variant_keys`)."""
  for k in keys:
    name = f'{prefix}.{k.name}'
    if k.choices is not None:
      check_variant_keys(section[k.name], name, k.choices, k.doc)
      continue
    value = section[k.name]
    _check_type(name, k, value)
    if value is not None and k.check is not None:
      k.check(name, value)


def _defaults(variant: Any) -> dict[str, Any]:
  return variant_section(variant).to_dict()


def _reads(variant: Any, section, prefix: str) -> list[str]:
  """The dotted keys the chosen `variant` reads from its own `section`, those of the variants its
  choice keys choose included."""
  out = []
  for k in keys_of(variant):
    if k.choices is None:
      out.append(f'{prefix}.{k.name}')
      continue
    sub, kind = section[k.name], section[k.name]['kind']
    out.append(f'{prefix}.{k.name}.kind')
    if kind in sectioned(k.choices):
      out += _reads(k.choices[kind], sub[kind], f'{prefix}.{k.name}.{kind}')
  return out


def _first_change(mine: Mapping, default: Mapping, prefix: str) -> tuple[str, Any, Any] | None:
  """(dotted key, value, default) of the first key of `mine` off its default, if any."""
  for name, value in mine.items():
    if isinstance(value, Mapping):
      found = _first_change(value, default[name], f'{prefix}.{name}')
      if found:
        return found
    elif value != default[name]:
      return f'{prefix}.{name}', value, default[name]
  return None


def check_variant_keys(section, prefix: str, registry: Mapping[str, Any], what: str) -> None:
  """`section.kind` is a registered variant; its section's keys pass their rules; the section
  of every variant not chosen is at its defaults."""
  kind = section['kind']
  one_of(f'{prefix}.kind', kind, registry, what)
  with_sections = sectioned(registry)
  if kind in with_sections:
    check_keys(section[kind], f'{prefix}.{kind}', keys_of(registry[kind]))
  for name, variant in with_sections.items():
    if name == kind:
      continue
    found = _first_change(section[name].to_dict(), _defaults(variant), f'{prefix}.{name}')
    if found:
      key, value, default = found
      reads = (
        ', '.join(_reads(registry[kind], section[kind], f'{prefix}.{kind}'))
        if kind in with_sections
        else 'no keys of its own'
      )
      raise ConfigError(
        key,
        value,
        f'read only by {prefix}.kind={name!r} (it is {kind!r}), so it would do nothing; allowed '
        f'here: its default {default!r}; {prefix}.kind={kind!r} reads: {reads}',
      )


def reset_unread(section, registry: Mapping[str, Any]) -> None:
  """Reset to its defaults the section of every variant not chosen, and within the chosen one's
  section, those its own choices do not choose (an unknown variant is left for validation)."""
  kind = section['kind']
  if kind not in registry:
    return
  with section.unlocked():
    for name, variant in sectioned(registry).items():
      if name != kind:
        section[name] = variant_section(variant)
  for k in keys_of(registry[kind]):
    if k.choices is not None:
      reset_unread(section[kind][k.name], k.choices)
