"""Orbax checkpoints of the train state and the Grain iterator, plus the run's resolved config.

Layout of a workdir:
    config.json          the resolved config of the run (a resume checks the model shape against it)
    tokenizer.json       (BPE) the tokenizer trained for this run
    checkpoints/<step>/  Orbax: `state` (params, optimizer, step, rng) and `data` (iterator state)
    metrics.jsonl, tensorboard/, loss.png
"""
from __future__ import annotations

import json
import os
import time
import warnings

import grain
import jax
import orbax.checkpoint as ocp

from mllm.config import ConfigError, flatten, set_path

# Orbax writes each step to `<step>.orbax-checkpoint-tmp-*` and renames it when complete; the step
# metadata file (or, on object stores, commit_success.txt) marks a finished step.
COMMIT_MARKERS = ('_CHECKPOINT_METADATA', 'commit_success.txt')


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), 'checkpoints')


def set_aside_incomplete_steps(directory: str) -> list[str]:
  """Move bare `<step>/` folders without a commit marker out of Orbax's way, with a warning.

  Orbax would count them as steps and fail to restore the latest; they come from copies or crashes
  outside Orbax's atomic rename. Nothing is deleted: they become `<step>.incomplete-<time>`.
  """
  moved = []
  if not os.path.isdir(directory) or jax.process_index() != 0:
    return moved
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if name.isdigit() and os.path.isdir(path) and not any(
        os.path.exists(os.path.join(path, m)) for m in COMMIT_MARKERS):
      target = f'{path}.incomplete-{int(time.time())}'
      os.rename(path, target)
      warnings.warn(f'checkpoint step {name} in {directory} has no commit marker (an interrupted '
                    f'or partial copy); skipped it and moved it to {os.path.basename(target)}',
                    stacklevel=2)
      moved.append(target)
  return moved


class Checkpointer:
  """Saves and restores {state, data iterator} at a step; async, keeping the newest max_to_keep."""

  def __init__(self, workdir: str, *, max_to_keep: int, async_save: bool = True):
    self.directory = checkpoint_dir(workdir)
    set_aside_incomplete_steps(self.directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, iterator=None) -> None:
    items = {'state': ocp.args.StandardSave(state)}
    if iterator is not None:
      items['data'] = grain.checkpoint.CheckpointSave(iterator)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state, iterator=None):
    """The state at `step` on the shardings of `abstract_state`; restores `iterator` in place."""
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    if iterator is not None:
      items['data'] = grain.checkpoint.CheckpointRestore(iterator)
    return self.manager.restore(step, args=ocp.args.Composite(**items))['state']

  def restore_latest(self, abstract_state, iterator=None):
    """(step, state) of the newest checkpoint that restores, or (None, None) if there is none.

    A step that fails to restore (truncated or corrupted files) is moved aside with a warning
    and the next older one is tried, so a damaged checkpoint never blocks a resume.
    """
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        return step, self.restore(step, abstract_state, iterator)
      except Exception as err:  # pylint: disable=broad-except  (Orbax raises many types here)
        if jax.process_count() > 1:
          raise  # processes must agree on the step; do not guess on one of them
        path = os.path.join(self.directory, str(step))
        target = f'{path}.unreadable-{int(time.time())}'
        os.rename(path, target)
        warnings.warn(f'checkpoint step {step} could not be restored ({type(err).__name__}: '
                      f'{str(err).splitlines()[0][:200] if str(err) else ""}); moved it to '
                      f'{os.path.basename(target)} and trying an older step', stacklevel=2)
        self.manager.reload()
    return None, None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def write_config(workdir: str, config) -> None:
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))


def read_config_json(workdir: str) -> dict | None:
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def check_resumable(workdir: str, config, param_shapes_of) -> None:
  """Refuse (one line) to resume `workdir` with a config whose parameters have other shapes.

  param_shapes_of(model_config) -> {name: shape}. Changes that keep the shapes (dropout, schedule,
  steps, ...) are allowed.
  """
  saved = read_config_json(workdir)
  if saved is None:
    return
  from ml_collections import config_dict
  saved_model = config_dict.ConfigDict(saved['model'])
  if param_shapes_of(saved_model) == param_shapes_of(config.model):
    return
  new, old = flatten(config.model), flatten(saved_model)
  changed = [k for k in sorted(new) if old.get(k, object()) != new[k]]
  key = changed[0] if changed else ''
  for candidate in changed:  # name the key that changes the shapes, not just any changed key
    trial = config_dict.ConfigDict(saved['model'])
    with trial.ignore_type():  # JSON has no placeholders: an unset key reads back as None
      set_path(trial, candidate, new[candidate])
    try:
      if param_shapes_of(trial) != param_shapes_of(saved_model):
        key = candidate
        break
    except Exception:  # pylint: disable=broad-except  (a partial change may not build alone)
      continue
  raise ConfigError(f'model.{key}', new.get(key), f'{workdir} holds a run with model.{key}='
                    f'{old.get(key)!r}, and this changes the parameter shapes; allowed: the same '
                    'model shape to resume, or a new --workdir')

