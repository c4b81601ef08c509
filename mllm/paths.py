"""A run's folder: the name of every file in it (RunDir), and the checks of the folders a run
writes to, made before anything is built: one InputError line each (a ConfigError for a config key).

A path that is a file, lies under a file, or cannot be created or written would otherwise fail deep
inside Orbax, Grain or NumPy, minutes into a run, with a traceback.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from mllm.checks import input_error


@dataclasses.dataclass(frozen=True)
class RunDir:
  """The files of a run's folder (`--workdir`), named once: training, evaluation, generation, HF
  import and the experiment runner all find them here. `RunDir(workdir).metrics`, ..."""

  root: str

  def _file(self, name: str) -> str:
    return os.path.join(self.root, name)

  @property
  def config(self) -> str:
    """The config the run trains with (JSON; a relaunch without --config reads it)."""
    return self._file('config.json')

  @property
  def checkpoints(self) -> str:
    """Orbax's folder: one subfolder per saved step (mllm/train/checkpoint.py)."""
    return os.path.join(os.path.abspath(self.root), 'checkpoints')

  @property
  def metrics(self) -> str:
    """One JSON record per logged step and per evaluation (mllm/train/metrics.py)."""
    return self._file('metrics.jsonl')

  @property
  def tensorboard(self) -> str:
    return self._file('tensorboard')

  @property
  def loss_plot(self) -> str:
    return self._file('loss.png')

  def run_log(self, process: int = 0) -> str:
    """Library logs and background tracebacks of process `process` (mllm/train/logs.py)."""
    return self._file('run.log' if process == 0 else f'run.{process}.log')

  @property
  def tokenizer(self) -> str:
    """The BPE tokenizer the run trained (HF `tokenizers` JSON); absent for byte-level runs."""
    return self._file('tokenizer.json')


def _first_existing(path: str) -> str:
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path


def writable_dir(key: str, path: str) -> str:
  """Create `path` if needed and prove it writable (a real write: root passes os.access checks
  that the filesystem then refuses); returns the absolute path."""
  path = os.path.abspath(os.path.expanduser(path))
  existing = _first_existing(path)
  if not os.path.isdir(existing):
    where = 'is a file' if existing == path else f'lies under {existing}, which is a file'
    raise input_error(key, path, f'{where}; allowed: a folder (it is created if missing)')
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as err:
    raise input_error(
      key,
      path,
      f'cannot be written ({err.strerror or err}); allowed: a folder '
      'this user can create and write',
    ) from None
  return path


def existing_dir(key: str, path: str, what: str) -> str:
  """An existing folder (for reading: eval never creates its workdir)."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.exists(path):
    raise input_error(key, path, f'no such folder; allowed: {what}')
  if not os.path.isdir(path):
    raise input_error(key, path, f'is a file; allowed: {what}')
  return path


# A checkpoint step's folder (checkpoints/<step>/), as Orbax commits it: both markers are written
# into the tmp folder before its commit rename (AtomicRenameTemporaryPath).
COMMIT_MARKERS = ('_CHECKPOINT_METADATA', 'commit_success.txt')


DELETING = '.deleting'


TMP_MARKER = '.orbax-checkpoint-tmp'


def is_committed(path: str) -> bool:
  return any(os.path.exists(os.path.join(path, m)) for m in COMMIT_MARKERS)


def committed_steps(workdir: str) -> list[int]:
  """The steps a run in `workdir` has fully saved (what a restart resumes from), read from the
  folder names and commit markers without starting Orbax."""
  directory = RunDir(workdir).checkpoints
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(n) for n in names if n.isdigit() and is_committed(os.path.join(directory, n)))
