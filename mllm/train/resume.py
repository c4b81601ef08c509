"""Resuming a workdir: is its checkpoint this config's? (Starting from another run's parameters,
`train.init_from`, is mllm/train/init_from.py.)

A workdir remembers its config twice: config.json beside the checkpoints, and a copy inside every
checkpoint (its `config` item). A resume compares the structure of the saved state (names, shapes
and dtypes from Orbax's metadata; no array is read) with the one this config builds. If they differ,
the config changed; the checkpoint is not broken. So the run is refused in one line naming the
config keys whose change alters the state, found by applying each changed key alone to the saved
config. Nothing is moved or deleted.

To keep the parameters but not the rest (say, turning gradient clipping off changes the optimizer
state), start a new workdir from them: `--config.train.init_from=workdir:OLD_WORKDIR`
(mllm/train/init_from.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ml_collections import config_dict

from mllm.checks import ConfigError, InputError, input_error
from mllm.config import is_validated, load_config
from mllm.config_keys import flatten, set_path
from mllm.config_versions import upgrade
from mllm.paths import RunDir
from mllm.train.checkpoint import Checkpointer
from mllm.train.checkpoint_folder import note
from mllm.train.state import abstract_state
from mllm.train.state_signature import Signature, describe_diff, only, signature

# The state's structure depends only on these sections (the data, mesh and seed do not change it).
STATE_SECTIONS = ('model.', 'train.')


def read_config_json(workdir: str) -> dict | None:
  """The workdir's config.json, None if there is none; a one-line InputError if it is damaged."""
  path = RunDir(workdir).config
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      saved = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    problem = (
      f'is not valid JSON ({err})' if isinstance(err, ValueError) else f'cannot be read ({err})'
    )
    raise InputError(
      '--workdir',
      workdir,
      f'its config.json {problem}; allowed: the config.json '
      'mllm wrote, or none: delete it and the config saved inside the latest '
      'checkpoint is used',
    ) from None
  if not isinstance(saved, dict) or not isinstance(saved.get('model'), dict):
    raise InputError(
      '--workdir',
      workdir,
      'its config.json holds no mllm config (no "model" '
      'section); allowed: the config.json mllm wrote, or none: delete it and the '
      'config saved inside the latest checkpoint is used',
    )
  try:
    return upgrade(saved)  # written by an older mllm: in this version's shape
  except ValueError as err:
    raise InputError(
      '--workdir', workdir, f'its config.json: {err} (it was written by a newer mllm)'
    ) from None


def saved_config(
  workdir: str, ckpt: Checkpointer, step: int, log: Callable[[str], None] = note
) -> dict | None:
  """The config the run in `workdir` was saved with: config.json, else the one inside `step`."""
  saved = read_config_json(workdir)
  if saved is not None:
    return saved
  saved = ckpt.saved_config(step)
  if saved is not None:
    log(f'note: {workdir} has no config.json; using the config saved in checkpoint step {step}')
  return saved


def run_config(
  workdir: str,
  like: config_dict.ConfigDict,
  ckpt: Checkpointer | None = None,
  step: int | None = None,
  log: Callable[[str], None] = note,
) -> config_dict.ConfigDict | None:
  """The one way a run's saved config is read back: config.json, else (given its checkpointer)
  the copy inside checkpoint `step`, upgraded to this version's shape (mllm/config_versions.py)
  and laid over `like` (a full config: the keys an older run did not save); None if neither."""
  saved = read_config_json(workdir) if ckpt is None else saved_config(workdir, ckpt, step, log)
  return None if saved is None else as_config(saved, like)


def _flat_json(tree: dict) -> dict[str, Any]:
  """{'model.n_layers': 4, ...} of a config read back from JSON."""
  return flatten(config_dict.ConfigDict(tree))


def as_config(saved: dict, like: config_dict.ConfigDict) -> config_dict.ConfigDict:
  """`saved` (a config as JSON) as a ConfigDict shaped like `like`; keys unknown to this version
  are dropped, keys it lacks keep `like`'s values."""
  config = config_dict.ConfigDict(like.to_dict())
  known = flatten(config)
  with config.ignore_type():
    for path, value in _flat_json(saved).items():
      if path in known:
        set_path(config, path, value)
  return config


def state_signature(config, params_only: bool = False) -> Signature:
  """The train state's signature for `config`, a RunConfig or a ConfigDict (validated first: a
  saved config laid over today's, a trial with one key changed)."""
  sig = signature(abstract_state(config if is_validated(config) else load_config(config)))
  return only(sig, 'params') if params_only else sig


def changed_keys(saved: dict, config) -> list[tuple[str, Any, Any]]:
  """(key, saved value, new value) for every model/train key that differs."""
  old, new = _flat_json(saved), flatten(config)
  missing = object()
  return [
    (k, old.get(k), new[k])
    for k in sorted(new)
    if k.startswith(STATE_SECTIONS)
    and old.get(k, missing) is not missing
    and _normal(old[k]) != _normal(new[k])
  ]


def _normal(value):
  return list(value) if isinstance(value, tuple) else value  # JSON has no tuples


def keys_that_change_the_state(
  saved: dict, config, params_only: bool = False
) -> list[tuple[str, Any, Any]]:
  """The changed keys that alone change the state's structure (those that cannot be applied alone,
  e.g. n_heads without n_kv_heads, are passed over)."""
  base = as_config(saved, config)
  reference = state_signature(base, params_only)
  found = []
  for key, old, new in changed_keys(saved, config):
    trial = as_config(saved, config)
    with trial.ignore_type():
      set_path(trial, key, new)
    try:
      if state_signature(trial, params_only) != reference:
        found.append((key, old, new))
    except Exception:  # a change may not build alone, e.g. n_heads
      continue
  return found


def _describe_diff(diff: dict[str, list]) -> str:
  paths = diff['only_saved'] + diff['only_expected'] + [d[0] for d in diff['different']]
  return 'parameters' if any(p[0] == 'params' for p in paths) else 'optimizer state'


def _keys_to_blame(saved: dict, config, ckpt: Checkpointer, step: int, params_only: bool):
  """keys_that_change_the_state(), if the saved config describes its own checkpoint (else None: it cannot tell)."""
  if state_signature(as_config(saved, config), params_only) != ckpt.saved_signature(
    step, params_only
  ):
    return None
  # A single key explains it, or only a combination of changes does: then name them all.
  return keys_that_change_the_state(saved, config, params_only) or changed_keys(saved, config)


def mismatch_error(
  workdir: str,
  config,
  ckpt: Checkpointer,
  step: int,
  diff: dict[str, list],
  params_only: bool = False,
  log: Callable[[str], None] = note,
  key: str = '--workdir',
  value: Any = None,
  allowed: str | None = None,
) -> InputError:
  """One line naming the keys whose change makes checkpoint `step` incompatible with `config`.

  key, value: what the line starts with when no key can be named (the workdir by default).
  """
  what = _describe_diff(diff)
  if allowed is None:
    allowed = 'allowed: the saved value to resume, or a new --workdir'
    if what == 'optimizer state':
      allowed += f' with --config.train.init_from=workdir:{workdir} to start from its parameters'
  saved = saved_config(workdir, ckpt, step, log)
  keys = None
  if saved is not None:
    try:
      keys = _keys_to_blame(saved, config, ckpt, step, params_only)
    except Exception:  # an odd saved config: describe the entries
      keys = None
  where = f'the run in {workdir} (checkpoint step {step})'
  if keys:
    listed = ', '.join(f'{k}={new!r} (saved: {old!r})' for k, old, new in keys)
    return ConfigError(f'{listed}: changes the {what} of {where}; nothing was moved; {allowed}')
  return input_error(
    key,
    workdir if value is None else value,
    f'{where} holds {what} this config does not build ({describe_diff(diff)}); '
    f'nothing was moved; {allowed}',
  )


def check_resumable(
  workdir: str,
  config,
  ckpt: Checkpointer,
  abstract,
  *,
  params_only: bool = False,
  log: Callable[[str], None] = note,
) -> int | None:
  """Refuse, in one line naming the keys, a config whose state the workdir's checkpoint does not
  hold. Returns the newest step whose structure matches (None: no readable checkpoint).

  abstract: the abstract train state (or, with params_only, the abstract parameters). Steps whose
  metadata cannot be read are passed over here; `Checkpointer.restore_latest` deals with them.
  """
  steps = ckpt.all_steps()
  if steps:
    read_config_json(workdir)  # a damaged config.json is an error even when it is not needed
  for step in reversed(steps):
    try:
      diff = ckpt.structure_diff(step, abstract, params_only)
    except Exception:
      continue
    if any(diff.values()):
      raise mismatch_error(workdir, config, ckpt, step, diff, params_only, log)
    return step
  return None
