"""The King James Bible (1611, public domain) from Debian's `bible-kjv-text`: English prose.

`data.source='kjv'`, the second built-in corpus beside the Python sources of 'stdlib'. The package
ships `/usr/lib/bible.data`: the 4.4 MB text, one verse a line (`Ge1:1 In the beginning God ...`),
cut into 64 KiB windows, each compressed on its own with Unix `compress` (LZW, the .Z format
without its 3-byte header), behind a header and a table of the windows' offsets:

    0x00  b'EC02Compressed Data File', zero-padded
    0x54  u32 window size (65536)    0x58  u32 window count n
    0x5c  n + 1 u32 offsets (big-endian); the last is the file's length
    then  the .Z header (0x1f 0x9d, flags), once, before the first window

`unlzw3` decodes the windows. A document is one chapter (1,189), keyed `Ge1`, its verses one a
line without their references, so the train/val split is by chapter.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import struct
import sys
from collections.abc import Iterator
from typing import Any

import unlzw3

from mllm.checks import ConfigError
from mllm.data.document import Document, Source

MAGIC = b'EC02Compressed Data File'
Z_MAGIC = b'\x1f\x9d'
HEADER = struct.Struct('>II')  # window size, window count
HEADER_AT = 0x54
PACKAGE = 'bible-kjv-text'
# Where Debian installs the file, then where `make install` unpacks the package into the venv.
DEFAULT_PATHS = (
  '/usr/lib/bible.data',
  os.path.join(sys.prefix, 'share', PACKAGE, 'usr', 'lib', 'bible.data'),
)
# 'Ge1:1 In the beginning ...': book abbreviation, chapter, verse, text.
VERSE = re.compile(r'^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$')


def default_path() -> str | None:
  return next((p for p in DEFAULT_PATHS if os.path.isfile(p)), None)


def _bad(path: str, why: str) -> ConfigError:
  return ConfigError(
    'data.path', path, f"{why}; allowed for data.source='kjv': the bible.data of {PACKAGE}"
  )


def read_windows(path: str) -> list[bytes]:
  """The decompressed windows of a bible.data file, in order."""
  with open(path, 'rb') as f:
    data = f.read()
  if not data.startswith(MAGIC) or len(data) < HEADER_AT + HEADER.size:
    raise _bad(path, 'is not a bible.data file (no EC02 header)')
  window, count = HEADER.unpack_from(data, HEADER_AT)
  table_end = HEADER_AT + HEADER.size + 4 * (count + 1)
  offsets = struct.unpack_from(f'>{count + 1}I', data, HEADER_AT + HEADER.size)
  z_header = data[table_end : table_end + 3]
  if z_header[:2] != Z_MAGIC or offsets[-1] != len(data) or list(offsets) != sorted(offsets):
    raise _bad(path, 'has a damaged window table')
  windows = []
  for i, (start, end) in enumerate(itertools.pairwise(offsets)):
    try:
      text = unlzw3.unlzw(z_header + data[start:end])
    except Exception as err:  # unlzw3 raises ValueError and IndexError on corrupt data
      raise _bad(path, f'window {i} does not decompress ({err})') from None
    if len(text) != window and i < count - 1:
      raise _bad(path, f'window {i} decompresses to {len(text)} bytes, not {window}')
    windows.append(text)
  return windows


def chapters(text: str) -> Iterator[tuple[str, list[str]]]:
  """(`Ge1`, [verse texts]) for each chapter, in the order of the text; other lines are skipped
  (the first line is the edition's title)."""
  key, verses = None, []
  for line in text.splitlines():
    m = VERSE.match(line)
    if not m:
      continue
    chapter = m[1] + m[2]
    if chapter != key:
      if key is not None:
        yield key, verses
      key, verses = chapter, []
    verses.append(m[4])
  if key is not None:
    yield key, verses


class KJVSource(Source):
  """One document per chapter of the King James Bible, verses one a line."""

  def __init__(self, path: str = ''):
    found = os.path.abspath(os.path.expanduser(path)) if path else default_path()
    if found is None or not os.path.isfile(found):
      raise ConfigError(
        'data.path',
        path or 'unset',
        f'no bible.data here (looked in {path or ", ".join(DEFAULT_PATHS)}); '
        f"allowed for data.source='kjv': the file of Debian's {PACKAGE} (`make install` "
        f'unpacks it into .venv, or `apt-get install {PACKAGE}`), or data.path naming one',
      )
    self.path = found

  @functools.cached_property
  def text(self) -> bytes:
    return b''.join(read_windows(self.path))

  @property
  def total_bytes(self) -> int:  # for the progress bar: the decompressed size
    return len(self.text)

  def documents(self) -> Iterator[Document]:
    for key, verses in chapters(self.text.decode('utf-8', errors='replace')):
      yield Document(key, '\n'.join(verses))

  def describe(self) -> dict[str, Any]:
    s = os.stat(self.path)
    return {'kind': 'kjv', 'path': self.path, 'size': s.st_size, 'mtime': s.st_mtime_ns}
