"""`train.init_from`: a new run starts from the parameters of another run's checkpoint
('workdir:PATH', its latest step or PATH/checkpoints/<step>) or of a Hugging Face checkpoint
('hf:PATH'), and adopts that run's tokenizer; the optimizer, step count and data order start anew.
A structure that does not fit is refused as a resume is (mllm/train/resume.py's mismatch_error)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from mllm.checks import ConfigError
from mllm.interop.hf import HFImportError, hf_params
from mllm.paths import RunDir
from mllm.train.checkpoint import Checkpointer
from mllm.train.checkpoint_folder import note
from mllm.train.resume import mismatch_error
from mllm.train.state_signature import StateMismatch
from mllm.validation import INIT_SOURCES


def _source(init_from: str) -> tuple[str, int | None]:
  """'workdir:PATH' → (workdir, step or None for its latest); 'hf:PATH' → (PATH, None)."""
  kind, _, path = init_from.partition(':')
  assert kind in INIT_SOURCES, kind  # validate() checked it
  path = os.path.abspath(os.path.expanduser(path.strip()))
  parent = os.path.dirname(path)
  if os.path.basename(path).isdigit() and parent == RunDir(os.path.dirname(parent)).checkpoints:
    return os.path.dirname(parent), int(os.path.basename(path))
  return path, None


def adopt_tokenizer(config, workdir: str, log: Callable[[str], None] = note) -> None:
  """Copy the train.init_from run's tokenizer.json into a new workdir: its parameters were trained
  on those token ids, and a BPE trained anew (on other data or settings) would scramble them."""
  source = RunDir(_source(config.train.init_from)[0]).tokenizer
  target = RunDir(workdir).tokenizer
  if config.data.tokenizer != 'bpe' or os.path.exists(target) or not os.path.isfile(source):
    return
  os.makedirs(workdir, exist_ok=True)
  tmp = f'{target}.tmp-{os.getpid()}'  # every process of a multi-host run copies the same file
  shutil.copyfile(source, tmp)
  os.replace(tmp, target)
  log(f'note: using the tokenizer of {os.path.dirname(source)} (train.init_from)')


def init_params(config, abstract_params, log: Callable[[str], None] = note):
  """The parameters `train.init_from` names, restored onto the shardings of `abstract_params`."""
  value = config.train.init_from
  workdir, step = _source(value)
  if value.startswith('hf:'):
    return _hf_params(config, workdir, abstract_params, log)
  if not os.path.isdir(RunDir(workdir).checkpoints):
    raise ConfigError(
      'train.init_from',
      value,
      f'{workdir} holds no checkpoints/ folder; allowed: '
      "'workdir:PATH' with PATH a training workdir or one of its "
      'checkpoints/<step> folders',
    )
  ckpt = Checkpointer(workdir, read_only=True, log=log)
  try:
    steps = ckpt.all_steps()
    if not steps or (step is not None and step not in steps):
      raise ConfigError(
        'train.init_from',
        value,
        'no such checkpoint; allowed: a step of '
        + (', '.join(map(str, steps)) if steps else 'a run that has saved one'),
      )
    try:
      if step is None:
        step, params = ckpt.restore_latest(abstract_params, params_only=True, set_aside=False)
      else:
        diff = ckpt.structure_diff(step, abstract_params, params_only=True)
        if any(diff.values()):
          raise StateMismatch(step, diff)
        params = ckpt.restore_params(step, abstract_params)
    except StateMismatch as err:
      raise mismatch_error(
        workdir,
        config,
        ckpt,
        err.step,
        err.diff,
        params_only=True,
        log=log,
        key='train.init_from',
        value=value,
        allowed='allowed: a model config with the same parameter shapes as that run',
      ) from None
  finally:
    ckpt.close()
  log(
    f'initialized the parameters from {workdir} step {step} (train.init_from); the optimizer, '
    'step count and data order start anew'
  )
  return params


def check_hf_folder(config, path: str) -> None:
  """train.init_from='hf:PATH' names a folder with a config.json (one line if not)."""
  if not os.path.isfile(os.path.join(path, 'config.json')):
    raise ConfigError(
      'train.init_from',
      config.train.init_from,
      f'{path} has no config.json; allowed: \'hf:PATH\' with PATH a Hugging Face checkpoint folder',
    )


def _hf_params(config, path: str, abstract_params, log: Callable[[str], None]):

  check_hf_folder(config, path)
  try:
    params = hf_params(path, config, abstract_params)
  except HFImportError as err:
    raise ConfigError('train.init_from', config.train.init_from, str(err)) from None
  log(
    f'initialized the parameters from the Hugging Face checkpoint {path} (train.init_from); '
    'the optimizer, step count and data order start anew'
  )
  return params
