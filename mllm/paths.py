"""Folders a run writes to, checked before anything is built: one ConfigError line each.

A path that is a file, lies under a file, or cannot be created or written would otherwise fail deep
inside Orbax, Grain or NumPy, minutes into a run, with a traceback.
"""

from __future__ import annotations

import os
import tempfile

from mllm.config import ConfigError


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
    raise ConfigError(key, path, f'{where}; allowed: a folder (it is created if missing)')
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as err:
    raise ConfigError(
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
    raise ConfigError(key, path, f'no such folder; allowed: {what}')
  if not os.path.isdir(path):
    raise ConfigError(key, path, f'is a file; allowed: {what}')
  return path
