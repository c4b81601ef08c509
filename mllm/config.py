"""Config loading: a config file (`configs/*.py`, with `:choices`), overrides by dotted key, then
validation (mllm/validation.py).

`load_config` is the one way a run's config is made (launch.py, a Hugging Face import, a restart
from a workdir's config.json, the experiments): it validates once and freezes the result into a
`RunConfig`, which nothing can change afterwards. Past that edge code trusts it: the train state,
the loop and the data read its fields (each variant's section through its typed `Settings` record,
mllm/variant_config.py) without validating again.

Every invalid value or combination raises a `ConfigError` whose message is one line naming the key,
the bad value and what is allowed, before anything is built or compiled.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import Any

from ml_collections import config_dict

from mllm.checks import ConfigError, first_line
from mllm.config_keys import (
  flatten,
  join_choices,  # noqa: F401 - configs/*.py (and users' own configs) import it from here
)
from mllm.config_schema import set_key
from mllm.validation import validate

# --------------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------------


def _import_config_file(path: str):
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  if root not in sys.path:  # lets configs/x.py import configs.base from a checkout
    sys.path.insert(0, root)
  name = '_mllm_config_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def read_config(spec: str) -> config_dict.ConfigDict:
  """`get_config(arg)` of the file `spec` names (a path, optionally `:arg`), not yet validated.

  Every way the file can be wrong (missing, a folder, not Python, a syntax error, an import or
  get_config that raises, a result that is not a ConfigDict) is one ConfigError line.
  """
  path, sep, arg = spec.partition(':')
  if os.path.isdir(path):
    raise ConfigError(
      'config',
      spec,
      'is a folder; allowed: a Python file such as '
      'configs/base.py, optionally followed by :choices',
    )
  if not os.path.isfile(path):
    raise ConfigError(
      'config',
      spec,
      'no such config file; allowed: a path such as '
      'configs/base.py, optionally followed by :choices',
    )
  if not path.endswith('.py'):
    raise ConfigError(
      'config',
      spec,
      'is not a Python file; allowed: a .py file that defines '
      'get_config(arg), such as configs/base.py',
    )
  try:
    module = _import_config_file(path)
  except SyntaxError as err:
    raise ConfigError(
      'config',
      spec,
      f'syntax error at line {err.lineno}: {err.msg}; allowed: '
      'a Python file that defines get_config(arg)',
    ) from None
  except Exception as err:  # any error in the user's file
    raise ConfigError('config', spec, f'importing it raised {first_line(err)}') from None
  if not callable(getattr(module, 'get_config', None)):
    raise ConfigError('config', spec, 'the file defines no get_config(arg)')
  try:
    config = module.get_config(arg) if sep else module.get_config()
  except ConfigError:
    raise
  except Exception as err:
    raise ConfigError('config', spec, f'get_config raised {first_line(err)}') from None
  if not isinstance(config, config_dict.ConfigDict):
    raise ConfigError(
      'config',
      spec,
      f'get_config returned a {type(config).__name__}; allowed: '
      'an ml_collections ConfigDict (start from configs/base.py)',
    )
  return config


def load_config(
  source: str | config_dict.ConfigDict, overrides: Mapping[str, Any] | None = None
) -> config_dict.ConfigDict:
  """A config file spec (a path, optionally `:arg`) or an assembled ConfigDict (a workdir's saved
  config, a Hugging Face import's), then `overrides` ({'model.n_layers': 2, ...}) → validated
  once, and frozen (a `RunConfig`)."""
  if isinstance(source, RunConfig):
    source = source.as_configdict()  # a new config from a loaded one: overrides, then validated
  config = read_config(source) if isinstance(source, str) else source
  for key, value in (overrides or {}).items():
    set_key(config, key, value)
  validate(config)
  return RunConfig(config)


class RunConfig(config_dict.FrozenConfigDict):
  """A validated run config, frozen: load_config makes it, and it cannot change afterwards (to
  vary one, load again: `load_config(config, {'model.n_layers': 4})`). Read like the ConfigDict
  it came from (`config.model.d_model`); its to_json is the ConfigDict's."""


def is_validated(config) -> bool:
  """`config` is a whole run config that load_config made (its parts are not marked)."""
  return isinstance(config, RunConfig)


def require_loaded(config, what: str) -> None:
  """One line unless `config` came from load_config: `what` trusts it without validating."""
  if not isinstance(config, RunConfig):
    raise ConfigError(
      'config',
      type(config).__name__,
      f'{what} takes the validated config load_config returns; allowed: '
      'mllm.load_config(path or ConfigDict, overrides)',
    )


def config_diff(
  config: config_dict.ConfigDict, base: config_dict.ConfigDict
) -> dict[str, tuple[Any, Any]]:
  """{path: (base value, value)} for every leaf that differs from `base`."""
  mine, theirs = flatten(config), flatten(base)
  return {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k, object()) != v}
