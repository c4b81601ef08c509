"""Windows over a packed token stream, and the grain pipelines that batch them.

Window i of a stream is stream[i*T : i*T + T + 1]: inputs = window[:-1], targets = window[1:].
Consecutive windows overlap by one token, so every token of the stream is a target exactly once;
the last window is padded with <pad> and its padded targets get loss_mask 0.
"""

from __future__ import annotations

import collections.abc

import grain
import numpy as np

BATCH_KEYS = ('inputs', 'targets', 'positions', 'segment_ids', 'loss_mask')


def n_windows(n_tokens: int, seq_len: int) -> int:
  """ceil((n_tokens - 1) / seq_len): every token but the first is the target of one window."""
  return max(0, -(-(n_tokens - 1) // seq_len))


def pack_window(
  window: np.ndarray, seq_len: int, eos_id: int, pad_id: int, document_mask: bool = True
) -> dict[str, np.ndarray]:
  """One training row from a window of up to seq_len + 1 tokens.

  segment_ids start at 1 and grow by one at each <eos> in the inputs (a document's BOS); positions
  restart at 0 there and at the window start. Padding has segment 0, position 0 and loss_mask 0.
  With document_mask False the whole window is one segment with positions 0..T-1.
  """
  n = len(window) - 1  # real (input, target) pairs
  tokens = np.full(seq_len + 1, pad_id, np.int32)
  tokens[: len(window)] = window
  inputs, targets = tokens[:-1], tokens[1:]
  idx = np.arange(seq_len, dtype=np.int32)
  real = idx < n
  if document_mask:
    starts = (inputs == eos_id) | (idx == 0)
    last_start = np.maximum.accumulate(np.where(starts, idx, 0))
    positions = idx - last_start
    segment_ids = np.cumsum(starts, dtype=np.int32)
  else:
    positions, segment_ids = idx.copy(), np.ones(seq_len, np.int32)
  return {
    'inputs': inputs,
    'targets': targets,
    'positions': np.where(real, positions, 0).astype(np.int32),
    'segment_ids': np.where(real, segment_ids, 0).astype(np.int32),
    'loss_mask': real.astype(np.float32),
  }


class ReadWindow:
  """Window index -> packed row: the grain map function over a token stream."""

  def __init__(
    self, stream: np.ndarray, seq_len: int, eos_id: int, pad_id: int, document_mask: bool = True
  ):
    self.stream, self.seq_len = stream, seq_len
    self.eos_id, self.pad_id, self.document_mask = eos_id, pad_id, document_mask

  def __call__(self, i) -> dict[str, np.ndarray]:
    start = int(i) * self.seq_len
    window = np.asarray(self.stream[start : start + self.seq_len + 1], np.int32)
    return pack_window(window, self.seq_len, self.eos_id, self.pad_id, self.document_mask)

  def empty_row(self) -> dict[str, np.ndarray]:
    """A row of padding only (loss_mask 0), to even out eval batches."""
    return pack_window(np.full(1, self.pad_id, np.int32), self.seq_len, self.eos_id, self.pad_id)


def train_dataset(
  read: ReadWindow, n: int, *, seed: int, global_batch: int, process_index: int, process_count: int
) -> grain.MapDataset:
  """Shuffled windows, reshuffled each epoch (repeat after shuffle), in global batches of which
  process p reads rows [p*B, (p+1)*B), B = global_batch / process_count: the global batch, row
  for row, is the one a single process reads (dropout's masks then meet the same rows)."""
  local = global_batch // process_count
  ids = grain.MapDataset.range(n).shuffle(seed=seed).repeat(None)
  ids = ids.batch(global_batch, drop_remainder=True)  # window ids only: nothing read yet

  def read_rows(batch_ids: np.ndarray) -> dict[str, np.ndarray]:
    rows = [read(int(i)) for i in batch_ids[process_index * local : (process_index + 1) * local]]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  return ids.map(read_rows)


def train_iterator(dataset: grain.MapDataset) -> grain.DatasetIterator:
  """An iterator with get_state/set_state (and Orbax saving via grain.checkpoint)."""
  # Reading a window is a cheap memmap slice: a few threads and a short buffer keep up.
  options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
  return iter(dataset.to_iter_dataset(options))


class EvalBatches(collections.abc.Sequence):
  """Val batches in a fixed order; process p takes rows [p*B, (p+1)*B) of each global batch.

  Rows past the end of the split are padding with loss_mask 0, so every process sees the same
  number of batches.
  """

  def __init__(
    self,
    read: ReadWindow,
    n: int,
    *,
    global_batch: int,
    process_index: int,
    process_count: int,
    max_batches: int = 0,
  ):
    self.read, self.n, self.global_batch = read, n, global_batch
    self.local_batch = global_batch // process_count
    self.offset = process_index * self.local_batch
    count = -(-n // global_batch)
    self.count = min(count, max_batches) if max_batches else count

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, j):
    if isinstance(j, slice):
      return [self[k] for k in range(*j.indices(len(self)))]
    if not -len(self) <= j < len(self):
      raise IndexError(j)
    j %= len(self)
    first = j * self.global_batch + self.offset
    rows = [
      self.read(i) if i < self.n else self.read.empty_row()
      for i in range(first, first + self.local_batch)
    ]
    return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}
