"""Document sources: the stdlib corpus, text / jsonl / parquet files, Hugging Face datasets
(and the King James Bible, mllm/data/bible.py).

A source yields `Document(key, text)`; `key` names the document stably (a relative path, or a
file and row index) and decides its train/val split by a hash, so the split never depends on the
order or the number of documents read. `describe()` is what the corpus cache is keyed on; it lists
files with sizes and modification times but reads no contents.
"""

from __future__ import annotations

import json
import os
import re
import sysconfig
from collections.abc import Iterator
from typing import Any

from mllm.checks import ConfigError, first_line
from mllm.data.bible import KJVSource
from mllm.data.document import Document, Source

# Bytes that text does not hold: NUL and the other C0 controls, except tab, newlines, form feed and
# escape (which real text files do contain).
CONTROL_BYTES = bytes(c for c in range(32) if c not in b'\t\n\v\f\r\x1b') + b'\x7f'
# A file with more bytes than this that are invalid UTF-8 or control bytes is binary (compressed
# data, an image, a Parquet file) or in another encoding (UTF-16 is half NULs): refused, not trained
# on as garbage. Below it, the odd invalid byte becomes U+FFFD.
MAX_NON_TEXT_FRACTION = 0.10


def decode(data: bytes) -> str:
  # Undecodable bytes become U+FFFD rather than ending the run.
  return data.decode('utf-8', errors='replace')


def non_text_bytes(data: bytes) -> int:
  """How many bytes of `data` are invalid UTF-8 or control characters."""
  invalid = len(data) - len(data.decode('utf-8', errors='ignore').encode('utf-8'))
  return invalid + len(data) - len(data.translate(None, CONTROL_BYTES))


class TextCheck:
  """Counts non-text bytes of one file; `check()` refuses the file above MAX_NON_TEXT_FRACTION."""

  def __init__(self, path: str, source: str):
    self.path, self.source, self.bad, self.total = path, source, 0, 0

  def decode(self, data: bytes) -> str:
    self.bad += non_text_bytes(data)
    self.total += len(data)
    return decode(data)

  def check(self) -> None:
    share = self.bad / self.total if self.total else 0.0
    if share > MAX_NON_TEXT_FRACTION:
      raise ConfigError(
        'data.path',
        self.path,
        f'is not UTF-8 text: {share:.0%} of its '
        f'{self.total:,} bytes are invalid UTF-8 or control bytes (binary data, or '
        f'another encoding); allowed for data.source={self.source!r}: UTF-8 text '
        f'with at most {MAX_NON_TEXT_FRACTION:.0%} such bytes',
      )


def _missing(path: str) -> ConfigError:
  return ConfigError(
    'data.path', path, 'no such file or folder; allowed: an existing file or a folder'
  )


def list_files(root: str, suffixes: tuple[str, ...], skip_dirs: tuple[str, ...] = ()) -> list[str]:
  """Files under `root` (recursively) ending in one of `suffixes`, as sorted relative paths."""
  found = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in skip_dirs]
    found += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(suffixes)]
  return sorted(found)


def _file_listing(root: str, rel_paths: list[str]) -> list[tuple[str, int, int]]:
  stats = [os.stat(os.path.join(root, p)) for p in rel_paths]
  return [(p, s.st_size, s.st_mtime_ns) for p, s in zip(rel_paths, stats)]


class FilesSource(Source):
  """One document per file under a folder (or one file): the stdlib corpus and text folders.

  A file that is not text is refused (TextCheck), except in the stdlib corpus: Python sources may
  declare another encoding (PEP 263; its test suite has a KOI8-R module), and that corpus is fixed.
  """

  def __init__(self, kind: str, root: str, files: list[str]):
    self.kind, self.root, self.files = kind, root, files

  def documents(self) -> Iterator[Document]:
    for rel in self.files:
      path = os.path.join(self.root, rel)
      with open(path, 'rb') as f:
        data = f.read()
      if self.kind == 'stdlib':
        yield Document(rel, decode(data))
        continue
      check = TextCheck(path, self.kind)
      text = check.decode(data)
      check.check()
      yield Document(rel, text)

  @property
  def total_bytes(self) -> int:  # for the progress bar
    return sum(os.path.getsize(os.path.join(self.root, p)) for p in self.files)

  def describe(self) -> dict[str, Any]:
    return {'kind': self.kind, 'root': self.root, 'files': _file_listing(self.root, self.files)}


class TextFileSource(Source):
  """A single .txt file: its blank-line-separated blocks are the documents.

  One document per file would put a lone file wholly into train or wholly into val.
  """

  def __init__(self, path: str):
    self.path = path
    self.total_bytes = os.path.getsize(path)

  def documents(self) -> Iterator[Document]:
    check = TextCheck(self.path, 'text')
    with open(self.path, 'rb') as f:
      text = check.decode(f.read())
    check.check()
    blocks = (b.strip('\n') for b in re.split(r'\n[ \t\r\f\v]*\n', text))
    for i, block in enumerate(b for b in blocks if b.strip()):
      yield Document(f'{os.path.basename(self.path)}:{i}', block)

  def describe(self) -> dict[str, Any]:
    s = os.stat(self.path)
    return {'kind': 'text_file', 'path': self.path, 'size': s.st_size, 'mtime': s.st_mtime_ns}


class RowsSource(Source):
  """Rows of jsonl or parquet files, the text in `text_field`; keyed by (file, row index)."""

  def __init__(self, kind: str, root: str, files: list[str], text_field: str):
    self.kind, self.root, self.files, self.text_field = kind, root, files, text_field

  def documents(self) -> Iterator[Document]:
    read = self._jsonl_rows if self.kind == 'jsonl' else self._parquet_rows
    for rel in self.files:
      for i, text in enumerate(read(rel)):
        if text is not None:
          yield Document(f'{rel}:{i}', text)

  def _missing_field(self, rel: str, found) -> ConfigError:
    return ConfigError(
      'data.text_field',
      self.text_field,
      f'no such field in {os.path.join(self.root, rel)}; fields found: '
      + ', '.join(map(str, found)),
    )

  def _jsonl_rows(self, rel: str) -> Iterator[str | None]:
    path = os.path.join(self.root, rel)
    check = TextCheck(path, 'jsonl')
    with open(path, 'rb') as f:
      for n, line in enumerate(f, 1):
        text = check.decode(line)
        if not line.strip():
          continue
        try:
          row = json.loads(text)
        except json.JSONDecodeError as err:
          check.check()  # binary data is better named as such than as bad JSON
          raise ConfigError(
            'data.path', path, f'line {n} is not JSON ({err}); allowed: one JSON object per line'
          ) from None
        if not isinstance(row, dict) or self.text_field not in row:
          raise self._missing_field(rel, row if isinstance(row, dict) else [])
        yield _as_text(row[self.text_field], self.text_field, f'{path} line {n}')
    check.check()

  def _parquet_rows(self, rel: str) -> Iterator[str | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(self.root, rel)
    try:
      pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:  # passed check_parquet_magic, yet unreadable
      raise ConfigError(
        'data.path', path, f'cannot be read as Parquet ({first_line(err)}); allowed: a Parquet file'
      ) from None
    if self.text_field not in pf.schema_arrow.names:
      raise self._missing_field(rel, pf.schema_arrow.names)
    check = TextCheck(path, 'parquet')
    for batch in pf.iter_batches(columns=[self.text_field], batch_size=1024):
      column = batch.column(0)
      if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        # As bytes, so invalid UTF-8 is replaced instead of failing in pyarrow.
        column = column.cast(pa.large_binary())
      for value in column.to_pylist():
        yield (
          check.decode(value)
          if isinstance(value, bytes)
          else _as_text(value, self.text_field, path)
        )
    check.check()

  def describe(self) -> dict[str, Any]:
    return {
      'kind': self.kind,
      'root': self.root,
      'text_field': self.text_field,
      'files': _file_listing(self.root, self.files),
    }


PARQUET_MAGIC = b'PAR1'


def check_parquet_magic(path: str) -> None:
  """A Parquet file starts and ends with b'PAR1'; anything else is refused before reading."""
  size = os.path.getsize(path)
  with open(path, 'rb') as f:
    head = f.read(4)
    f.seek(max(size - 4, 0))
    tail = f.read(4)
  if size < 12 or head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
    raise ConfigError(
      'data.path',
      path,
      'is not a Parquet file (no PAR1 magic at its start and '
      "end); allowed for data.source='parquet': .parquet files; text files go "
      "with data.source='text', JSON lines with 'jsonl'",
    )


def _as_text(value: Any, field: str, where: str) -> str | None:
  if value is None or isinstance(value, str):
    return value
  raise ConfigError(
    'data.text_field',
    field,
    f'holds {type(value).__name__}, not text, in {where}; allowed: a field of strings',
  )


class HFSource(Source):
  """A Hugging Face dataset: a `save_to_disk` folder, or anything `load_dataset` takes."""

  def __init__(self, path: str, name: str | None, split: str, text_field: str):
    self.path, self.name, self.split, self.text_field = path, name, split, text_field
    self.dataset = self._load()
    if text_field not in self.dataset.column_names:
      raise ConfigError(
        'data.text_field',
        text_field,
        f'no such column in the dataset {path!r}; '
        'columns found: ' + ', '.join(self.dataset.column_names),
      )

  def _from_disk(self) -> bool:
    return os.path.isdir(self.path) and any(
      os.path.exists(os.path.join(self.path, f)) for f in ('dataset_dict.json', 'state.json')
    )

  def _load(self):
    import datasets  # only this source needs it (a large import)

    if self._from_disk():
      ds = datasets.load_from_disk(self.path)
      if isinstance(ds, datasets.DatasetDict):
        if self.split not in ds:
          raise ConfigError(
            'data.hf_split', self.split, f'no such split in {self.path}; allowed: ' + ', '.join(ds)
          )
        ds = ds[self.split]
      return ds
    try:
      return datasets.load_dataset(self.path, name=self.name, split=self.split)
    except (FileNotFoundError, ConnectionError) as err:  # DatasetNotFoundError is the former
      if os.path.exists(self.path):
        raise ConfigError(
          'data.path',
          self.path,
          f'datasets cannot load it ({first_line(err)}); '
          'allowed: a save_to_disk folder or a folder of data files; a lone text '
          "file goes with data.source='text'",
        ) from None
      raise ConfigError(
        'data.path',
        self.path,
        'no such file or folder, and no dataset of that '
        f'name ({first_line(err)}); allowed: a save_to_disk folder, a local data '
        'folder or a Hugging Face dataset name',
      ) from None
    except Exception as err:  # datasets raises many kinds here
      raise ConfigError(
        'data.path',
        self.path,
        f'datasets cannot load it ({first_line(err)}); '
        'allowed: a save_to_disk folder, a local data folder or a Hugging Face '
        'dataset name',
      ) from None

  def documents(self) -> Iterator[Document]:
    column = self.dataset.select_columns([self.text_field])
    # A local folder is keyed by its name, so moving it keeps the split; a hub name as written.
    name = os.path.basename(os.path.normpath(self.path)) if os.path.isdir(self.path) else self.path
    i = 0
    for batch in column.iter(batch_size=1024):
      for value in batch[self.text_field]:
        text = value.decode('utf-8', errors='replace') if isinstance(value, bytes) else value
        text = _as_text(text, self.text_field, f'{self.path} row {i}')
        if text is not None:
          yield Document(f'{name}:{i}', text)
        i += 1

  def describe(self) -> dict[str, Any]:
    d = {
      'kind': 'hf',
      'path': self.path,
      'name': self.name,
      'split': self.split,
      'text_field': self.text_field,
      'rows': len(self.dataset),
    }
    if self._from_disk():
      d['files'] = _file_listing(self.path, list_files(self.path, ('',)))
    else:  # the fingerprint follows the data files and the loading script
      d['fingerprint'] = getattr(self.dataset, '_fingerprint', None)
    return d


def stdlib_root() -> str:
  return sysconfig.get_paths()['stdlib']


# The sources read from data.path, a file or a folder of files with these suffixes.
LOCAL_SUFFIXES = {'text': ('.txt',), 'jsonl': ('.jsonl',), 'parquet': ('.parquet',)}


def check_path(data_config) -> None:
  """Refuse a missing data.path of a local source at once, before the backend starts (a
  Hugging Face dataset's name is checked when it loads)."""
  d = data_config
  if d.source in LOCAL_SUFFIXES and not os.path.exists(os.path.expanduser(d.path)):
    raise _missing(d.path)
  if d.source == 'kjv':
    make_source(data_config)  # finds the file or says where it looked


def make_source(data_config) -> Source:
  """The Source that `config.data` describes; ConfigError if its path is missing or wrong."""
  d = data_config
  if d.source == 'stdlib':
    root = stdlib_root()
    return FilesSource(
      'stdlib', root, list_files(root, ('.py',), ('site-packages', 'dist-packages'))
    )
  if d.source == 'hf':
    return HFSource(d.path, d.hf_config, d.hf_split, d.text_field)
  if d.source in LOCAL_SUFFIXES:
    return _local_source(d)
  assert d.source == 'kjv', d.source  # validation allows no other
  return KJVSource(d.path)


def _local_source(d) -> Source:
  """A 'text', 'jsonl' or 'parquet' source: data.path, a file or a folder of such files."""
  path = os.path.abspath(os.path.expanduser(d.path))
  suffixes = LOCAL_SUFFIXES[d.source]
  if os.path.isfile(path):
    if d.source == 'text':
      return TextFileSource(path)
    root, files = os.path.dirname(path), [os.path.basename(path)]
  elif os.path.isdir(path):
    root, files = path, list_files(path, suffixes)
    if not files:
      raise ConfigError(
        'data.path',
        d.path,
        f'no {"/".join(suffixes)} files in this folder; '
        f'allowed: a {"/".join(suffixes)} file or a folder holding some',
      )
  else:
    raise _missing(d.path)
  if d.source == 'text':
    return FilesSource('text', root, files)
  if d.source == 'parquet':
    for rel in files:
      check_parquet_magic(os.path.join(root, rel))
  return RowsSource(d.source, root, files, d.text_field)
