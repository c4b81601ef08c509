"""data.source='kjv': the King James Bible from Debian's bible-kjv-text (mllm/data/bible.py).

The references are independent of the reader: the edition's own counts (66 books, 1,189 chapters,
31,102 verses), verses quoted from the text, and gzip's own LZW decoder (`gzip -d` reads the .Z
format) run on every window.
"""

from __future__ import annotations

import shutil
import struct
import subprocess

import pytest
from conftest import tiny_config

from mllm.config import ConfigError
from mllm.data import bible, build_data, corpus, sources
from mllm.validation import validate_data


@pytest.fixture(scope='module')
def kjv_path() -> str:
  path = bible.default_path()
  if path is None and shutil.which('apt-get') is None:
    pytest.skip("bible-kjv-text comes from Debian's apt, absent on this machine")
  assert path is not None, 'bible-kjv-text is not unpacked: run `make install`'
  return path


@pytest.fixture(scope='module')
def documents(kjv_path):
  return {d.key: d.text for d in bible.KJVSource(kjv_path).documents()}


def test_the_whole_bible_is_read(documents):
  books = {bible.VERSE.match(f'{key}:1 x')[1] for key in documents}
  assert len(books) == 66
  assert len(documents) == 1189
  assert sum(len(text.splitlines()) for text in documents.values()) == 31102
  assert (
    documents['Ge1'].splitlines()[0] == 'In the beginning God created the heaven and the earth.'
  )
  assert documents['John11'].splitlines()[34] == 'Jesus wept.'
  assert documents['Rev22'].splitlines()[-1] == (
    'The grace of our Lord Jesus Christ be with you all. Amen.'
  )
  assert len(documents['Psa119']) > len(documents['Psa117']) * 40  # the longest, the shortest


@pytest.mark.skipif(shutil.which('gzip') is None, reason='gzip is the independent LZW decoder')
def test_windows_match_gzips_lzw_decoder(kjv_path):
  with open(kjv_path, 'rb') as f:
    data = f.read()
  _, count = bible.HEADER.unpack_from(data, bible.HEADER_AT)
  offsets = struct.unpack_from(f'>{count + 1}I', data, bible.HEADER_AT + bible.HEADER.size)
  z_header = data[offsets[0] - 3 : offsets[0]]
  windows = bible.read_windows(kjv_path)
  assert len(windows) == count == 68
  for window, start, end in zip(windows, offsets, offsets[1:]):
    expected = subprocess.run(
      ['gzip', '-dc'], input=z_header + data[start:end], capture_output=True, check=True
    ).stdout
    assert window == expected


def test_the_split_is_by_chapter_and_the_corpus_builds(documents, tmp_path):
  cfg = tiny_config(
    data__source='kjv',
    data__cache_dir=str(tmp_path / 'cache'),
    data__tokenizer='byte',
    model__vocab_size=300,
  )
  validate_data(cfg)  # no data.path needed
  data = build_data(cfg, str(tmp_path / 'w'), verbose=False)
  n_val = sum(corpus.is_val(key, cfg.data.val_fraction) for key in documents)
  assert data.stats['val']['docs'] == n_val
  assert data.stats['train']['docs'] + n_val == 1189


def test_bad_files_are_refused_in_one_line(tmp_path):
  not_bible = tmp_path / 'notes.txt'
  not_bible.write_text('In the beginning\n')
  with pytest.raises(ConfigError, match=r"^data\.path='.*notes.txt': is not a bible.data file"):
    list(bible.KJVSource(str(not_bible)).documents())
  damaged = tmp_path / 'bible.data'
  header = bible.MAGIC.ljust(bible.HEADER_AT, b'\0') + bible.HEADER.pack(65536, 2)
  damaged.write_bytes(header + struct.pack('>3I', 200, 100, 999) + b'\x1f\x9d\x90')
  with pytest.raises(ConfigError, match=r'has a damaged window table; allowed for'):
    list(bible.KJVSource(str(damaged)).documents())
  missing = str(tmp_path / 'missing.data')
  with pytest.raises(ConfigError, match=r"^data\.path='.*missing.data': no bible.data here"):
    sources.make_source(tiny_config(data__source='kjv', data__path=missing).data)
