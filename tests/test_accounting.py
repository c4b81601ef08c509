"""Parameter counts and FLOPs/token against independent closed forms and published sizes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import mllm
from mllm.accounting import count_params, keys_per_query, training_flops_per_token


def test_gpt2_small_has_its_published_parameter_count():
  """GPT-2 small (Radford et al. 2019; HF `gpt2`): 124,439,808 parameters."""
  cfg = mllm.load_config(
    'configs/gpt2.py',
    {
      'model.vocab_size': 50257,
      'model.d_model': 768,
      'model.n_layers': 12,
      'model.n_heads': 12,
      'model.n_kv_heads': 12,
      'model.max_seq_len': 1024,
      'data.seq_len': 1024,
    },
  )
  counts = count_params(cfg)
  assert counts.total == 124_439_808
  assert counts.embedding == 50257 * 768 + 1024 * 768  # token + position tables


@pytest.mark.parametrize(
  'n_kv,tied,ffn',
  [(8, True, 'swiglu'), (2, False, 'swiglu'), (1, True, 'gelu'), (4, True, 'geglu')],
)
def test_llama_style_closed_form(n_kv, tied, ffn):
  d, L, N, V, H = 256, 3, 8, 1000, 32
  cfg = mllm.load_config(
    f'configs/base.py:ffn={ffn}',
    {
      'model.d_model': d,
      'model.n_layers': L,
      'model.n_heads': N,
      'model.n_kv_heads': n_kv,
      'model.vocab_size': V,
      'model.tie_embeddings': tied,
    },
  )
  gated = ffn != 'gelu'
  d_ff = 8 * round(2 * 4 * d / 3 / 8) if gated else 4 * d
  per_layer = d * N * H + 2 * d * n_kv * H + N * H * d + (3 if gated else 2) * d * d_ff + 2 * d
  expected = V * d + L * per_layer + d + (0 if tied else d * V)
  counts = count_params(cfg)
  assert counts.total == expected
  assert counts.non_embedding == L * per_layer + d
  # The abstract count equals the count of a real model.
  assert count_params(mllm.build_model(cfg, rngs=nnx.Rngs(0))) == counts


def test_learned_tables_count_as_embedding_but_t5_and_shaw_do_not():
  learned = count_params(tiny_config('pos=learned'))
  t5 = count_params(tiny_config('pos=t5'))
  rope = count_params(tiny_config('pos=rope'))
  assert learned.embedding - rope.embedding == 16 * 16  # max_seq_len · d_model
  assert t5.embedding == rope.embedding and t5.non_embedding - rope.non_embedding == 32 * 4


def test_keys_per_query():
  assert keys_per_query(4, None) == pytest.approx((1 + 2 + 3 + 4) / 4)
  assert keys_per_query(6, 2) == pytest.approx((1 + 2 + 2 + 2 + 2 + 2) / 6)


@pytest.mark.parametrize('window', [None, 64])
def test_training_flops_per_token(window):
  cfg = mllm.load_config('configs/base.py', {'model.attention.sliding_window': window})
  m = cfg.model
  T = 256
  counts = count_params(cfg)
  head_dim = m.d_model // m.n_heads
  keys = np.mean([min(i, window or T) for i in range(1, T + 1)])
  expected_dense = 6 * (counts.non_embedding + m.d_model * m.vocab_size)
  expected_attention = 3 * m.n_layers * m.n_heads * (2 * 2 * head_dim) * keys
  flops = training_flops_per_token(cfg, count_params(cfg), T)
  assert flops.dense == pytest.approx(expected_dense)
  assert flops.attention == pytest.approx(expected_attention)
  assert flops.total == pytest.approx(expected_dense + expected_attention)
  # Causal: about half of the full T² attention (PaLM's 12·L·H·Q·T, halved).
  if window is None:
    full = 12 * m.n_layers * m.n_heads * head_dim * T
    assert flops.attention == pytest.approx(full / 2, rel=1 / T + 1e-9)
