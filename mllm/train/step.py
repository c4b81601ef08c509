"""The jitted training and evaluation steps: pure functions of (state, batch).

Loss: mean next-token cross-entropy over the tokens whose loss_mask is 1 (padding is 0). With
gradient accumulation the micro-batch sums are added up before dividing, so the update equals the
one from the whole batch at once.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mllm.train.sharding import batch_sharding, replicated
from mllm.train.state import Model, TrainState

def _forward(model: Model, params, batch, dropout_key=None):
  net = model.merge(params)
  if dropout_key is not None:
    nnx.reseed(net, dropout=dropout_key, policy='match_shape')
  else:
    net.eval()  # dropout off
  packed = model.config.data.document_mask
  logits = net(batch['inputs'], positions=batch['positions'] if packed else None,
               segment_ids=batch['segment_ids'] if packed else None)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])
  return losses * batch['loss_mask']


def _loss_sum(params, model: Model, batch, dropout_key):
  losses = _forward(model, params, batch, dropout_key)
  return losses.sum(), batch['loss_mask'].sum()


def _has_dropout(cfg) -> bool:
  return max(cfg.dropout, cfg.embed_dropout, cfg.attention.dropout) > 0


def make_train_step(model: Model):
  """`step(state, batch) -> (state, metrics)`, jitted, with the state donated."""
  accum = model.config.train.grad_accum_steps
  grad_fn = jax.value_and_grad(_loss_sum, has_aux=True)
  dropout = _has_dropout(model.config.model)

  def step(state: TrainState, batch) -> tuple[TrainState, dict]:
    params = state['params']
    key = jax.random.fold_in(jax.random.wrap_key_data(state['rng']), state['step'])
    if accum == 1:
      (loss_sum, count), grads = grad_fn(params, model, batch, key if dropout else None)
    else:
      # Row r goes to micro-batch r % accum, so every micro-batch is spread over all devices.
      micro = jax.tree.map(
          lambda x: jnp.moveaxis(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 1, 0),
          batch)

      def add(carry, inputs):
        i, mb = inputs
        (l, c), g = grad_fn(params, model, mb, jax.random.fold_in(key, i) if dropout else None)
        return jax.tree.map(jnp.add, carry, ((l, c), g)), None
      zeros = ((jnp.zeros(()), jnp.zeros(())), jax.tree.map(jnp.zeros_like, params))
      ((loss_sum, count), grads), _ = jax.lax.scan(add, zeros, (jnp.arange(accum), micro))
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = model.tx.update(grads, state['opt_state'], params)
    new_params = optax.apply_updates(params, updates)
    new_state = {'step': state['step'] + 1, 'params': new_params, 'opt_state': opt_state,
                 'rng': state['rng']}
    # A finite loss can still come with an overflowing update; the loop must not save that state.
    finite = jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(new_params)]))
    metrics = {'loss': loss_sum / count, 'grad_norm': optax.tree_utils.tree_norm(grads),
               'learning_rate': model.schedule(state['step']), 'tokens': count,
               'params_finite': finite}
    return new_state, metrics

  metrics_sharding = replicated(model.mesh)
  return jax.jit(step, donate_argnums=0,
                 in_shardings=(model.shardings, batch_sharding(model.mesh)),
                 out_shardings=(model.shardings, metrics_sharding))


def make_eval_step(model: Model, token_bytes: np.ndarray):
  """`eval(params, batch) -> {loss_sum, tokens, bytes}`: sums, so batches and hosts add up.

  bytes counts the UTF-8 bytes the target tokens stand for (bits per byte = nats / ln 2 / bytes).
  """
  table = jnp.asarray(token_bytes, jnp.float32)

  def evaluate(params, batch):
    losses = _forward(model, params, batch)
    mask = batch['loss_mask']
    return {'loss_sum': losses.sum(), 'tokens': mask.sum(),
            'bytes': (table[batch['targets']] * mask).sum()}

  return jax.jit(evaluate, in_shardings=(model.shardings['params'], batch_sharding(model.mesh)),
                 out_shardings=replicated(model.mesh))


def eval_summary(totals: dict) -> dict:
  """Mean loss, perplexity and bits per byte from summed eval outputs."""
  loss = totals['loss_sum'] / max(totals['tokens'], 1.0)
  return {'loss': loss, 'perplexity': math.exp(min(loss, 700.0)),
          'bits_per_byte': totals['loss_sum'] / math.log(2) / max(totals['bytes'], 1.0),
          'tokens': totals['tokens']}


def synthetic_batch(config, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
  """A random batch of the configured shape (benchmarks and smoke tests)."""
  rng = rng or np.random.default_rng(0)
  B, T = config.data.batch_size, config.data.seq_len
  tokens = rng.integers(0, config.model.vocab_size, (B, T + 1), dtype=np.int32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
          'positions': np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
          'segment_ids': np.ones((B, T), np.int32), 'loss_mask': np.ones((B, T), np.float32)}


def benchmark_step(config, mesh=None):
  """(step_fn, state, batch) for timing the training step of `config` on synthetic tokens."""
  from mllm.train.sharding import global_batch, make_mesh
  from mllm.train.state import setup
  mesh = mesh or make_mesh(config.mesh)
  model, init = setup(config, mesh)
  return make_train_step(model), init(), global_batch(synthetic_batch(config), mesh)
