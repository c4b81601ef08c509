"""Data: sources -> tokenizer -> cached packed token streams -> grain batches.

    data = build_data(config, workdir, process_index=0, process_count=1)
    data.tokenizer, data.stats               # the Tokenizer; {'train': {...}, 'val': {...}}
    it = data.train_iterator()               # infinite, shuffled from config.seed; get/set_state
    for batch in data.eval_batches(16): ...  # fixed order; 0 = the whole val split

Batches are dicts of NumPy arrays: inputs, targets, positions, segment_ids (int32 [B, T]) and
loss_mask (float32 [B, T]), B = data.batch_size // process_count.
"""

from __future__ import annotations

import dataclasses

import grain

from mllm.checks import ConfigError
from mllm.data import corpus as corpus_lib
from mllm.data import pipeline
from mllm.data.corpus import Corpus, cache_root
from mllm.data.pipeline import BATCH_KEYS, EvalBatches, n_windows, pack_window
from mllm.data.sources import Document, make_source
from mllm.data.tokenizers import BPETokenizer, ByteTokenizer, Tokenizer
from mllm.paths import writable_dir


@dataclasses.dataclass
class Data:
  """The tokenizer and the cached corpus of one run, and the batch iterators over it."""

  tokenizer: Tokenizer
  corpus: Corpus
  seq_len: int
  global_batch: int
  seed: int
  document_mask: bool
  process_index: int = 0
  process_count: int = 1

  @property
  def stats(self) -> dict[str, dict[str, int]]:
    """{'train': {'docs', 'bytes', 'tokens', 'windows'}, 'val': {...}}."""
    return {s: dict(st, windows=self.n_windows(s)) for s, st in self.corpus.stats.items()}

  @property
  def local_batch(self) -> int:
    return self.global_batch // self.process_count

  def n_windows(self, split: str) -> int:
    return n_windows(len(self.corpus.streams[split]), self.seq_len)

  def reader(self, split: str) -> pipeline.ReadWindow:
    t = self.tokenizer
    return pipeline.ReadWindow(
      self.corpus.streams[split], self.seq_len, t.eos_id, t.pad_id, self.document_mask
    )

  def train_dataset(self) -> grain.MapDataset:
    return pipeline.train_dataset(
      self.reader('train'),
      self.n_windows('train'),
      seed=self.seed,
      global_batch=self.global_batch,
      process_index=self.process_index,
      process_count=self.process_count,
    )

  def train_iterator(self) -> grain.DatasetIterator:
    """Infinite iterator of local training batches; get_state()/set_state() resume it exactly."""
    return pipeline.train_iterator(self.train_dataset())

  def eval_batches(self, max_batches: int = 0) -> EvalBatches:
    """Val batches in a fixed order (a re-iterable sequence); 0 = the whole split."""
    return EvalBatches(
      self.reader('val'),
      self.n_windows('val'),
      global_batch=self.global_batch,
      process_index=self.process_index,
      process_count=self.process_count,
      max_batches=max_batches,
    )


def build_data(
  config,
  workdir: str,
  *,
  process_index: int = 0,
  process_count: int = 1,
  verbose: bool | None = None,
) -> Data:
  """Load or train the tokenizer, load or build the cached corpus; ConfigError on bad data."""
  d = config.data
  if d.batch_size % process_count:
    raise ConfigError(
      'data.batch_size',
      d.batch_size,
      f'must divide by the process count {process_count}; allowed: multiples of {process_count}',
    )
  if verbose is None:
    verbose = process_index == 0
  # Several processes: process 0 trains the tokenizer and builds the corpus cache first, the
  # others then read them (or, on a host that does not share its disk, build their own), so no
  # file is written twice at once.
  if process_index != 0:
    _barrier('mllm: data built by process 0')
  source = make_source(d)
  writable_dir(corpus_lib.cache_key(d), cache_root(d))
  tokenizer = corpus_lib.load_tokenizer(config, workdir, source, verbose)
  corpus = corpus_lib.load_corpus(config, source, tokenizer, verbose)
  if process_index == 0:
    _barrier('mllm: data built by process 0')
  return Data(
    tokenizer,
    corpus,
    d.seq_len,
    d.batch_size,
    config.seed,
    d.document_mask,
    process_index,
    process_count,
  )


def _barrier(name: str) -> None:
  """Every process of a multi-process job waits here until all have arrived."""
  import jax  # data loading needs no jax otherwise

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


__all__ = [
  'BATCH_KEYS',
  'BPETokenizer',
  'ByteTokenizer',
  'Corpus',
  'Data',
  'Document',
  'EvalBatches',
  'Tokenizer',
  'build_data',
  'cache_root',
  'make_source',
  'n_windows',
  'pack_window',
]
