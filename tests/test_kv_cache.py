"""Decoding with the KV cache equals recomputing the full forward pass: every position scheme ×
(MHA, GQA, MQA) × (full, sliding window, far past the window's rolling buffer); prompts of
different lengths in one batch; a prompt fed in chunks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

from mllm.layers.kv_cache import cache_size, init_cache, write_slots
from mllm.layers.positions import POSITIONS
from mllm.model import build_model

WINDOW = 4
PROMPT, STEPS = 5, 10  # 15 tokens: past 3 × WINDOW, so the rolling buffer wraps several times


def make(pos: str, n_kv: int, window: int | None, **extra):
  extra.setdefault('model__attention__impl', 'xla')
  cfg = tiny_config(
    f'pos={pos}',
    model__n_heads=4,
    model__n_kv_heads=n_kv,
    model__attention__sliding_window=window,
    model__max_seq_len=96,
    **extra,
  )
  model = build_model(cfg, rngs=nnx.Rngs(0))
  model.eval()
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens, positions, cache):
    return nnx.merge(graphdef, state)(tokens, positions=positions, cache=cache)

  @jax.jit
  def full(state, tokens):
    return nnx.merge(graphdef, state)(tokens)

  return cfg, (lambda *a: forward(state, *a)), (lambda t: full(state, t))


def greedy(cfg, forward, prompt_BT, steps, max_len, chunk=None):
  """Greedy tokens and the logits of every cached pass, prompt first (in chunks if asked)."""
  batch = prompt_BT.shape[0]
  cache = init_cache(cfg.model, batch, max_len)
  chunk = chunk or prompt_BT.shape[1]
  logits = []
  for start in range(0, prompt_BT.shape[1], chunk):
    out, cache = forward(prompt_BT[:, start : start + chunk], None, cache)
    logits.append(out)
  tokens = [prompt_BT]
  for _ in range(steps):
    nxt = jnp.argmax(logits[-1][:, -1], axis=-1)[:, None].astype(jnp.int32)
    tokens.append(nxt)
    out, cache = forward(nxt, None, cache)
    logits.append(out)
  return jnp.concatenate(tokens, axis=1), jnp.concatenate(logits, axis=1), cache


# Every position scheme with every head grouping (MHA, GQA, MQA), the window alternating so that
# each scheme and each grouping runs both with and without it: all pairs of the three choices, not
# all triples (21 compiled models instead of 42; the choices meet in separate code: the scheme in
# the scores' positions, the grouping in the cache's head axis, the window in its slots).
CASES = [
  (pos, n_kv, WINDOW if (p + k) % 2 else None)
  for p, pos in enumerate(sorted(POSITIONS))
  for k, n_kv in enumerate((4, 2, 1))
]


@pytest.mark.parametrize('pos, n_kv, window', CASES)
def test_cached_greedy_decoding_equals_the_full_forward(pos, n_kv, window):
  # One layer: the scheme, grouping and window live inside a layer's attention; the two-layer
  # tests below check that each layer reads and writes its own cache.
  cfg, forward, full = make(pos, n_kv, window, model__n_layers=1)
  prompt = jax.random.randint(jax.random.key(1), (2, PROMPT), 0, cfg.model.vocab_size)
  tokens, cached_logits, cache = greedy(cfg, forward, prompt, STEPS, PROMPT + STEPS)
  reference = full(tokens[:, :-1])  # position t's logits predict token t + 1
  np.testing.assert_allclose(
    cached_logits[:, : PROMPT + STEPS - 1], reference, rtol=1e-5, atol=1e-5
  )
  np.testing.assert_array_equal(tokens[:, PROMPT:], jnp.argmax(reference[:, PROMPT - 1 :], -1))
  # The rolling buffer holds W slots, the latest W positions; a full cache holds them all.
  assert cache.size == (WINDOW if window else PROMPT + STEPS)
  np.testing.assert_array_equal(
    np.sort(np.asarray(cache.positions), axis=1),
    np.tile(np.arange(PROMPT + STEPS - cache.size, PROMPT + STEPS), (2, 1)),
  )


@pytest.mark.parametrize('window', [None, WINDOW])
def test_a_batch_of_prompts_of_different_lengths_equals_one_at_a_time(window):
  cfg, forward, _ = make('rope', 2, window)
  lengths = [5, 2, 7]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.model.vocab_size, n).astype(np.int32) for n in lengths]
  width = max(lengths)
  padded = np.zeros((3, width), np.int32)
  positions = np.full((3, width), -1, np.int32)  # −1: padding, neither attended nor cached
  for b, p in enumerate(prompts):
    padded[b, : len(p)] = p
    positions[b, : len(p)] = np.arange(len(p))
  cache = init_cache(cfg.model, 3, width + STEPS)
  logits, cache = forward(jnp.asarray(padded), jnp.asarray(positions), cache)
  last = jnp.asarray([logits[b, n - 1] for b, n in enumerate(lengths)])
  batched = []
  for _ in range(STEPS):
    nxt = jnp.argmax(last, axis=-1)[:, None].astype(jnp.int32)
    batched.append(nxt[:, 0])
    out, cache = forward(nxt, None, cache)
    last = out[:, -1]
  batched = np.stack(batched, axis=1)
  for b, p in enumerate(prompts):
    alone, _, _ = greedy(cfg, forward, jnp.asarray(p)[None], STEPS, width + STEPS)
    np.testing.assert_array_equal(batched[b], np.asarray(alone[0, len(p) :]), err_msg=str(b))


@pytest.mark.parametrize(
  'pos, window',
  [
    ('rope', None),
    ('rope', WINDOW),
    ('alibi', WINDOW),
    ('t5', None),
    ('shaw', WINDOW),
    ('learned', None),
  ],
)
def test_chunked_prefill_equals_one_shot(pos, window):
  cfg, forward, _ = make(pos, 2, window)
  prompt = jax.random.randint(jax.random.key(2), (2, 11), 0, cfg.model.vocab_size)
  one = greedy(cfg, forward, prompt, 4, 15)
  for chunk in (1, 3, 5):  # 5 > WINDOW: a chunk longer than the rolling buffer
    chunked = greedy(cfg, forward, prompt, 4, 15, chunk=chunk)
    np.testing.assert_array_equal(chunked[0], one[0])
    np.testing.assert_allclose(chunked[1], one[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(chunked[2].positions, one[2].positions)


@pytest.mark.parametrize('impl', ['blockwise', 'pallas'])
@pytest.mark.parametrize('pos, window', [('rope', None), ('alibi', WINDOW)])
def test_tiled_prefill_equals_xla(impl, pos, window):
  """A prefill chunk against the cache through the tiled implementations (pallas hands it to
  blockwise) equals the 'xla' reference's logits. Tiles of 4 (pallas' smallest is 16) and chunks
  of 2.5 tiles, so each chunk spans several query and key blocks."""
  tile = 4 if impl == 'blockwise' else 16
  cfg, forward, _ = make(pos, 2, window)
  _, tiled, _ = make(
    pos,
    2,
    window,
    model__attention__impl=impl,
    model__attention__block_q=tile,
    model__attention__block_k=tile,
  )
  prompt = jax.random.randint(jax.random.key(4), (2, 5 * tile), 0, cfg.model.vocab_size)
  want = greedy(cfg, forward, prompt, 3, 5 * tile + 3, chunk=5 * tile // 2)
  got = greedy(cfg, tiled, prompt, 3, 5 * tile + 3, chunk=5 * tile // 2)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[0], want[0])


def test_cache_shapes_and_write_slots():
  cfg = tiny_config(model__n_heads=4, model__n_kv_heads=1)
  cache = init_cache(cfg.model, 3, 20)
  assert cache.k.shape == (2, 3, 20, 1, 4) and cache.positions.shape == (3, 20)
  gqa = init_cache(tiny_config(model__n_heads=4, model__n_kv_heads=2).model, 3, 20)
  assert gqa.k.nbytes == 2 * cache.k.nbytes  # MQA holds half of GQA-2's keys
  assert cache_size(tiny_config(model__attention__sliding_window=6).model, 20) == 6
  with_global = tiny_config(model__attention__sliding_window=6, model__attention__global_every=2)
  assert cache_size(with_global.model, 20) == 20  # a global layer keeps every key
  # A chunk of 7 tokens into a 4-slot buffer: only the last 4 are written; padding never.
  slots = write_slots(jnp.asarray([[0, 1, 2, 3, 4, 5, 6], [3, 4, -1, -1, -1, -1, -1]]), 4)
  np.testing.assert_array_equal(slots, [[4, 4, 4, 3, 0, 1, 2], [3, 0, 4, 4, 4, 4, 4]])


@pytest.mark.parametrize('layer', [None, 1])
def test_cache_writes_use_in_range_indices_and_skip_unwritten_slots(layer):
  """`scatter` against a NumPy loop: written slots take their token, a slot of S (padding, or a
  token a later one overwrites) is skipped, a row writing nothing is unchanged; and every index
  it hands XLA is in range (out-of-range 'drop' is where backends disagree)."""
  from mllm.layers.kv_cache import plan_writes, scatter

  S = 5
  rng = np.random.default_rng(0)
  slots = np.full((4, 6), S)  # row 3 writes nothing
  slots[0] = [S, S, 4, 0, 1, S]
  slots[1] = [2, S, S, S, S, S]
  slots[2] = rng.permutation(S).tolist() + [S]  # all slots, one token skipped
  shape = (3, 4, S, 2) if layer is not None else (4, S, 2)
  cache = rng.normal(size=shape).astype(np.float32)
  new = rng.normal(size=(4, 6, 2)).astype(np.float32)

  want = cache.copy()
  view = want[layer] if layer is not None else want
  for b in range(4):
    for t in range(6):
      if slots[b, t] < S:
        view[b, slots[b, t]] = new[b, t]
  writes = plan_writes(jnp.asarray(slots), S)
  got = scatter(jnp.asarray(cache), jnp.asarray(new), writes, layer)
  np.testing.assert_array_equal(got, want)

  assert (np.asarray(writes.target) >= 0).all() and (np.asarray(writes.target) < S).all()
  assert (np.asarray(writes.source) >= 0).all() and (np.asarray(writes.source) < 6).all()
  assert (np.asarray(writes.row) < 4).all() and bool(writes.any)
  nothing = plan_writes(jnp.full((2, 3), S), S)  # a pass of padding only: the cache unchanged
  np.testing.assert_array_equal(
    scatter(jnp.asarray(cache), jnp.asarray(new[:2, :3]), nothing, layer)[
      (layer,) if layer is not None else ()
    ][:2],
    cache[(layer,) if layer is not None else ()][:2],
  )


@pytest.mark.parametrize(
  'extra',
  [
    # The cache is scanned with the stacked layers, two iterations of a period of two layers
    # (windowed, then global without RoPE), with the value residual.
    dict(
      model__scan_layers=True,
      model__n_layers=4,
      model__attention__global_every=2,
      model__position__rope__nope_every=2,
      model__attention__value_residual=True,
    ),
    dict(
      model__ffn__kind='moe', model__ffn__moe__num_experts=4, model__ffn__moe__capacity_factor=4.0
    ),
    # p-RoPE: half of each head rotated at full RoPE's highest frequencies.
    dict(
      model__attention__qk_norm=True,
      model__norm__placement='post',
      model__attention__output_gate='elementwise',
      model__position__rope__fraction=0.5,
      model__position__rope__frequencies='highest',
    ),
    # Layer 1 global and without RoPE (the cache keeps every key: no rolling buffer), the value
    # residual, sinks.
    dict(
      model__attention__global_every=2,
      model__position__rope__nope_every=2,
      model__attention__value_residual=True,
      model__attention__sinks=True,
    ),
    # MLA decodes over its latent cache with W^UK absorbed (mllm/layers/mla.py): the rolling
    # window's buffer, the query's low-rank path, sinks, a value head size of its own, scanned.
    dict(
      model__attention__kind='mla',
      model__n_kv_heads=4,
      model__attention__mla__q_lora_rank=8,
      model__attention__mla__v_head_dim=6,
      model__attention__sinks=True,
      model__scan_layers=True,
    ),
  ],
  ids=[
    'scan-layer_patterns-value_residual',
    'moe',
    'qk_norm-post_ln-output_gate-p_rope',
    'layer_patterns-value_residual-sinks',
    'mla',
  ],
)
def test_cached_decoding_with_scan_moe_qk_norm_output_gate_and_layer_patterns(extra):
  cfg, forward, full = make('rope', extra.pop('model__n_kv_heads', 2), WINDOW, **extra)
  prompt = jax.random.randint(jax.random.key(3), (2, PROMPT), 0, cfg.model.vocab_size)
  tokens, cached_logits, _ = greedy(cfg, forward, prompt, STEPS, PROMPT + STEPS)
  np.testing.assert_allclose(cached_logits[:, :-1], full(tokens[:, :-1]), rtol=1e-5, atol=1e-5)


# --- generate_tokens: prefill + one jitted decode loop, and sampling ---------------------------


def test_generate_greedy_equals_step_by_step_decoding_and_stops_at_eos():
  from mllm.generation import generate_tokens

  cfg, forward, _ = make('rope', 2, WINDOW)
  model = build_model(cfg, rngs=nnx.Rngs(0))
  model.eval()
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, 32, n).tolist() for n in (5, 2, 9)]
  out = generate_tokens(model, prompts, max_new_tokens=STEPS, prefill_chunk=4)
  for b, p in enumerate(prompts):
    alone, _, _ = greedy(cfg, forward, jnp.asarray(p, jnp.int32)[None], STEPS, 9 + STEPS)
    assert out[b] == np.asarray(alone[0, len(p) :]).tolist(), b
  eos = out[0][3]  # a token the first sequence produces; each stops at its first, if any
  stopped = generate_tokens(model, prompts, max_new_tokens=STEPS, eos_id=eos)
  for b in range(3):
    cut = out[b].index(eos) + 1 if eos in out[b] else STEPS
    assert stopped[b] == out[b][:cut]
  assert len(stopped[0]) <= 4 < STEPS


def test_sampling_is_seeded_and_top_k_top_p_keep_only_allowed_tokens():
  from mllm.generation import sample

  logits = jax.random.normal(jax.random.key(0), (64, 50)) * 3
  probs = np.asarray(jax.nn.softmax(logits, -1))
  key = jax.random.key(7)
  a = sample(logits, key, temperature=1.0, top_k=5)
  np.testing.assert_array_equal(a, sample(logits, key, temperature=1.0, top_k=5))
  top5 = np.argsort(-np.asarray(logits), -1)[:, :5]
  for trial in range(20):
    got = np.asarray(sample(logits, jax.random.key(trial), temperature=1.0, top_k=5))
    assert all(got[i] in top5[i] for i in range(64))
    nucleus = np.asarray(sample(logits, jax.random.key(trial), temperature=0.7, top_p=0.6))
    for i in range(64):
      order = np.argsort(-probs[i])
      mass_before = np.cumsum(probs[i][order]) - probs[i][order]
      allowed = set(order[mass_before < 0.6])  # the smallest set reaching 0.6 (T only sharpens)
      assert nucleus[i] in allowed or probs[i][nucleus[i]] >= min(probs[i][list(allowed)])
  greedy_tokens = np.argmax(np.asarray(logits), -1)
  np.testing.assert_array_equal(sample(logits, key, temperature=0.0), greedy_tokens)
  np.testing.assert_array_equal(sample(logits, key, temperature=1.0, top_k=1), greedy_tokens)


def test_repetition_penalty_equals_the_formula_on_full_forward_logits():
  """Greedy with CTRL's penalty (HF's RepetitionPenaltyLogitsProcessor): step by step in NumPy
  on the full forward's logits, the prompt's tokens counting as seen."""
  from mllm.generation import generate_tokens

  cfg, _, full = make(
    'rope', 2, None, model__init='fixed', model__init_std=0.3
  )  # peaked logits: varied tokens
  model = build_model(cfg, rngs=nnx.Rngs(0))
  model.eval()
  prompts = [[3, 3, 7, 1], [5, 9]]
  got = generate_tokens(model, prompts, max_new_tokens=STEPS, repetition_penalty=1.8)
  width = max(map(len, prompts)) + STEPS
  for b, prompt in enumerate(prompts):
    seq = list(prompt)
    for _ in range(STEPS):
      # Padded to one width (one compiled program): causal, so the padding after position
      # len(seq) - 1 does not reach its logits.
      padded = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
      logits = np.asarray(full(padded))[0, len(seq) - 1].astype(np.float64)
      seen = sorted(set(seq))
      logits[seen] = np.where(logits[seen] > 0, logits[seen] / 1.8, logits[seen] * 1.8)
      seq.append(int(np.argmax(logits)))
    assert got[b] == seq[len(prompt) :], b
  plain = generate_tokens(model, prompts, max_new_tokens=STEPS)
  assert plain != got  # the penalty changed something here (so the check above has teeth)


def test_streamed_tokens_are_the_returned_tokens_in_order():
  from mllm.generation import generate_tokens

  cfg, _, _ = make('rope', 2, WINDOW)
  model = build_model(cfg, rngs=nnx.Rngs(0))
  model.eval()
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  steps = []
  out = generate_tokens(
    model,
    prompts,
    max_new_tokens=STEPS,
    temperature=1.0,
    seed=2,
    stream=lambda tokens, finished: steps.append((tokens, finished)),
  )
  assert len(steps) == STEPS
  for b in range(2):
    assert [int(t[b]) for t, f in steps if not f[b]] == out[b]
  with pytest.raises(ValueError, match='exceeds the cache'):
    generate_tokens(model, prompts, max_new_tokens=STEPS, max_len=STEPS + 4)


def test_text_stream_waits_for_whole_characters():
  from mllm.data.tokenizers import ByteTokenizer
  from mllm.generation import TextStream

  tokenizer = ByteTokenizer()
  pieces = []
  stream = TextStream(tokenizer, pieces.append)
  ids = tokenizer.encode('a€b')  # € is three bytes
  for token in ids:
    stream(np.asarray([token]), np.asarray([False]))
  stream(np.asarray([tokenizer.eos_id]), np.asarray([False]))  # EOS prints nothing
  assert pieces == ['a', '€', 'b']
