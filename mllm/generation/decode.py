"""Autoregressive generation with the KV cache: batched prefill, then one jitted decode loop.

    tokens = generate_tokens(model, [[1, 2, 3], [4, 5]], max_new_tokens=20, eos_id=0)

Prompts of different lengths share one batch: right-padded, the padding at position −1 (neither
attended nor cached), so each sequence continues from its own length. Prompt lengths are rounded
up to a power of two (at least 8), so new prompt lengths rarely compile anew. The prompt goes
through the model in chunks of `prefill_chunk` tokens (a long prompt never materialises one
T × T score matrix); then a single `lax.while_loop` decodes every new token of every sequence with
the cache donated: no Python per token, no copy of the cache per step. A sequence stops at
`eos_id` (kept) or after `max_new_tokens`.

Streaming: `stream=fn` gets each step's tokens from inside the loop through an ordered
`io_callback`, so text appears as it is produced without giving up the single compiled loop.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from mllm.generation.sampling import penalize_repeats, sample
from mllm.layers.kv_cache import KVCache, empty_cache, slots_for
from mllm.ops.mesh import mesh_of, traced_on


def bucket(length: int, minimum: int = 8) -> int:
  """The padded prompt length: the next power of two, at least `minimum`."""
  return max(minimum, 1 << max(0, length - 1).bit_length())


def generate_tokens(
  model: nnx.Module,
  prompts: list[list[int]],
  *,
  max_new_tokens: int,
  eos_id: int | None = None,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  repetition_penalty: float = 1.0,
  seed: int = 0,
  prefill_chunk: int = 512,
  max_len: int | None = None,
  stream=None,
  timings: dict | None = None,
) -> list[list[int]]:
  """The new tokens of each prompt (up to and including EOS). `model` in eval mode is assumed.

  max_len: the cache's length per sequence (default: the padded prompt plus max_new_tokens).
  stream(tokens [B], finished [B]): called from inside the decode loop with every step's tokens
  as they are produced (a finished sequence's entries are padding).
  timings, if given, receives compile_s (tracing and compiling, zero once cached), then
  prefill_s and decode_s, which exclude it.
  """
  lengths = [len(p) for p in prompts]
  chunk = min(prefill_chunk, bucket(max(lengths)))
  width = -(-bucket(max(lengths)) // chunk) * chunk  # whole chunks: one prefill program
  max_len = max_len or width + max_new_tokens
  if max(lengths) + max_new_tokens > max_len:
    raise ValueError(
      f'the longest prompt ({max(lengths)} tokens) plus max_new_tokens '
      f'({max_new_tokens}) exceeds the cache (max_len={max_len})'
    )
  chunks, seen = _prompt_chunks(prompts, width, chunk, model.embed.num_embeddings)
  cache = empty_cache_for(model, len(prompts), max_len)
  graphdef, state = nnx.split(model)
  decode_kwargs = dict(
    max_new_tokens=max_new_tokens,
    eos_id=-1 if eos_id is None else eos_id,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    repetition_penalty=repetition_penalty,
    streaming=stream is not None,
  )
  start = time.perf_counter()
  prefill, decode = _compile(graphdef, state, chunks[0], cache, seen, seed, decode_kwargs)
  compiled = time.perf_counter()
  last_logits, cache = _prefill_chunks(prefill, state, chunks, cache, lengths, chunk)
  prefilled = time.perf_counter()
  out, count = _decode_streaming(decode, state, cache, last_logits, lengths, seen, seed, stream)
  if timings is not None:
    timings.update(
      compile_s=compiled - start,
      prefill_s=prefilled - compiled,
      decode_s=time.perf_counter() - prefilled,
    )
  return [out[b, : count[b]].tolist() for b in range(len(prompts))]


def _prompt_chunks(prompts: list[list[int]], width: int, chunk: int, vocab: int):
  """The right-padded prompts as prefill chunks of (tokens, positions) [B, chunk] (position -1:
  padding, never attended), and which tokens each prompt holds [B, vocab] (for the repetition
  penalty)."""
  tokens = np.zeros((len(prompts), width), np.int32)
  positions = np.full((len(prompts), width), -1, np.int32)
  seen = np.zeros((len(prompts), vocab), bool)
  for b, prompt in enumerate(prompts):
    tokens[b, : len(prompt)] = prompt
    positions[b, : len(prompt)] = np.arange(len(prompt))
    seen[b, prompt] = True
  chunks = [
    (jnp.asarray(tokens[:, i : i + chunk]), jnp.asarray(positions[:, i : i + chunk]))
    for i in range(0, width, chunk)
  ]
  return chunks, seen


def _compile(graphdef, state, first_chunk, cache, seen, seed: int, decode_kwargs: dict):
  """The prefill and decode programs, compiled ahead of time (cached by JAX after the first call),
  so that the timings hold only the prefill and the decode."""
  batch, vocab = seen.shape
  # Traced for the mesh the parameters live on (load_run's), as the train step is, so `auto`
  # chooses for those devices. (No Pallas kernel runs here: a prefill chunk with a cache goes
  # blockwise and a decode step xla, see ops.attention.cached_impl.)
  with traced_on(mesh_of(state)):
    prefill = _prefill.lower(graphdef, state, *first_chunk, cache).compile()
    logits_shape = jax.ShapeDtypeStruct((batch, vocab), jnp.float32)
    decode = _decode.lower(
      graphdef,
      state,
      cache,
      logits_shape,
      jnp.zeros(batch, jnp.int32),
      jnp.asarray(seen),
      jax.random.key(seed),
      **decode_kwargs,
    ).compile()
  return prefill, decode


def _prefill_chunks(prefill, state, chunks, cache, lengths: list[int], chunk: int):
  """(the logits at each sequence's last prompt token [B, vocab], the filled cache)."""
  last_logits = None
  for start_index, (chunk_tokens, chunk_positions) in zip(
    range(0, len(chunks) * chunk, chunk), chunks
  ):
    logits, cache = prefill(state, chunk_tokens, chunk_positions, cache)
    # The logits at each sequence's last prompt token, wherever that falls.
    ends = np.asarray(lengths) - 1 - start_index
    inside = (ends >= 0) & (ends < chunk)
    picked = logits[jnp.arange(len(lengths)), jnp.asarray(np.clip(ends, 0, chunk - 1))]
    last_logits = picked if last_logits is None else jnp.where(inside[:, None], picked, last_logits)
  jax.block_until_ready(last_logits)
  return last_logits, cache


def _decode_streaming(decode, state, cache, last_logits, lengths, seen, seed: int, stream):
  """(new tokens [B, max_new_tokens], how many each sequence made [B]); `stream` receives every
  step's tokens while the compiled loop runs."""
  global _STREAM_SINK
  _STREAM_SINK = stream
  try:
    out, count, _ = decode(
      state,
      cache,
      last_logits,
      jnp.asarray(lengths, jnp.int32),
      jnp.asarray(seen),
      jax.random.key(seed),
    )
    out, count = np.asarray(out), np.asarray(count)
    jax.effects_barrier()  # every streamed step has reached the sink
  finally:
    _STREAM_SINK = None
  return out, count


# Where the decode loop's streamed tokens go: set for the length of one generate_tokens call, so
# the compiled loop (which only knows `_emit`) serves every caller without recompiling.
_STREAM_SINK = None


def _emit(tokens_B, finished_B):
  if _STREAM_SINK is not None:
    _STREAM_SINK(np.asarray(tokens_B), np.asarray(finished_B))


def empty_cache_for(model, batch: int, max_len: int) -> KVCache:
  """An empty cache shaped for `model` (layers, KV heads, head size, window, compute dtype)."""
  out = (model.blocks.attention if model.scan_layers else model.blocks[0].attention).out
  layers = out.kernel.shape[0] if model.scan_layers else len(model.blocks)
  k_tail, v_tail = model.cache_dims
  return empty_cache(
    layers,
    batch,
    slots_for(model.cache_window, max_len),
    k_tail,
    v_tail,
    out.dtype or out.kernel.dtype,
  )


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _prefill(graphdef, state, tokens_BT, positions_BT, cache: KVCache):
  return nnx.merge(graphdef, state)(tokens_BT, positions=positions_BT, cache=cache)


@functools.partial(
  jax.jit,
  static_argnums=0,
  donate_argnums=2,
  static_argnames=(
    'max_new_tokens',
    'eos_id',
    'temperature',
    'top_k',
    'top_p',
    'repetition_penalty',
    'streaming',
  ),
)
def _decode(
  graphdef,
  state,
  cache: KVCache,
  logits_BV,
  next_pos_B,
  seen_BV,
  key,
  *,
  max_new_tokens: int,
  eos_id: int,
  temperature: float,
  top_k: int,
  top_p: float,
  repetition_penalty: float,
  streaming: bool,
):
  """(tokens [B, max_new_tokens], how many each sequence produced, the final cache) in one
  while_loop. The cache is returned so that the donated input buffers hold it: one cache in
  memory, updated in place."""
  model = nnx.merge(graphdef, state)
  batch = logits_BV.shape[0]
  penalize = repetition_penalty != 1.0

  def cond(carry):
    step, _, _, _, done, _, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    step, cache, logits, out, done, count, seen = carry
    if penalize:
      logits = penalize_repeats(logits, seen, repetition_penalty)
    token = sample(
      logits, jax.random.fold_in(key, step), temperature=temperature, top_k=top_k, top_p=top_p
    )
    token = jnp.where(done, 0, token)
    if streaming:
      io_callback(_emit, None, token, done, ordered=True)
    if penalize:
      seen = seen.at[jnp.arange(batch), token].set(seen[jnp.arange(batch), token] | ~done)
    out = out.at[:, step].set(token)
    count = count + (~done).astype(jnp.int32)
    done = done | (token == eos_id)
    positions = jnp.where(done, -1, next_pos_B + step)[:, None]  # a finished sequence stops
    new_logits, cache = model(token[:, None], positions=positions, cache=cache)
    return step + 1, cache, new_logits[:, -1], out, done, count, seen

  carry = (
    jnp.zeros((), jnp.int32),
    cache,
    logits_BV,
    jnp.zeros((batch, max_new_tokens), jnp.int32),
    jnp.zeros((batch,), bool),
    jnp.zeros((batch,), jnp.int32),
    seen_BV,
  )
  _, cache, _, out, _, count, _ = jax.lax.while_loop(cond, body, carry)
  return out, count, cache
