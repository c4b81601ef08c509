"""Orbax checkpoints of the train state, the Grain iterator and the run's config.

Layout of a workdir:
    config.json             the resolved config of the run
    tokenizer.json          (BPE) the tokenizer trained for this run
    checkpoints/<step>/     Orbax: `state` (params, optimizer, step, rng), `data` (iterator state),
                            `config` (the config it was saved with)
    checkpoints/.deleting/  old steps on their way out (max_to_keep)
    metrics.jsonl, tensorboard/, loss.png

How no checkpoint is ever lost:
- Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and commits it by renaming, so a step
  folder is complete or was not written by Orbax. A tmp folder left by a kill is removed at start.
- Dropping an old step (max_to_keep) is a rename into `.deleting/` (Orbax's `todelete_subdir`),
  whose contents are purged at start and before each save: a kill mid-deletion leaves garbage only
  there. A marker-less step older than the newest complete one is a deletion that did not finish
  (an rmtree killed half-way, as earlier versions deleted): it is finished and logged.
- `restore_latest` reads each step's saved structure (Orbax's metadata, not the arrays) first. A
  structure that differs from this config's is a config mismatch, never corruption: StateMismatch,
  and nothing is touched. A step that fails to read is moved aside only once an older one has
  restored, and the log says which one and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from mllm.checks import InputError
from mllm.config_versions import VERSION, VERSION_KEY, upgrade
from mllm.paths import DELETING, TMP_MARKER, RunDir, committed_steps
from mllm.train.checkpoint_folder import (
  CheckpointWriteError,
  note,
  purge_deleted,
  read_failure,
  tidy,
)
from mllm.train.state_signature import Signature, StateMismatch, compare, only, signature

# --------------------------------------------------------------------------------------------
# The checkpointer.
# --------------------------------------------------------------------------------------------


class Checkpointer:
  """Saves and restores {state, data iterator, config} at a step; async, keeping max_to_keep.

  read_only: for reading another run's checkpoints (train.init_from): no tidying, no writes.
  """

  def __init__(
    self,
    workdir: str,
    *,
    max_to_keep: int = 3,
    async_save: bool = True,
    read_only: bool = False,
    log: Callable[[str], None] = note,
  ):
    self.directory = RunDir(workdir).checkpoints
    self.read_only, self.log = read_only, log
    self.in_flight: int | None = None  # the step whose save has not finished
    self.failed: CheckpointWriteError | None = None
    if not read_only:
      tidy(self.directory, log)
      if jax.process_count() > 1:  # the others list steps only once process 0 has tidied
        multihost_utils.sync_global_devices('mllm-checkpoint-tidy')
    # Orbax's own read_only mode logs three warnings per use; a manager that is never asked to
    # save (and neither creates nor tidies the folder) reads the same.
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=not read_only,
      enable_async_checkpointing=async_save,
      todelete_subdir=DELETING,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state, iterator=None, config: dict | None = None) -> None:
    """Start saving `step` (async: it commits in the background). Raises CheckpointWriteError
    when this save, or the one still in flight before it, fails."""
    assert not self.read_only, 'a read-only Checkpointer never saves'
    self.wait()  # the previous save's failure is that step's, not this one's
    if jax.process_index() == 0:
      purge_deleted(self.directory)  # steps Orbax dropped after the previous saves
    items = {'state': ocp.args.StandardSave(state)}
    if iterator is not None:
      items['data'] = grain.checkpoint.CheckpointSave(iterator)
    if config is not None:
      items['config'] = ocp.args.JsonSave(config)
    self.in_flight = step
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as err:  # Orbax raises many types
      raise self._failed(err) from None

  # -- reading ---------------------------------------------------------------------------------

  def saved_signature(self, step: int, params_only: bool = False) -> Signature:
    """The structure of the state saved at `step` (or of its parameters), from its metadata;
    raises if unreadable."""
    metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(self.step_dir(step)) / 'state')
    tree = metadata.tree if hasattr(metadata, 'tree') else metadata
    sig = signature(tree)
    if not sig:
      raise ValueError(f'step {step} holds no arrays')
    return only(sig, 'params') if params_only else sig

  def structure_diff(self, step: int, abstract, params_only: bool = False) -> dict[str, list]:
    """compare() of what `step` holds with `abstract` (the abstract train state, or with
    params_only the abstract parameters); all empty when they agree. Raises if unreadable."""
    expected = signature({'params': abstract} if params_only else abstract)
    return compare(self.saved_signature(step, params_only), expected)

  def saved_config(self, step: int) -> dict | None:
    """The config the step was saved with, or None (older checkpoints have none)."""
    path = os.path.join(self.step_dir(step), 'config')
    if not os.path.isdir(path):
      return None
    try:
      config = ocp.JsonCheckpointHandler().restore(epath.Path(path))
    except Exception:  # a damaged copy: the caller falls back
      return None
    if not isinstance(config, dict):
      return None
    try:
      return upgrade(config)
    except ValueError:  # a version this code does not know: as a damaged copy
      return None

  def restore(self, step: int, abstract_state, iterator=None):
    """The state at `step` on the shardings of `abstract_state`; restores `iterator` in place."""
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    data_state = None if iterator is None else self.data_state_of_another_job(step)
    if iterator is not None and data_state is None:
      items['data'] = grain.checkpoint.CheckpointRestore(iterator)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))['state']
    if data_state is not None:
      iterator.set_state(data_state)
      iterator.start_prefetch()
    return restored

  def data_state_of_another_job(self, step: int) -> dict | None:
    """The data iterator's state at `step` when it was saved by a job of another process count
    (grain names each process's file process_<i>-of-<n>.json); None when this job's own file is
    there. Every process's state counts global batches (each reads its rows of the same global
    batch, mllm/data/pipeline.py), so the saved ones agree and any of them serves."""
    folder = os.path.join(self.directory, str(step), 'data')
    mine = f'process_{jax.process_index()}-of-{jax.process_count()}.json'
    if not os.path.isdir(folder) or os.path.exists(os.path.join(folder, mine)):
      return None
    names = sorted(n for n in os.listdir(folder) if n.startswith('process_'))
    states = []
    for name in names:
      with open(os.path.join(folder, name), encoding='utf-8') as f:
        states.append(json.load(f))
    if not states:
      return None
    if any(state != states[0] for state in states):
      raise InputError(
        '--workdir',
        self.directory,
        f'checkpoint step {step} was saved by '
        f'{len(names)} processes whose data positions differ ({states}), so it '
        f'cannot be resumed by {jax.process_count()}; allowed: resume it with '
        f'{len(names)} processes',
      )
    return states[0]

  def restore_params(self, step: int, abstract_params):
    """Only the parameters of the state at `step` (Orbax partial restore), on their shardings."""
    item = {'params': abstract_params}
    args = ocp.args.PyTreeRestore(
      item=item,
      partial_restore=True,
      restore_args=ocp.checkpoint_utils.construct_restore_args(item),
    )
    return self.manager.restore(step, args=ocp.args.Composite(state=args))['state']['params']

  def restore_latest(
    self, abstract, iterator=None, *, params_only: bool = False, set_aside: bool = True
  ) -> tuple[int | None, Any]:
    """(step, restored) of the newest checkpoint that restores, or (None, None) if there is none.

    abstract: the abstract train state, or with params_only its abstract parameters (then only
    those are read, and changes to the optimizer do not matter).
    A step whose saved structure differs from `abstract` raises StateMismatch at once. A step that
    fails to read is skipped; once an older one has restored, the skipped ones are moved aside
    (set_aside, for training) or left alone (evaluation), and the log says which and why. If no
    step restores, an InputError lists them and nothing is moved.
    """
    failures: list[tuple[int, str]] = []
    for step in reversed(self.all_steps()):
      try:
        diff = self.structure_diff(step, abstract, params_only)
        if any(diff.values()):
          raise StateMismatch(step, diff)
        restored = (
          self.restore_params(step, abstract)
          if params_only
          else self.restore(step, abstract, iterator)
        )
      except StateMismatch:
        raise
      except Exception as err:  # Orbax raises many types here
        if jax.process_count() > 1:
          raise  # processes must agree on the step; do not guess on one of them
        failures.append((step, read_failure(err)))
        continue
      self._report_skipped(failures, step, set_aside)
      return step, restored
    if failures:
      listed = '; '.join(f'step {s}: {r}' for s, r in failures)
      raise InputError(
        '--workdir',
        os.path.dirname(self.directory),
        f'no checkpoint in it can be read ({listed}); nothing was moved or '
        'deleted; allowed: a workdir with a readable checkpoint, or a new '
        '--workdir (after moving the damaged steps away)',
      )
    return None, None

  def _report_skipped(self, failures, restored_step: int, set_aside: bool) -> None:
    for step, reason in failures:
      where = ''
      if set_aside and not self.read_only and jax.process_index() == 0:
        target = f'{self.step_dir(step)}.unreadable-{int(time.time())}'
        os.rename(self.step_dir(step), target)
        where = f'; moved it to {os.path.basename(target)}'
      self.log(
        f'warning: checkpoint step {step} could not be read ({reason}); used step '
        f'{restored_step} instead{where}'
      )
    if failures and set_aside and not self.read_only:
      self.manager.reload()

  def wait(self) -> None:
    """Wait for the save in flight; CheckpointWriteError if it failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as err:
      raise self._failed(err) from None
    self.in_flight = None

  def close(self) -> None:
    """Wait for the last save and close; after a failed save, only close (the error was raised)."""
    if self.failed is None:
      self.wait()
    with contextlib.suppress(Exception) if self.failed else contextlib.nullcontext():
      self.manager.close()
    if not self.read_only and jax.process_index() == 0:
      purge_deleted(self.directory)  # what the last saves dropped

  def _failed(self, err: BaseException) -> CheckpointWriteError:
    """The error for the save in flight that failed with `err`, after removing its partial
    folder: the next start would remove it too, but a full disk needs the space now."""
    step = self.in_flight
    if jax.process_index() == 0:
      for name in os.listdir(self.directory) if os.path.isdir(self.directory) else []:
        if name.startswith(f'{step}{TMP_MARKER}'):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    good = [s for s in committed_steps(os.path.dirname(self.directory)) if s != step]
    self.failed = CheckpointWriteError(step, self.directory, err, max(good, default=None))
    return self.failed


def write_config(workdir: str, config) -> None:
  """config.json, written atomically (a kill never leaves half a file)."""
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    path = RunDir(workdir).config
    with open(path + '.tmp', 'w') as f:
      json.dump(config_as_dict(config), f, indent=2, sort_keys=True)
    os.replace(path + '.tmp', path)


def config_as_dict(config) -> dict:
  """The config as JSON, with the schema version it is written in (mllm/config_versions.py)."""
  return {VERSION_KEY: VERSION, **json.loads(config.to_json_best_effort(sort_keys=True))}
