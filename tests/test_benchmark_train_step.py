"""benchmarks/train_step.py's packed-document batch (`--document_mask=on`) against a recomputation
of segment ids and positions from the tokens, as the data pipeline defines them."""

from __future__ import annotations

import os

import numpy as np
from conftest import ROOT

import mllm
from benchmarks.train_step import EOS_ID, packed_batch, variants


def test_packed_batch_is_consecutive_windows_with_per_document_ids_and_positions():
  config = mllm.load_config(
    os.path.join(ROOT, 'configs', 'rope_swiglu.py'),
    {'data.batch_size': 8, 'data.seq_len': 1024, 'model.vocab_size': 64},
  )
  batch = packed_batch(config, mean_doc_len=64)
  assert sorted(batch) == ['inputs', 'loss_mask', 'positions', 'segment_ids', 'targets']
  inputs, targets = batch['inputs'], batch['targets']
  assert inputs.shape == (8, 1024) and (batch['loss_mask'] == 1).all()  # full windows, no pad
  # Windows of one stream: a row's targets are its inputs shifted, and the next row goes on.
  np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])
  np.testing.assert_array_equal(targets[:-1, -1], inputs[1:, 0])
  for row in range(8):
    segment, start = 1, 0
    for t in range(1024):
      if t > 0 and inputs[row, t] == EOS_ID:  # a document's BOS
        segment, start = segment + 1, t
      assert batch['segment_ids'][row, t] == segment and batch['positions'][row, t] == t - start
  # Document lengths have the requested mean (1 + geometric, one fixed seed).
  n_docs = (inputs == EOS_ID).sum()
  assert 0.75 < inputs.size / n_docs / 65 < 1.25
  np.testing.assert_array_equal(packed_batch(config, 64)['inputs'], inputs)  # seeded


def test_off_on_both_choices():
  assert variants('both') == [False, True] and variants('on') == [True]
  assert variants(None, 'off') == [False] and variants(None) == [None]
