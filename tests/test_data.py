"""mllm.data: sources, tokenizers, packing, the cached corpus and the grain pipelines.

Expected values are recomputed independently (hashlib splits, Python loops over windows, plain
UTF-8 bytes), on tiny corpora written to tmp_path.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # before `datasets` is imported anywhere

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from mllm.config import ConfigError
from mllm.data import build_data, pipeline, sources
from mllm.data import corpus as corpus_lib
from mllm.data.tokenizers import BPETokenizer, ByteTokenizer

WORDS = [
  'alpha',
  'beta',
  'gamma',
  'delta',
  'epsilon',
  'zeta',
  'eta',
  'theta',
  'iota',
  'kappa',
  'lambda',
  'mu',
  'nu',
  'xi',
  'omicron',
  'pi',
  'rho',
  'sigma',
  'tau',
  'upsilon',
  'phi',
  'chi',
  'psi',
  'omega',
  'café',
  'naïve',
  '東京',
  '😀',
  'def',
  'return',
  'class',
  'import',
]


def random_text(rng: random.Random, n_words: int) -> str:
  lines, words = [], []
  for _ in range(n_words):
    words.append(rng.choice(WORDS))
    if rng.random() < 0.15:
      lines.append(' ' * rng.choice((0, 2, 4)) + ' '.join(words))
      words = []
  return '\n'.join(lines + [' '.join(words)]) + '\n'


def write_text_corpus(root, n_docs: int = 12, seed: int = 0) -> dict[str, str]:
  """n_docs .txt files in nested folders (plus files that must be ignored); {relpath: text}."""
  rng = random.Random(seed)
  docs = {}
  for i in range(n_docs):
    rel = os.path.join(f'part{i % 3}', f'doc{i:02d}.txt') if i % 2 else f'doc{i:02d}.txt'
    docs[rel] = random_text(rng, rng.randint(5, 120))
  for rel, text in docs.items():
    os.makedirs(os.path.dirname(os.path.join(root, rel)) or root, exist_ok=True)
    with open(os.path.join(root, rel), 'w', encoding='utf-8') as f:
      f.write(text)
  with open(os.path.join(root, 'notes.md'), 'w') as f:  # not a .txt file: not read
    f.write('ignored')
  return docs


def config(tmp_path, **overrides):
  kw = dict(
    data__cache_dir=str(tmp_path / 'cache'),
    data__tokenizer='byte',
    model__vocab_size=300,
    data__val_fraction=0.25,
    data__batch_size=4,
  )
  kw.update(overrides)
  return tiny_config(**kw)


def text_config(tmp_path, n_docs=12, **overrides):
  root = tmp_path / 'corpus'
  if not root.exists():
    write_text_corpus(root, n_docs)
  return config(tmp_path, data__source='text', data__path=str(root), **overrides)


def expected_val(key: str, fraction: float) -> bool:
  return int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 2**64 < fraction


def expected_stream(docs: dict[str, str], split: str, fraction: float, encode, eos: int):
  out = []
  for key in sorted(docs):
    if docs[key] and expected_val(key, fraction) == (split == 'val'):
      out += [eos] + encode(docs[key])
  return np.array(out)


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert sorted(x) == sorted(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


# --------------------------------------------------------------------------------------------
# Packing.
# --------------------------------------------------------------------------------------------


def loop_pack(window, seq_len, eos, pad):
  """A per-token Python recomputation of pack_window's segment ids and positions."""
  n = len(window) - 1
  seg, pos, segs, poss = 0, 0, [], []
  for t in range(seq_len):
    if t >= n:
      segs.append(0)
      poss.append(0)
      continue
    if t == 0 or window[t] == eos:
      seg, pos = seg + 1, 0
    else:
      pos += 1
    segs.append(seg)
    poss.append(pos)
  return segs, poss


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.data())
def test_pack_window_matches_loop(seq_len, data):
  eos, pad = 256, 257
  length = data.draw(st.integers(2, seq_len + 1))
  window = data.draw(st.lists(st.sampled_from([eos, 1, 2, 3]), min_size=length, max_size=length))
  row = pipeline.pack_window(np.array(window), seq_len, eos, pad)
  segs, poss = loop_pack(window, seq_len, eos, pad)
  padded = window + [pad] * (seq_len + 1 - length)
  np.testing.assert_array_equal(row['inputs'], padded[:-1])
  np.testing.assert_array_equal(row['targets'], padded[1:])
  np.testing.assert_array_equal(row['segment_ids'], segs)
  np.testing.assert_array_equal(row['positions'], poss)
  np.testing.assert_array_equal(
    row['loss_mask'], [1.0] * (length - 1) + [0.0] * (seq_len + 1 - length)
  )
  for k in ('inputs', 'targets', 'positions', 'segment_ids'):
    assert row[k].dtype == np.int32
  assert row['loss_mask'].dtype == np.float32
  flat = pipeline.pack_window(np.array(window), seq_len, eos, pad, document_mask=False)
  real = np.arange(seq_len) < length - 1
  np.testing.assert_array_equal(flat['positions'], np.where(real, np.arange(seq_len), 0))
  np.testing.assert_array_equal(flat['segment_ids'], real.astype(int))


@pytest.mark.parametrize('n_docs,seq_len', [(12, 16), (3, 7), (1, 64)])
def test_windows_reproduce_the_stream(tmp_path, n_docs, seq_len):
  cfg = text_config(tmp_path, n_docs, data__seq_len=seq_len, data__val_fraction=0.0)
  docs = write_text_corpus(tmp_path / 'expected', n_docs)
  data = build_data(cfg, str(tmp_path / 'work'))
  tok = data.tokenizer
  stream = expected_stream(docs, 'train', 0.0, tok.encode, tok.eos_id)
  np.testing.assert_array_equal(data.corpus.streams['train'], stream)
  assert (stream == tok.eos_id).sum() == n_docs  # one <eos> before every document
  read = data.reader('train')
  rows = [read(i) for i in range(data.n_windows('train'))]
  assert len(rows) == -(-(len(stream) - 1) // seq_len)
  mask = np.concatenate([r['loss_mask'] for r in rows]).astype(bool)
  # No token lost or repeated: the real inputs are stream[:-1], the real targets stream[1:].
  np.testing.assert_array_equal(np.concatenate([r['inputs'] for r in rows])[mask], stream[:-1])
  np.testing.assert_array_equal(np.concatenate([r['targets'] for r in rows])[mask], stream[1:])
  assert mask.sum() == len(stream) - 1 and mask[: len(stream) - 1].all()
  for i, r in enumerate(rows):
    window = stream[i * seq_len : i * seq_len + seq_len + 1]
    segs, poss = loop_pack(list(window), seq_len, tok.eos_id, tok.pad_id)
    np.testing.assert_array_equal(r['segment_ids'], segs)
    np.testing.assert_array_equal(r['positions'], poss)
  # Positions restart at each document: they count the tokens since the last <eos>.
  inputs = np.concatenate([r['inputs'] for r in rows])[mask]
  assert all(
    inputs[j] == tok.eos_id
    for j in np.flatnonzero(np.concatenate([r['positions'] for r in rows])[mask] == 0)
    if j % seq_len
  )


# --------------------------------------------------------------------------------------------
# Tokenizers.
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def small_bpe() -> BPETokenizer:
  rng = random.Random(1)
  return BPETokenizer.train([random_text(rng, 200) for _ in range(20)], 320)


def test_byte_tokenizer():
  tok = ByteTokenizer()
  assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
  assert tok.encode('aé') == [97, 0xC3, 0xA9]
  assert tok.decode([97, 256, 0xC3, 0xA9, 257]) == 'aé'  # specials stand for no text
  np.testing.assert_array_equal(tok.token_bytes, [1] * 256 + [0, 0])


def gpt2_bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table, which byte-level BPE symbols are written in."""
  keep = (
    list(range(ord('!'), ord('~') + 1))
    + list(range(ord('¡'), ord('¬') + 1))
    + list(range(ord('®'), ord('ÿ') + 1))
  )
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def test_bpe_tokenizer_shape():
  tok = small_bpe()
  assert tok.vocab_size == 320 and len(tok.token_bytes) == 320
  assert {tok.eos_id, tok.pad_id} == {0, 1}
  assert tok.token_bytes[tok.eos_id] == tok.token_bytes[tok.pad_id] == 0
  assert tok.token_bytes.dtype == np.int32 and tok.token_bytes.max() > 1  # has merges
  byte_of = {c: b for b, c in gpt2_bytes_to_unicode().items()}
  for i in range(tok.vocab_size):  # token_bytes = the bytes each id's symbols stand for
    if i not in (tok.eos_id, tok.pad_id):
      assert tok.token_bytes[i] == len(bytes(byte_of[c] for c in tok.tok.id_to_token(i)))
  assert tok.encode('<eos>') != [tok.eos_id]  # text that spells a special stays text
  assert tok.decode(tok.encode('a<eos>b')) == 'a<eos>b'


def test_bpe_training_is_deterministic():
  rng = random.Random(1)
  texts = [random_text(rng, 200) for _ in range(20)]
  assert BPETokenizer.train(texts, 320).to_str() == BPETokenizer.train(texts, 320).to_str()


@settings(max_examples=300, deadline=None)
@given(
  st.text(max_size=60) | st.text(alphabet=st.sampled_from(list('ab \n\té東😀\x00')), max_size=60)
)
def test_round_trip_and_token_bytes(text):
  for tok in (ByteTokenizer(), small_bpe()):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, text]) == [ids, ids]
    assert int(tok.token_bytes[np.array(ids, np.int64)].sum()) == len(text.encode('utf-8'))
    assert tok.eos_id not in ids and tok.pad_id not in ids


def test_tokenizer_sample_is_the_longest_ranked_prefix():
  docs = [sources.Document(f'd{i}', 'x' * (i * 37 % 101 + 1)) for i in range(60)]

  class Listed(sources.Source):
    def __init__(self, docs):
      self.docs = docs

    def documents(self):
      return iter(self.docs)

  def rank(key):
    return int.from_bytes(hashlib.sha256(b'tokenizer:' + key.encode()).digest()[:8], 'big')

  budget = 900
  train = sorted((d for d in docs if not expected_val(d.key, 0.2)), key=lambda d: rank(d.key))
  expected, total = [], 0
  for d in train:
    if total + len(d.text) > budget:
      break
    expected.append(d.text)
    total += len(d.text)
  shuffled = list(docs)
  random.Random(0).shuffle(shuffled)
  for order in (docs, shuffled, docs[::-1]):
    assert corpus_lib.tokenizer_sample(Listed(order), 0.2, budget) == expected


def test_bpe_build_saves_and_reuses_tokenizer(tmp_path):
  cfg = text_config(tmp_path, data__tokenizer='bpe', model__vocab_size=300)
  work = tmp_path / 'work'
  data = build_data(cfg, str(work))
  saved = work / 'tokenizer.json'
  assert saved.exists() and data.tokenizer.vocab_size <= 300
  assert json.loads(saved.read_text())['model']['type'] == 'BPE'
  # The stream holds exactly this tokenizer's encoding of the train documents.
  docs = write_text_corpus(tmp_path / 'expected')
  np.testing.assert_array_equal(
    data.corpus.streams['train'],
    expected_stream(docs, 'train', 0.25, data.tokenizer.encode, data.tokenizer.eos_id),
  )
  # Resuming: workdir/tokenizer.json wins, even over a different tokenizer the config would train.
  other = BPETokenizer.train(['zzzz yyyy ' * 50], 270)
  other.save(str(saved))
  resumed = build_data(cfg, str(work))
  assert resumed.tokenizer.to_str() == other.to_str()
  # A fresh workdir gets the cached trained tokenizer back, not a new training.
  fresh = build_data(cfg, str(tmp_path / 'work2'))
  assert fresh.tokenizer.to_str() == data.tokenizer.to_str()


def test_vocab_size_errors(tmp_path):
  with pytest.raises(ConfigError, match=r"^model\.vocab_size=257: .*allowed: >= 258"):
    build_data(text_config(tmp_path, model__vocab_size=257), str(tmp_path / 'w'))
  with pytest.raises(ConfigError, match=r"^model\.vocab_size=100: .*>= 258"):
    build_data(
      text_config(tmp_path, data__tokenizer='bpe', model__vocab_size=100), str(tmp_path / 'w')
    )
  (tmp_path / 'w3').mkdir()
  small_bpe().save(str(tmp_path / 'w3' / 'tokenizer.json'))  # 320 tokens
  with pytest.raises(
    ConfigError,
    match=r"^model\.vocab_size=300: the bpe tokenizer has 320 "
    r"tokens; allowed: >= 320$",
  ):
    build_data(
      text_config(tmp_path, data__tokenizer='bpe', model__vocab_size=300), str(tmp_path / 'w3')
    )


# --------------------------------------------------------------------------------------------
# Sources.
# --------------------------------------------------------------------------------------------


def doc_texts(cfg) -> list[tuple[str, str]]:
  return [(d.key, d.text) for d in sources.make_source(cfg.data).documents()]


def test_text_folder_is_read_recursively_in_sorted_order(tmp_path):
  cfg = text_config(tmp_path)
  docs = write_text_corpus(tmp_path / 'expected')
  assert doc_texts(cfg) == sorted(docs.items())


def test_single_text_file_is_split_into_blank_line_blocks(tmp_path):
  path = tmp_path / 'one.txt'
  path.write_text('first para\nline two\n\n\nsecond\n  \nthird\n')
  cfg = config(tmp_path, data__source='text', data__path=str(path))
  assert doc_texts(cfg) == [
    ('one.txt:0', 'first para\nline two'),
    ('one.txt:1', 'second'),
    ('one.txt:2', 'third'),
  ]


def write_rows(tmp_path, texts, field='text'):
  """texts as jsonl (two files in a folder, plus a nested one) and parquet (a folder of two)."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  jdir, pdir = tmp_path / 'jsonl', tmp_path / 'parquet'
  (jdir / 'sub').mkdir(parents=True)
  pdir.mkdir()
  parts = [texts[:3], texts[3:5], texts[5:]]
  for name, part in zip(('a.jsonl', 'b.jsonl', 'sub/c.jsonl'), parts):
    with open(jdir / name, 'w') as f:
      for t in part:
        f.write(json.dumps({field: t, 'id': 1}) + '\n\n')  # blank lines are skipped
  pq.write_table(pa.table({field: texts[:4], 'n': list(range(4))}), pdir / 'a.parquet')
  pq.write_table(pa.table({field: texts[4:], 'n': list(range(len(texts) - 4))}), pdir / 'b.parquet')
  return jdir, pdir, [('a', parts[0]), ('b', parts[1]), ('sub/c', parts[2])]


ROWS = [
  'row zero',
  'row one é',
  '',
  'row three 😀',
  'row four',
  'row five\nwith two lines',
  'row six',
]


def test_jsonl_and_parquet_sources(tmp_path):
  jdir, pdir, parts = write_rows(tmp_path, ROWS)
  expected = [(f'{stem}.jsonl:{i}', t) for stem, part in parts for i, t in enumerate(part)]
  assert doc_texts(config(tmp_path, data__source='jsonl', data__path=str(jdir))) == expected
  single = config(tmp_path, data__source='jsonl', data__path=str(jdir / 'a.jsonl'))
  assert doc_texts(single) == expected[:3]
  got = doc_texts(config(tmp_path, data__source='parquet', data__path=str(pdir)))
  assert got == [(f'a.parquet:{i}', t) for i, t in enumerate(ROWS[:4])] + [
    (f'b.parquet:{i}', t) for i, t in enumerate(ROWS[4:])
  ]
  # End to end: the empty row is no document; the stats count the rest.
  data = build_data(
    config(tmp_path, data__source='parquet', data__path=str(pdir), data__val_fraction=0.0),
    str(tmp_path / 'w'),
  )
  assert data.stats['train']['docs'] == 6
  assert data.stats['train']['bytes'] == sum(len(t.encode()) for t in ROWS)
  assert data.stats['train']['tokens'] == 6 + sum(len(t.encode()) for t in ROWS)


def test_hf_sources(tmp_path):
  import datasets

  jdir, _, _ = write_rows(tmp_path, ROWS)
  by_name = doc_texts(config(tmp_path, data__source='hf', data__path=str(jdir)))
  assert sorted(t for _, t in by_name) == sorted(ROWS)
  ds = datasets.Dataset.from_dict({'body': ROWS, 'n': list(range(len(ROWS)))})
  ds.save_to_disk(str(tmp_path / 'saved'))
  cfg = config(
    tmp_path, data__source='hf', data__path=str(tmp_path / 'saved'), data__text_field='body'
  )
  assert doc_texts(cfg) == [(f'saved:{i}', t) for i, t in enumerate(ROWS)]
  datasets.DatasetDict(train=ds.select(range(2)), other=ds).save_to_disk(str(tmp_path / 'dict'))
  cfg = config(
    tmp_path,
    data__source='hf',
    data__path=str(tmp_path / 'dict'),
    data__text_field='body',
    data__hf_split='other',
  )
  assert [t for _, t in doc_texts(cfg)] == ROWS
  with pytest.raises(ConfigError, match=r"^data\.hf_split='nope': .*allowed: .*train"):
    sources.make_source(
      config(
        tmp_path,
        data__source='hf',
        data__path=str(tmp_path / 'dict'),
        data__text_field='body',
        data__hf_split='nope',
      ).data
    )
  with pytest.raises(ConfigError, match=r"^data\.text_field='text': .*columns found: body, n$"):
    sources.make_source(
      config(tmp_path, data__source='hf', data__path=str(tmp_path / 'saved')).data
    )
  missing = str(tmp_path / 'missing')
  with pytest.raises(ConfigError, match=r"^data\.path='.*missing': no such file or folder"):
    sources.make_source(config(tmp_path, data__source='hf', data__path=missing).data)
  data = build_data(cfg, str(tmp_path / 'w'))
  assert data.stats['train']['docs'] + data.stats['val']['docs'] == 6


PLAIN = ' and then enough plain text to keep the share of bad bytes under ten percent'


def test_undecodable_bytes_are_replaced(tmp_path):
  (tmp_path / 'bad').mkdir()
  (tmp_path / 'bad' / 'a.txt').write_bytes(b'ok \xff\xfe then \xc3' + PLAIN.encode())
  cfg = config(
    tmp_path, data__source='text', data__path=str(tmp_path / 'bad'), data__val_fraction=0.0
  )
  assert doc_texts(cfg) == [('a.txt', 'ok \ufffd\ufffd then \ufffd' + PLAIN)]
  (tmp_path / 'bad.jsonl').write_bytes(b'{"text": "x \xff y"}\n')
  cfg_j = config(tmp_path, data__source='jsonl', data__path=str(tmp_path / 'bad.jsonl'))
  assert doc_texts(cfg_j) == [('bad.jsonl:0', 'x \ufffd y')]
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(
    pa.table({'text': pa.array([b'p \xff q' + PLAIN.encode()], pa.binary())}),
    tmp_path / 'bad.parquet',
  )
  cfg_p = config(tmp_path, data__source='parquet', data__path=str(tmp_path / 'bad.parquet'))
  assert doc_texts(cfg_p) == [('bad.parquet:0', 'p \ufffd q' + PLAIN)]
  data = build_data(cfg, str(tmp_path / 'w'))
  assert data.stats['train']['bytes'] == len(('ok \ufffd\ufffd then \ufffd' + PLAIN).encode())


def test_stdlib_source_lists_sorted_py_files_outside_site_packages(tmp_path, monkeypatch):
  root = tmp_path / 'lib'
  for rel in (
    'z.py',
    'a/b.py',
    'a/c.txt',
    'site-packages/pkg/x.py',
    'a/dist-packages/y.py',
    'B.py',
    'a/__init__.py',
  ):
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(f'# {rel}\n' if rel != 'a/__init__.py' else '')
  monkeypatch.setattr(sources, 'stdlib_root', lambda: str(root))
  cfg = config(tmp_path, data__source='stdlib', data__val_fraction=0.0)
  assert [k for k, _ in doc_texts(cfg)] == ['B.py', 'a/__init__.py', 'a/b.py', 'z.py']
  data = build_data(cfg, str(tmp_path / 'w'))
  assert data.stats['train']['docs'] == 3  # the empty __init__.py is no document
  # The real standard library: the same rules, without reading it.
  monkeypatch.undo()
  real = sources.make_source(tiny_config().data)
  assert real.files == sorted(real.files) and len(real.files) > 500
  assert all(f.endswith('.py') and 'site-packages' not in f for f in real.files)
  assert 'os.py' in real.files and os.path.join('json', 'decoder.py') in real.files


def test_split_is_a_stable_hash_of_the_key(tmp_path):
  cfg = text_config(tmp_path, 40, data__val_fraction=0.3)
  docs = write_text_corpus(tmp_path / 'expected', 40)
  data = build_data(cfg, str(tmp_path / 'w'))
  n_val = sum(expected_val(k, 0.3) for k in docs)
  assert 0 < n_val < 40 and data.stats['val']['docs'] == n_val
  for split in ('train', 'val'):
    np.testing.assert_array_equal(
      data.corpus.streams[split],
      expected_stream(docs, split, 0.3, data.tokenizer.encode, data.tokenizer.eos_id),
    )
    assert data.stats[split]['tokens'] == len(data.corpus.streams[split])


@pytest.mark.parametrize('make', ['missing', 'empty_folder', 'blank_files', 'all_val'])
def test_missing_or_empty_source_is_a_config_error(tmp_path, make):
  path = tmp_path / 'src'
  overrides = {}
  if make == 'empty_folder':
    path.mkdir()
  elif make == 'blank_files':
    path.mkdir()
    (path / 'a.txt').write_text('')
  elif make == 'all_val':  # the only document falls into val: no training text
    path.mkdir()
    name = next(f'a{i}.txt' for i in range(100) if expected_val(f'a{i}.txt', 0.5))
    (path / name).write_text('hello')
    overrides['data__val_fraction'] = 0.5
  cfg = config(tmp_path, data__source='text', data__path=str(path), **overrides)
  with pytest.raises(ConfigError, match=rf"^data\.path='{re.escape(str(path))}': "):
    build_data(cfg, str(tmp_path / 'w'))
  assert not (tmp_path / 'cache').exists() or not any(
    p.name.startswith('corpus-') for p in (tmp_path / 'cache').iterdir()
  )


def test_missing_text_field_names_the_columns(tmp_path):
  jdir, pdir, _ = write_rows(tmp_path, ROWS, field='body')
  with pytest.raises(
    ConfigError,
    match=r"^data\.text_field='text': no such field in .*a\.jsonl; "
    r"fields found: body, id$",
  ):
    doc_texts(config(tmp_path, data__source='jsonl', data__path=str(jdir)))
  with pytest.raises(ConfigError, match=r"^data\.text_field='text': .*fields found: body, n$"):
    doc_texts(config(tmp_path, data__source='parquet', data__path=str(pdir)))


def test_batch_size_must_divide_by_process_count(tmp_path):
  with pytest.raises(ConfigError, match=r'^data\.batch_size=4: must divide by the process count 3'):
    build_data(text_config(tmp_path), str(tmp_path / 'w'), process_index=0, process_count=3)


# --------------------------------------------------------------------------------------------
# The cache.
# --------------------------------------------------------------------------------------------


def test_second_build_reuses_the_cache(tmp_path, monkeypatch):
  cfg = text_config(tmp_path)
  first = build_data(cfg, str(tmp_path / 'w'))
  assert first.corpus.built
  bin_path = os.path.join(first.corpus.path, 'train.bin')
  mtime = os.stat(bin_path).st_mtime_ns

  def fail(*args, **kwargs):
    raise AssertionError('tokenized again')

  monkeypatch.setattr(corpus_lib, 'write_streams', fail)
  second = build_data(cfg, str(tmp_path / 'w2'))
  assert not second.corpus.built and second.corpus.path == first.corpus.path
  assert os.stat(bin_path).st_mtime_ns == mtime and second.stats == first.stats
  np.testing.assert_array_equal(second.corpus.streams['train'], first.corpus.streams['train'])
  # A different val fraction, or changed files, is another corpus.
  with pytest.raises(AssertionError, match='tokenized again'):
    build_data(text_config(tmp_path, data__val_fraction=0.1), str(tmp_path / 'w3'))
  with open(tmp_path / 'corpus' / 'doc00.txt', 'a') as f:
    f.write('more\n')
  with pytest.raises(AssertionError, match='tokenized again'):
    build_data(cfg, str(tmp_path / 'w4'))


def test_interrupted_build_is_not_reused(tmp_path, monkeypatch):
  cfg = text_config(tmp_path)
  calls = []

  def interrupted(self, texts):
    calls.append(len(texts))
    raise KeyboardInterrupt

  monkeypatch.setattr(ByteTokenizer, 'encode_batch', interrupted)
  with pytest.raises(KeyboardInterrupt):
    build_data(cfg, str(tmp_path / 'w'))
  assert calls and os.listdir(tmp_path / 'cache') == []  # the partial build is gone
  monkeypatch.undo()
  data = build_data(cfg, str(tmp_path / 'w'))
  assert data.corpus.built and data.stats['train']['docs'] > 0


def test_cache_dir_falls_back_to_env(tmp_path, monkeypatch):
  cfg = tiny_config()
  monkeypatch.setenv('MLLM_CACHE_DIR', str(tmp_path / 'env'))
  assert corpus_lib.cache_root(cfg.data) == str(tmp_path / 'env')
  monkeypatch.delenv('MLLM_CACHE_DIR')
  assert corpus_lib.cache_root(cfg.data) == os.path.expanduser('~/.cache/mllm')


# --------------------------------------------------------------------------------------------
# The grain pipelines.
# --------------------------------------------------------------------------------------------


def index_dataset(n, seed, global_batch, process_index, process_count):
  return pipeline.train_dataset(
    lambda i: {'i': np.int64(i)},
    n,
    seed=seed,
    global_batch=global_batch,
    process_index=process_index,
    process_count=process_count,
  )


@pytest.mark.parametrize('process_count', [1, 2, 3])
def test_process_shards_are_disjoint_and_cover_each_epoch(process_count):
  n, global_batch = 24, 6
  per_epoch = n // global_batch  # batches per process per epoch
  epochs = []
  for epoch in range(2):
    seen = []
    for p in range(process_count):
      ds = index_dataset(n, 7, global_batch, p, process_count)
      batches = [ds[j]['i'] for j in range(epoch * per_epoch, (epoch + 1) * per_epoch)]
      assert all(b.shape == (global_batch // process_count,) for b in batches)
      seen.append(np.concatenate(batches))
    flat = np.concatenate(seen)
    assert sorted(flat) == list(range(n))  # disjoint and covering
    epochs.append(flat)
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch


@pytest.mark.parametrize('process_count', [2, 3])
def test_the_processes_rows_stacked_are_the_single_process_batch(process_count):
  """Process p reads rows [p*B, (p+1)*B) of each global batch: stacked in process order they
  are one process's batch, row for row (so dropout masks meet the same rows), across epochs."""
  n, global_batch = 24, 6
  whole = index_dataset(n, 7, global_batch, 0, 1)
  shards = [index_dataset(n, 7, global_batch, p, process_count) for p in range(process_count)]
  for step in range(3 * n // global_batch):
    np.testing.assert_array_equal(
      np.concatenate([ds[step]['i'] for ds in shards]), whole[step]['i']
    )


def test_train_batches_depend_only_on_the_seed(tmp_path):
  cfg = text_config(tmp_path)
  a = take(build_data(cfg, str(tmp_path / 'w')).train_iterator(), 5)
  b = take(build_data(cfg, str(tmp_path / 'w')).train_iterator(), 5)
  assert_batches_equal(a, b)
  c = take(build_data(text_config(tmp_path, seed=1), str(tmp_path / 'w')).train_iterator(), 5)
  assert not all(np.array_equal(x['inputs'], y['inputs']) for x, y in zip(a, c))
  for batch in a:
    assert sorted(batch) == sorted(pipeline.BATCH_KEYS)
    assert batch['inputs'].shape == (4, 16) and batch['inputs'].dtype == np.int32
    assert batch['loss_mask'].dtype == np.float32
  # Each row is some window of the train stream.
  data = build_data(cfg, str(tmp_path / 'w'))
  read = data.reader('train')
  windows = {read(i)['inputs'].tobytes() for i in range(data.n_windows('train'))}
  assert all(row.tobytes() in windows for batch in a for row in batch['inputs'])


def test_iterator_state_resumes_bit_identically(tmp_path):
  data = build_data(text_config(tmp_path), str(tmp_path / 'w'))
  it = data.train_iterator()
  take(it, 3)
  state = it.get_state()
  expected = take(it, 30)  # past the end of the first epoch
  fresh = data.train_iterator()
  fresh.set_state(state)
  assert_batches_equal(take(fresh, 30), expected)


def test_iterator_round_trip_through_orbax(tmp_path):
  data = build_data(text_config(tmp_path, data__batch_size=2), str(tmp_path / 'w'))
  it = data.train_iterator()
  take(it, 7)
  manager = ocp.CheckpointManager(str(tmp_path / 'ckpt'))
  manager.save(7, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  manager.wait_until_finished()
  expected = take(it, 10)
  fresh = data.train_iterator()
  restored = manager.restore(
    7, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh))
  )
  assert_batches_equal(take(restored['data'], 10), expected)
  manager.close()


@pytest.mark.parametrize('process_count', [1, 2, 4])
def test_eval_batches_are_fixed_and_padded_evenly(tmp_path, process_count):
  cfg = text_config(tmp_path, 40, data__val_fraction=0.3, data__batch_size=4, data__seq_len=11)
  per_process = [
    build_data(cfg, str(tmp_path / 'w'), process_index=p, process_count=process_count)
    for p in range(process_count)
  ]
  data = per_process[0]
  n = data.n_windows('val')
  assert n % 4  # so the last batch is partial
  read = data.reader('val')
  expected = [read(i) for i in range(n)]
  everything = [list(d.eval_batches(0)) for d in per_process]
  assert {len(b) for b in everything} == {-(-n // 4)}
  rows = []
  for j in range(len(everything[0])):  # global batch j = the processes' local batches in order
    for p in range(process_count):
      batch = everything[p][j]
      assert batch['inputs'].shape == (4 // process_count, 11)
      rows += [{k: v[r] for k, v in batch.items()} for r in range(4 // process_count)]
  for i, row in enumerate(rows):
    if i < n:
      assert all(np.array_equal(row[k], expected[i][k]) for k in row)
    else:
      assert row['loss_mask'].sum() == 0 and (row['segment_ids'] == 0).all()
  assert len(data.eval_batches(2)) == 2
  assert_batches_equal(list(data.eval_batches(2)), everything[0][:2])


@pytest.mark.slow
def test_real_stdlib_corpus(tmp_path):
  """The default corpus end to end (~1-2 min on 2 cores: BPE training and tokenizing ~31 MB)."""
  cfg = config(
    tmp_path,
    data__source='stdlib',
    data__tokenizer='bpe',
    model__vocab_size=512,
    data__val_fraction=0.02,
  )
  data = build_data(cfg, str(tmp_path / 'w'))
  source = sources.make_source(cfg.data)
  texts = {d.key: d.text for d in source.documents()}
  for split in ('train', 'val'):
    keys = [k for k in sorted(texts) if texts[k] and expected_val(k, 0.02) == (split == 'val')]
    assert data.stats[split]['docs'] == len(keys)
    assert data.stats[split]['bytes'] == sum(len(texts[k].encode()) for k in keys)
  stream = np.asarray(data.corpus.streams['val'])
  docs = np.split(stream, np.flatnonzero(stream == data.tokenizer.eos_id))[1:]
  val_keys = [k for k in sorted(texts) if texts[k] and expected_val(k, 0.02)]
  assert [data.tokenizer.decode(d) for d in docs] == [texts[k] for k in val_keys]
  assert data.tokenizer.token_bytes[stream].sum() == data.stats['val']['bytes']


def test_token_bytes_of_a_sentencepiece_style_tokenizer():
  """An imported Llama-2-style vocabulary (Metaspace '▁' for spaces, '<0xNN>' byte fallback):
  token_bytes counts '▁' as the space it stands for and a byte token as one byte, so the bytes of
  an encoded text sum to its UTF-8 length plus the one space Metaspace prepends."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  specials = ['<unk>', '<s>', '</s>']
  pieces = specials + [f'<0x{b:02X}>' for b in range(256)] + ['▁', 'a', 'b', '▁a', 'ab', '▁ab']
  model = models.BPE(
    vocab={p: i for i, p in enumerate(pieces)},
    merges=[('▁', 'a'), ('a', 'b'), ('▁a', 'b')],
    byte_fallback=True,
    unk_token='<unk>',
  )
  raw = Tokenizer(model)
  raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first')
  raw.decoder = decoders.Sequence(
    [
      decoders.Replace('▁', ' '),
      decoders.ByteFallback(),
      decoders.Fuse(),
      decoders.Strip(' ', 1, 0),
    ]
  )
  raw.add_special_tokens(specials)
  tok = BPETokenizer(raw, eos='</s>', pad='</s>')
  assert tok.eos_id == tok.pad_id == 2
  assert [tok.token_bytes[raw.token_to_id(p)] for p in ('<0xC3>', '▁', '▁ab', 'ab', '<s>')] == [
    1,
    1,
    3,
    2,
    0,
  ]
  for text in ('ab ab', 'ab aé b', 'é東'):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert sum(int(tok.token_bytes[i]) for i in ids) == len(text.encode('utf-8')) + 1, text
