"""Autoregressive generation with the KV cache: batched prefill, then one jitted decode loop.

    tokens = generate_tokens(model, [[1, 2, 3], [4, 5]], max_new_tokens=20, eos_id=0)

Prompts of different lengths share one batch: right-padded, the padding at position −1 (neither
attended nor cached), so each sequence continues from its own length. Prompt lengths are rounded
up to a power of two (at least 8), so new prompt lengths rarely compile anew. The prompt goes
through the model in chunks of `prefill_chunk` tokens (a long prompt never materialises one
T × T score matrix); then a single `lax.while_loop` decodes every new token of every sequence with
the cache donated: no Python per token, no copy of the cache per step. A sequence stops at
`eos_id` (kept) or after `max_new_tokens`.

Sampling (`sample`): greedy at temperature 0, else softmax(logits / temperature) restricted to the
top_k most likely tokens and to the smallest set whose probability reaches top_p (nucleus sampling,
Holtzman et al. 2020), drawn from a key folded with the step, so a seed fixes the output.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mllm.layers.kv_cache import KVCache, empty_cache, slots_for


def sample(logits_BV: jax.Array, key: jax.Array, *, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
  """Next tokens [B] (int32). temperature 0: argmax; top_k 0 and top_p 1: no truncation."""
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits = logits_BV.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    kept = (before < top_p).at[:, 0].set(True)  # the likeliest token is always kept
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def bucket(length: int, minimum: int = 8) -> int:
  """The padded prompt length: the next power of two, at least `minimum`."""
  return max(minimum, 1 << max(0, length - 1).bit_length())


def generate_tokens(model: nnx.Module, prompts: list[list[int]], *, max_new_tokens: int,
                    eos_id: int | None = None, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int = 0, prefill_chunk: int = 512,
                    max_len: int | None = None, timings: dict | None = None) -> list[list[int]]:
  """The new tokens of each prompt (up to and including EOS). `model` in eval mode is assumed.
  `timings`, if given, receives prefill_s and decode_s (compile included on a first call)."""
  start_time = time.perf_counter()
  lengths = [len(p) for p in prompts]
  width = bucket(max(lengths))
  tokens = np.zeros((len(prompts), width), np.int32)
  positions = np.full((len(prompts), width), -1, np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, :len(prompt)] = prompt
    positions[b, :len(prompt)] = np.arange(len(prompt))
  cache = empty_cache_for(model, len(prompts), max_len or width + max_new_tokens)
  graphdef, state = nnx.split(model)
  chunk = min(prefill_chunk, width)
  last_logits = None
  for start in range(0, width, chunk):
    logits, cache = _prefill(graphdef, state, jnp.asarray(tokens[:, start:start + chunk]),
                             jnp.asarray(positions[:, start:start + chunk]), cache)
    # The logits at each sequence's last prompt token, wherever that falls.
    ends = np.asarray(lengths) - 1 - start
    inside = (ends >= 0) & (ends < chunk)
    picked = logits[jnp.arange(len(prompts)), jnp.asarray(np.clip(ends, 0, chunk - 1))]
    last_logits = picked if last_logits is None else jnp.where(inside[:, None], picked,
                                                               last_logits)
  jax.block_until_ready(last_logits)
  prefill_done = time.perf_counter()
  out, count, _ = _decode(graphdef, state, cache, last_logits, jnp.asarray(lengths, jnp.int32),
                       jax.random.key(seed), max_new_tokens=max_new_tokens,
                       eos_id=-1 if eos_id is None else eos_id, temperature=temperature,
                       top_k=top_k, top_p=top_p)
  out, count = np.asarray(out), np.asarray(count)
  if timings is not None:
    timings.update(prefill_s=prefill_done - start_time,
                   decode_s=time.perf_counter() - prefill_done)
  return [out[b, :count[b]].tolist() for b in range(len(prompts))]


def empty_cache_for(model, batch: int, max_len: int) -> KVCache:
  """An empty cache shaped for `model` (layers, KV heads, head size, window, compute dtype)."""
  key = (model.blocks.attention if model.scan_layers else model.blocks[0].attention).key
  layers = key.kernel.shape[0] if model.scan_layers else len(model.blocks)
  _, kv_heads, head_dim = key.kernel.shape[-3:]
  return empty_cache(layers, batch, slots_for(model.window, max_len), kv_heads, head_dim,
                     key.dtype or key.kernel.dtype)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _prefill(graphdef, state, tokens_BT, positions_BT, cache: KVCache):
  return nnx.merge(graphdef, state)(tokens_BT, positions=positions_BT, cache=cache)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2,
                   static_argnames=('max_new_tokens', 'eos_id', 'temperature', 'top_k', 'top_p'))
def _decode(graphdef, state, cache: KVCache, logits_BV, next_pos_B, key, *, max_new_tokens: int,
            eos_id: int, temperature: float, top_k: int, top_p: float):
  """(tokens [B, max_new_tokens], how many each sequence produced, the final cache) in one
  while_loop. The cache is returned so that the donated input buffers hold it: one cache in
  memory, updated in place."""
  model = nnx.merge(graphdef, state)
  batch = logits_BV.shape[0]

  def cond(carry):
    step, _, _, _, done, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    step, cache, logits, out, done, count = carry
    token = sample(logits, jax.random.fold_in(key, step), temperature=temperature, top_k=top_k,
                   top_p=top_p)
    out = out.at[:, step].set(jnp.where(done, 0, token))
    count = count + (~done).astype(jnp.int32)
    done = done | (token == eos_id)
    positions = jnp.where(done, -1, next_pos_B + step)[:, None]  # a finished sequence stops
    new_logits, cache = model(token[:, None], positions=positions, cache=cache)
    return step + 1, cache, new_logits[:, -1], out, done, count

  carry = (jnp.zeros((), jnp.int32), cache, logits_BV,
           jnp.zeros((batch, max_new_tokens), jnp.int32), jnp.zeros((batch,), bool),
           jnp.zeros((batch,), jnp.int32))
  _, cache, _, out, _, count = jax.lax.while_loop(cond, body, carry)
  return out, count, cache


# ---------------------------------------------------------------------------------------------
# Text in, text out: a trained workdir's model and tokenizer.
# ---------------------------------------------------------------------------------------------

def load_run(workdir: str, like):
  """(model in eval mode, tokenizer, checkpoint step, config) of the training run in `workdir`.

  The architecture comes from the run's own config (config.json, else the checkpoint's copy), so
  any --config works; `like` (a full config) supplies the keys an older run did not save.
  """
  from mllm.config import ConfigError, validate
  from mllm.data.tokenizers import BPETokenizer, ByteTokenizer
  from mllm.paths import existing_dir
  from mllm.train.checkpoint import Checkpointer, StateMismatch
  from mllm.train.resume import as_config, saved_config
  from mllm.train.sharding import make_mesh
  from mllm.train.state import setup
  existing_dir('--workdir', workdir, 'the workdir of a training run')
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise ConfigError('--workdir', workdir, 'has no checkpoint to generate from; allowed: the '
                        'workdir of a training run')
    saved = saved_config(workdir, ckpt, step)
    config = as_config(saved, like) if saved is not None else like
    validate(config)
    model_parts, _ = setup(config, make_mesh(config.mesh))
    try:
      step, params = ckpt.restore_latest(model_parts.abstract_state['params'], params_only=True,
                                         set_aside=False)
    except StateMismatch as err:
      raise ConfigError('--workdir', workdir, f'its checkpoint step {err.step} does not match its '
                        'config; allowed: a workdir whose config.json describes its checkpoints')
  finally:
    ckpt.close()
  if config.data.tokenizer == 'byte':
    tokenizer = ByteTokenizer()
  else:
    path = f'{workdir}/tokenizer.json'
    try:
      tokenizer = BPETokenizer.from_file(path)
    except Exception as err:  # pylint: disable=broad-except  (missing or unreadable)
      raise ConfigError('--workdir', workdir, f'its tokenizer.json cannot be read '
                        f'({type(err).__name__}); allowed: the workdir of a training run') from None
  model = model_parts.merge(params)
  model.eval()
  return model, tokenizer, step, config


def check_request(model, prompts: list[list[int]], max_new_tokens: int) -> None:
  """One-line ConfigErrors for requests the model cannot serve."""
  from mllm.config import ConfigError
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ConfigError('--max_new_tokens', max_new_tokens, 'must be a positive integer')
  if not prompts:
    raise ConfigError('--prompt', '', 'no prompt given; allowed: --prompt=TEXT or '
                      '--prompt_file=FILE with one prompt per line')
  for i, prompt in enumerate(prompts):
    if not prompt:
      raise ConfigError('--prompt', '', f'prompt {i + 1} is empty; allowed: at least one token')
  table = model.position.max_positions
  longest = max(len(p) for p in prompts)
  if table is not None and longest + max_new_tokens > table:
    raise ConfigError('--max_new_tokens', max_new_tokens,
                      f'learned positions end at model.max_seq_len={table} and the longest prompt '
                      f'has {longest} tokens; allowed: <= {max(table - longest, 0)}')


def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int = 100,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_at_eos: bool = True, timings: dict | None = None) -> list[str]:
  """The continuation of each text prompt (its new tokens, decoded; EOS not included)."""
  ids = [tokenizer.encode(p) for p in prompts]
  check_request(model, ids, max_new_tokens)
  eos = tokenizer.eos_id if stop_at_eos else None
  out = generate_tokens(model, ids, max_new_tokens=max_new_tokens, eos_id=eos,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        timings=timings)
  if timings is not None:
    timings.update(prompt_tokens=sum(len(p) for p in ids), new_tokens=sum(len(o) for o in out))
  return [tokenizer.decode([t for t in seq if t != tokenizer.eos_id]) for seq in out]
