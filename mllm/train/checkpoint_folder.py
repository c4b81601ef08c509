"""The checkpoint folder around Orbax: tidying what a killed run left half-done before Orbax
looks at it, and the one-line error of a save that failed (CheckpointWriteError)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import time
from collections.abc import Callable

import jax

from mllm.checks import RunFault, first_line
from mllm.paths import DELETING, TMP_MARKER, is_committed


def note(message: str) -> None:
  print(message, file=sys.stdout, flush=True)


# errno values a person fixes (space, quota, permissions, a read-only mount), by the words Orbax
# and TensorStore quote them with.
FIXABLE = {
  errno.ENOSPC: 'No space left on device',
  errno.EDQUOT: 'Disk quota exceeded',
  errno.EACCES: 'Permission denied',
  errno.EROFS: 'Read-only file system',
}


class CheckpointWriteError(RunFault):
  """A save that failed (in Orbax's background thread or at once): which step, where, why, and
  the newest step that is still whole. `fixable`: the cause is the machine's (disk full,
  permissions), which the user can fix and then resume."""

  def __init__(self, step: int, directory: str, cause: BaseException, last_good: int | None):
    self.step, self.directory, self.last_good = step, directory, last_good
    self.reason = _write_failure(cause)
    self.fixable = any(words in self.reason for words in FIXABLE.values())
    kept = (
      f'the last good checkpoint is step {last_good}'
      if last_good is not None
      else 'no checkpoint of this run is complete yet'
    )
    todo = 'free space there or fix its permissions' if self.fixable else 'see the run log'
    super().__init__(
      f'checkpoint step {step} could not be written in {directory} ({self.reason}); its '
      f'partial folder was removed; {kept}; {todo}, then run again to resume'
    )


def read_failure(err: BaseException) -> str:
  """Why a step could not be read, in one line: TensorStore's own reason where the chain holds
  one ('reading params.embed.embedding.value: ZSTD_decompressStream() failed: ...'), else the
  first line without the object reprs TensorStore appends (`<bound method ... TensorStore({...`)."""
  for e in (err, err.__cause__, err.__context__):
    found = e is not None and re.search(r'Error reading "([^"]+)"[^:]*: (.+?)(?:; at |$)', str(e))
    if found:
      return f'reading {found[1]}: {found[2]}'[:200]
  text = first_line(err).split(' See full TensorStore details')[0]
  return re.sub(r'<[^<>]*>?$|<[^<>]*>', '', text).strip()


def _write_failure(err: BaseException) -> str:
  """The cause of a failed save in a few words: the OS error where one is quoted ('No space left
  on device'), else the exception's first line, without the file paths Orbax repeats."""
  for e in (err, err.__cause__, err.__context__):
    if isinstance(e, OSError) and e.errno in FIXABLE:
      return FIXABLE[e.errno]
  text = str(err)
  for code, words in FIXABLE.items():
    if words in text or f"os_error_code='{code}'" in text or f'[Errno {code}]' in text:
      return words
  return first_line(err)


def purge_deleted(directory: str) -> int:
  """Remove what `.deleting/` holds (steps Orbax dropped); the folder itself stays, since Orbax
  may be renaming the next one into it. Returns how many entries were removed."""
  trash = os.path.join(directory, DELETING)
  if not os.path.isdir(trash):
    return 0
  names = os.listdir(trash)
  for name in names:
    path = os.path.join(trash, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
  return len(names)


def tidy(directory: str, log: Callable[[str], None] = note) -> None:
  """Finish what a killed run left half-done in `directory`, saying what it did.

  - entries of `.deleting/`: purged (dropped steps whose removal was interrupted);
  - `<step>.orbax-checkpoint-tmp-*`: removed (a save that never committed);
  - a step folder without commit marker, older than the newest committed step: an interrupted
    deletion, finished;
  - a step folder without commit marker, newer than every committed one: not Orbax's (a partial
    copy); moved aside as `<step>.incomplete-<time>`, never deleted.
  """
  if not os.path.isdir(directory) or jax.process_index() != 0:
    return
  purged = purge_deleted(directory)
  if purged:
    log(
      f'note: finished deleting {purged} old checkpoint(s) in {directory}/{DELETING} '
      '(an interrupted max_to_keep cleanup)'
    )
  steps, bare = [], []
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if TMP_MARKER in name and os.path.isdir(path):
      shutil.rmtree(path, ignore_errors=True)
      log(f'note: removed {name}, a checkpoint save that was interrupted before it committed')
    elif name.isdigit() and os.path.isdir(path):
      (steps if is_committed(path) else bare).append(int(name))
  newest = max(steps, default=None)
  for step in sorted(bare):
    path = os.path.join(directory, str(step))
    if newest is not None and step < newest:
      shutil.rmtree(path, ignore_errors=True)
      log(
        f'note: finished deleting checkpoint step {step}: it had lost its commit marker, so '
        f'its deletion (max_to_keep) was interrupted; the newest step is {newest}'
      )
    else:
      target = f'{path}.incomplete-{int(time.time())}'
      os.rename(path, target)
      log(
        f'warning: checkpoint step {step} in {directory} has no commit marker (a partial copy, '
        f'or a save outside Orbax); skipped it and moved it to {os.path.basename(target)}'
      )
