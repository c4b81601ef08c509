"""Tokenize a source once into cached token streams, one memmap per split.

The stream of a split is `<eos> doc1 <eos> doc2 ...`: each document is preceded by <eos>, its BOS
and the separator from the previous one. Streams are cached under the cache dir, keyed by a hash of
the source description, the tokenizer and the val fraction; a build writes into a temporary folder
renamed into place at the end, so an interrupted build is never mistaken for a finished one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator

import numpy as np
import tqdm

from mllm.checks import ConfigError
from mllm.data.sources import Source
from mllm.data.tokenizers import EOS, PAD, BPETokenizer, ByteTokenizer, Tokenizer
from mllm.paths import RunDir

FORMAT_VERSION = 1
SPLITS = ('train', 'val')


def is_val(key: str, val_fraction: float) -> bool:
  """Whether a document goes to the val split: a stable hash of its key (not Python's hash())."""
  digest = hashlib.sha256(key.encode('utf-8', errors='surrogatepass')).digest()
  return int.from_bytes(digest[:8], 'big') / 2.0**64 < val_fraction


def cache_root(data_config) -> str:
  """data.cache_dir, else $MLLM_CACHE_DIR, else ~/.cache/mllm."""
  root = data_config.cache_dir or os.environ.get('MLLM_CACHE_DIR') or '~/.cache/mllm'
  return os.path.abspath(os.path.expanduser(root))


def cache_key(data_config) -> str:
  """The setting that chose the cache folder, for error messages."""
  if not data_config.cache_dir and os.environ.get('MLLM_CACHE_DIR'):
    return '$MLLM_CACHE_DIR'
  return 'data.cache_dir'


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def source_name(data_config) -> str:
  return data_config.source + (f' {data_config.path}' if data_config.path else '')


# --------------------------------------------------------------------------------------------
# Tokenizer.
# --------------------------------------------------------------------------------------------


def tokenizer_sample(source: Source, val_fraction: float, max_bytes: int) -> list[str]:
  """A deterministic sample of the train split of at most `max_bytes` UTF-8 bytes.

  Documents are ranked by a hash of their key and the longest prefix of that ranking that fits is
  kept, so the sample spreads over the whole corpus (not its first files) and does not depend on
  the reading order. One pass, holding at most `max_bytes` of text: a heap of candidates and a
  cutoff that falls each time a candidate no longer fits.
  """
  heap: list[tuple[int, str, str]] = []  # (-rank, key, text): the worst-ranked on top
  total, cutoff = 0, None
  for doc in source.documents():
    if not doc.text or is_val(doc.key, val_fraction):
      continue
    rank = int.from_bytes(hashlib.sha256(b'tokenizer:' + doc.key.encode()).digest()[:8], 'big')
    if cutoff is not None and rank >= cutoff:
      continue
    data = doc.text.encode('utf-8')
    text = data[:max_bytes].decode('utf-8', errors='ignore') if len(data) > max_bytes else doc.text
    heapq.heappush(heap, (-rank, doc.key, text))
    total += len(text.encode('utf-8'))
    while total > max_bytes:
      neg_rank, _, dropped = heapq.heappop(heap)
      total -= len(dropped.encode('utf-8'))
      cutoff = -neg_rank
  return [text for _, _, text in sorted(heap, key=lambda item: (-item[0], item[1]))]


def load_tokenizer(config, workdir: str, source: Source, verbose: bool = True) -> Tokenizer:
  """The run's tokenizer: 'byte', or the BPE of workdir/tokenizer.json. A resumed run (or an
  imported model's) keeps its own; a new one copies the cache's, trained first if missing, and
  reads it back, so the tokenizer a run starts with is the one its resumes read."""
  d = config.data
  vocab = config.model.vocab_size
  if d.tokenizer == 'byte':
    tok = ByteTokenizer()
  else:
    path = RunDir(workdir).tokenizer
    found = path if os.path.exists(path) else _cached_bpe(d, vocab, source, verbose)
    try:
      tok = BPETokenizer.from_file(found, d.eos_token, d.pad_token)
    except ValueError as err:  # the named specials are not in it
      raise ConfigError(
        'data.eos_token',
        d.eos_token,
        f'{found}: {err}; allowed: the names of '
        'its EOS and pad tokens in data.eos_token and data.pad_token',
      ) from None
    if found != path:
      os.makedirs(workdir, exist_ok=True)
      tok.save(path)
  if tok.vocab_size > vocab:
    raise ConfigError(
      'model.vocab_size',
      vocab,
      f'the {d.tokenizer} tokenizer has {tok.vocab_size} tokens; allowed: >= {tok.vocab_size}',
    )
  return tok


def _cached_bpe(d, vocab: int, source: Source, verbose: bool) -> str:
  """The cache's file of the BPE for this source and these settings, trained first if missing."""
  if vocab < ByteTokenizer.vocab_size:
    raise ConfigError(
      'model.vocab_size',
      vocab,
      f'byte-level BPE needs the 256 bytes and 2 specials; allowed: >= {ByteTokenizer.vocab_size}',
    )
  specials = (
    {} if (d.eos_token, d.pad_token) == (EOS, PAD) else {'specials': [d.eos_token, d.pad_token]}
  )
  key = _digest(
    {
      'version': FORMAT_VERSION,
      'source': source.describe(),
      'vocab': vocab,
      'train_bytes': d.tokenizer_train_bytes,
      'val_fraction': d.val_fraction,
      **specials,
    }
  )
  cached = os.path.join(cache_root(d), 'tokenizers', f'bpe-{key[:20]}.json')
  if not os.path.exists(cached):
    start = time.perf_counter()
    texts = tokenizer_sample(source, d.val_fraction, d.tokenizer_train_bytes)
    if not texts:
      raise _no_text(d)
    tok = BPETokenizer.train(texts, vocab, d.eos_token, d.pad_token)
    if verbose:
      print(
        f'BPE tokenizer: vocab {tok.vocab_size}, trained on '
        f'{sum(len(t.encode()) for t in texts):,} bytes in '
        f'{time.perf_counter() - start:.1f} s',
        flush=True,
      )
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    tok.save(cached)
  return cached


def _no_text(d) -> ConfigError:
  from mllm.data.sources import stdlib_root

  return ConfigError(
    'data.path',
    d.path or stdlib_root(),
    f'data.source={d.source!r} found no training text there; allowed: a source '
    'with at least one non-empty document in the train split',
  )


# --------------------------------------------------------------------------------------------
# Token streams.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Corpus:
  path: str  # the cache folder
  streams: dict[str, np.ndarray]  # split -> token stream (a read-only memmap)
  stats: dict[str, dict[str, int]]  # split -> {'docs', 'bytes', 'tokens'}
  built: bool  # False when it came from the cache


def _stream_dtype(tokenizer: Tokenizer):
  return np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32


def _batches(docs: Iterable, max_docs: int = 512, max_bytes: int = 1 << 20) -> Iterator[list]:
  batch, size = [], 0
  for doc in docs:
    batch.append(doc)
    size += len(doc.text)
    if len(batch) >= max_docs or size >= max_bytes:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def write_streams(
  source: Source, tokenizer: Tokenizer, val_fraction: float, folder: str, verbose: bool = True
) -> dict[str, dict[str, int]]:
  """Tokenize every document into folder/{train,val}.bin; return the per-split stats."""
  dtype = _stream_dtype(tokenizer)
  stats = {s: {'docs': 0, 'bytes': 0, 'tokens': 0} for s in SPLITS}
  files = {s: open(os.path.join(folder, f'{s}.bin'), 'wb') for s in SPLITS}  # noqa: SIM115 (closed below)
  bar = tqdm.tqdm(
    total=getattr(source, 'total_bytes', None),
    unit='B',
    unit_scale=True,
    desc='tokenizing',
    disable=not verbose,
    mininterval=1.0,
  )
  try:
    docs = (doc for doc in source.documents() if doc.text)
    for batch in _batches(docs):
      encoded = tokenizer.encode_batch([doc.text for doc in batch])
      for doc, ids in zip(batch, encoded):
        split = 'val' if is_val(doc.key, val_fraction) else 'train'
        n_bytes = len(doc.text.encode('utf-8'))
        files[split].write(np.asarray([tokenizer.eos_id] + ids, dtype).tobytes())
        stats[split]['docs'] += 1
        stats[split]['bytes'] += n_bytes
        stats[split]['tokens'] += len(ids) + 1
        bar.update(n_bytes)
  finally:
    bar.close()
    for f in files.values():
      f.close()
  return stats


def _open_stream(path: str, dtype, length: int) -> np.ndarray:
  if length == 0:  # an empty file cannot be memory-mapped
    return np.zeros(0, dtype)
  return np.memmap(path, dtype=dtype, mode='r', shape=(length,))


def load_corpus(config, source: Source, tokenizer: Tokenizer, verbose: bool = True) -> Corpus:
  """The cached token streams for this source and tokenizer, built first if missing."""
  d = config.data
  tok_id = tokenizer.to_str() if isinstance(tokenizer, BPETokenizer) else 'byte'
  key = _digest(
    {
      'version': FORMAT_VERSION,
      'source': source.describe(),
      'tokenizer': tok_id,
      'val_fraction': d.val_fraction,
    }
  )
  root = cache_root(d)
  folder = os.path.join(root, f'corpus-{key[:20]}')
  built = not os.path.exists(os.path.join(folder, 'meta.json'))
  if built:
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.tmp-corpus-{key[:20]}-', dir=root)
    try:
      start = time.perf_counter()
      stats = write_streams(source, tokenizer, d.val_fraction, tmp, verbose)
      seconds = time.perf_counter() - start
      if stats['train']['docs'] == 0:
        raise _no_text(d)
      meta = {
        'version': FORMAT_VERSION,
        'dtype': np.dtype(_stream_dtype(tokenizer)).name,
        'stats': stats,
        'source': source_name(d),
        'seconds': round(seconds, 2),
      }
      with open(os.path.join(tmp, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1)
      try:
        os.rename(tmp, folder)  # atomic; fails if another process finished the same build first
      except OSError:
        if not os.path.exists(os.path.join(folder, 'meta.json')):
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  with open(os.path.join(folder, 'meta.json')) as f:
    meta = json.load(f)
  stats = meta['stats']
  streams = {
    s: _open_stream(os.path.join(folder, f'{s}.bin'), np.dtype(meta['dtype']), stats[s]['tokens'])
    for s in SPLITS
  }
  if verbose:
    how = f'built in {meta["seconds"]:.1f} s' if built else 'from the cache'
    print(f'corpus {source_name(d)} ({how}, {folder}):', flush=True)
    for s in SPLITS:
      st = stats[s]
      print(
        f'  {s:5s} {st["docs"]:>10,} docs {st["bytes"]:>14,} bytes {st["tokens"]:>14,} tokens',
        flush=True,
      )
  return Corpus(folder, streams, stats, built)
