"""The jitted training and evaluation steps: pure functions of (state, batch).

Loss: mean next-token cross-entropy over the tokens whose loss_mask is 1 (padding is 0), plus the
MoE balancing losses, the output z-loss, and with multi-token prediction its weighted mean
second-next-token cross-entropy (DeepSeek-V3, eq. 24-25). With gradient accumulation each
micro-batch's sum is divided by the whole batch's token count, so the update equals the one from
the whole batch at once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mllm.layers.moe import draws_noise, moe_layers, moe_metrics, update_expert_biases
from mllm.layers.moe_routing import balancing_objective
from mllm.ops.cross_entropy import cross_entropy_and_logsumexp
from mllm.ops.mesh import traced_on
from mllm.train.sharding import batch_sharding, replicated
from mllm.train.state import ModelSetup, TrainSetup, TrainState, split_trained


def _forward(
  train_setup: ModelSetup, params, batch, *, train: bool, dropout_key=None, probe: bool = False
):
  """(per-token losses × loss_mask [B, T], statistics: the MoE layers' routing statistics, the
  output's log Z sums and, with `probe`, each layer's largest attention logit).

  train=True: the training computation (dropout and router noise drawn from `dropout_key` where
  the config has them; a capacity MoE drops what overflows its capacity). train=False:
  inference (`model.eval()`: nothing random, no token dropped)."""
  with traced_on(train_setup.mesh):  # kernels choose for, and split over, the step's devices
    return _forward_on_mesh(train_setup, params, batch, train, dropout_key, probe)


def _forward_on_mesh(train_setup: ModelSetup, params, batch, train: bool, dropout_key, probe):
  net = train_setup.merge(params)
  if not train:
    net.eval()
  elif dropout_key is not None:
    nnx.reseed(net, dropout=dropout_key, policy='match_shape')
  packed = train_setup.config.data.document_mask
  mtp = train and train_setup.config.model.multi_token_prediction
  logits, moe_stats = net(
    batch['inputs'],
    positions=batch['positions'] if packed else None,
    segment_ids=batch['segment_ids'] if packed else None,
    return_moe_stats=True,
    float32_logits=False,  # the loss upcasts pass by pass (a float32 copy would cost a bf16 step)
    probe_attention=probe,
    next_tokens=batch['targets'] if mtp else None,
  )
  losses, log_z = cross_entropy_and_logsumexp(logits, batch['targets'])
  mask = batch['loss_mask']
  # Sums over the masked tokens (summed, not averaged, over micro-batches): the output's log Z,
  # logged, and log² Z, PaLM's z-loss (train.z_loss_coef).
  stats = {**moe_stats, 'log_z_sum': (log_z * mask).sum(), 'log_z_sq_sum': (log_z**2 * mask).sum()}
  if mtp:  # position i's logits for t_{i+2} = targets[i + 1]
    mtp_losses, _ = cross_entropy_and_logsumexp(
      stats.pop('mtp_logits')[:, :-1], batch['targets'][:, 1:]
    )
    stats['mtp_loss_sum'] = (mtp_losses * mtp_mask(batch, packed)).sum()
  return losses * mask, stats


def mtp_mask(batch, packed: bool) -> jax.Array:
  """[B, T − 1]: where position i's second-next token t_{i+2} (targets[i + 1]) is scored: both
  targets in the loss and, with packed documents, positions i and i + 1 in one document."""
  m = batch['loss_mask'][:, :-1] * batch['loss_mask'][:, 1:]
  if packed:
    m = m * (batch['segment_ids'][:, :-1] == batch['segment_ids'][:, 1:])
  return m


def mtp_weight(train_cfg, step) -> jax.Array:
  """The multi-token-prediction loss's weight at `step`: mtp_coef, then mtp_coef_final from
  mtp_switch_at of the steps (DeepSeek-V3's 0.3 → 0.1)."""
  switch = int(train_cfg.mtp_switch_at * train_cfg.steps)
  schedule = (
    optax.piecewise_constant_schedule(
      train_cfg.mtp_coef, {switch: train_cfg.mtp_coef_final / train_cfg.mtp_coef}
    )
    if train_cfg.mtp_coef
    else optax.constant_schedule(0.0)
  )
  return schedule(step)


def _is_stochastic(cfg) -> bool:
  return max(cfg.dropout, cfg.embed_dropout, cfg.attention.dropout) > 0 or draws_noise(cfg)


def make_train_step(train_setup: TrainSetup):
  """`step(state, batch) -> (state, metrics)`, jitted, with the state donated.

  The objective is mean cross-entropy + train.z_loss_coef · the mean log² Z of the output
  (PaLM's z-loss) + balance_coef · the Switch loss (`balancing_objective`) + z_loss_coef · the
  mean of the MoE layers' router z-losses. With gradient accumulation the Switch loss uses
  the global batch's expert counts f (a forward pass over the micro-batches finds them first, one
  extra forward per step), so it and the update equal those of the whole batch at once.
  """
  parts = StepParts(train_setup)

  def step(state: TrainState, batch) -> tuple[TrainState, dict]:
    return parts.step(state, batch, train_setup.tx, train_setup.schedule)

  metrics_sharding = replicated(train_setup.mesh)
  return jax.jit(
    step,
    donate_argnums=0,
    in_shardings=(train_setup.shardings, batch_sharding(train_setup.mesh)),
    out_shardings=(train_setup.shardings, metrics_sharding),
  )


class StepParts:
  """The pieces `make_train_step`'s `step` is traced from, with the config's switches read once
  (the MoE settings, the number of micro-batches, whether the model draws random numbers)."""

  def __init__(self, train_setup: TrainSetup):
    cfg = train_setup.config
    self.train_setup = train_setup
    self.accum = cfg.train.grad_accum_steps
    self.moe = cfg.model.ffn.moe
    self.z_loss_coef = cfg.train.z_loss_coef
    self.has_moe = bool(moe_layers(cfg.model))
    self.mtp = cfg.model.multi_token_prediction
    self.stochastic = _is_stochastic(cfg.model)
    self.grad_fn = jax.value_and_grad(self.objective, has_aux=True)

  def step(self, state: TrainState, batch, tx, schedule) -> tuple[TrainState, dict]:
    """(the state after one update by the optimizer `tx`, the step's metrics); `schedule` gives
    the learning rate the metrics report."""
    params = state['params']
    key = jax.random.fold_in(jax.random.wrap_key_data(state['rng']), state['step'])
    n_tokens = jnp.maximum(batch['loss_mask'].sum(), 1.0)
    mtp = self.mtp_terms(batch, state['step'])
    if self.accum == 1:
      (_, (loss_sum, stats)), grads = self.grad_fn(
        params, batch, self.dropout_key(key), n_tokens, None, mtp
      )
    else:
      loss_sum, stats, grads = self.accumulated_grads(params, batch, key, n_tokens, mtp)
    grads = split_trained(grads)[0]
    new_state = self.updated_state(state, grads, stats, tx)
    rate = schedule(state['step'])
    return new_state, self.metrics(new_state, loss_sum, stats, grads, n_tokens, rate, mtp)

  def mtp_terms(self, batch, step):
    """(the MTP loss's weight at `step`, the whole batch's count of MTP targets), or None."""
    if not self.mtp:
      return None
    packed = self.train_setup.config.data.document_mask
    n_mtp = jnp.maximum(mtp_mask(batch, packed).sum(), 1.0)
    return mtp_weight(self.train_setup.config.train, step), n_mtp

  def dropout_key(self, key):
    """`key` where the model draws random numbers (dropout, router noise), else None."""
    return key if self.stochastic else None

  def objective(self, params, batch, key, n_tokens, counts_LE, mtp=None):
    """(this micro-batch's share of the objective, (its loss sum, its MoE stats)). Differentiated
    with respect to all saved variables (NNX's scan refuses variables traced at another level);
    the ExpertBias gradient is zero (it only selects) and is dropped."""
    moe, accum = self.moe, self.accum
    losses, stats = _forward(self.train_setup, params, batch, train=True, dropout_key=key)
    value = losses.sum() / n_tokens
    if self.z_loss_coef:
      value += self.z_loss_coef * stats['log_z_sq_sum'] / n_tokens
    if mtp is not None:
      weight, n_mtp = mtp
      value += weight * stats['mtp_loss_sum'] / n_mtp
    if self.has_moe:
      counts = stats['tokens_per_expert'] if counts_LE is None else counts_LE
      balance = balancing_objective(counts, stats['mean_prob'], moe.top_k, moe.balance_convention)
      value += (moe.balance_coef * balance + moe.z_loss_coef * jnp.mean(stats['z_loss'])) / accum
    return value, (losses.sum(), stats)

  def accumulated_grads(self, params, batch, key, n_tokens, mtp=None):
    """(loss sum, MoE stats, gradients) of the whole batch, summed by a scan over `accum`
    micro-batches."""
    accum = self.accum
    # Row r goes to micro-batch r % accum, so every micro-batch is spread over all devices.
    micro = jax.tree.map(
      lambda x: jnp.moveaxis(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 1, 0), batch
    )
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(accum))
    counts = None
    if self.has_moe and self.moe.balance_coef > 0:
      counts = self.expert_counts(params, micro, keys)

    def add(carry, inputs):
      total, variables = carry
      mb, k = inputs
      out = self.grad_fn(variables, mb, self.dropout_key(k), n_tokens, counts, mtp)
      return (jax.tree.map(jnp.add, total, out), variables), None

    zeros = _zeros(jax.eval_shape(self.grad_fn, params, _first(micro), None, n_tokens, counts, mtp))
    ((_, (loss_sum, stats)), grads), _ = jax.lax.scan(add, (zeros, params), (micro, keys))[0]
    # Summed over micro-batches: counts stay sums, the per-call means become means.
    stats = {name: v if name in _SUMMED else v / accum for name, v in stats.items()}
    return loss_sum, stats, grads

  def expert_counts(self, params, micro, keys):
    """The whole batch's tokens per expert [layers, experts]: a forward pass over the
    micro-batches, before the one that takes gradients, for the Switch loss's f."""
    train_setup = self.train_setup

    def count(carry, inputs):  # the variables ride in the carry: NNX merges them in-trace
      total, variables = carry
      mb, k = inputs
      stats = _forward(train_setup, variables, mb, train=True, dropout_key=self.dropout_key(k))[1]
      return (total + stats['tokens_per_expert'], variables), None

    shapes = jax.eval_shape(
      lambda p, mb: _forward(train_setup, p, mb, train=True)[1], params, _first(micro)
    )
    (counts, _), _ = jax.lax.scan(
      count, (_zeros(shapes['tokens_per_expert']), params), (micro, keys)
    )
    return counts

  def updated_state(self, state: TrainState, grads, stats, tx) -> TrainState:
    """The next state: the optimizer `tx`'s update of the trained parameters from their `grads`
    (and, with moe.expert_bias, the expert biases' update from this step's expert counts)."""
    trained, rest = split_trained(state['params'])
    updates, opt_state = tx.update(grads, state['opt_state'], trained)
    trained = optax.apply_updates(trained, updates)
    if self.has_moe and self.moe.expert_bias:
      rest = update_expert_biases(rest, stats['tokens_per_expert'], self.moe.bias_update_rate)
    return {
      'step': state['step'] + 1,
      'params': nnx.merge_state(trained, rest),
      'opt_state': opt_state,
      'rng': state['rng'],
    }

  def metrics(self, new_state, loss_sum, stats, grads, n_tokens, rate, mtp=None) -> dict:
    """The step's metrics: loss, gradient norm, learning rate, tokens, whether the new parameters
    are all finite, and the MoE routing metrics where the model has MoE layers."""
    # A finite loss can still come with an overflowing update; the loop must not save that state.
    finite = jnp.all(
      jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(new_state['params'])])
    )
    metrics = {
      'loss': loss_sum / n_tokens,
      'grad_norm': optax.tree_utils.tree_norm(grads),
      'learning_rate': rate,
      'tokens': n_tokens,
      'params_finite': finite,
      'log_z': stats['log_z_sum'] / n_tokens,  # the output's mean log Z (Wortsman et al. 2023)
    }
    if mtp is not None:  # the second-next-token loss, per MTP target (its weight aside)
      metrics['mtp_loss'] = stats['mtp_loss_sum'] / mtp[1]
    if self.has_moe:
      routing = {k: v for k, v in stats.items() if k not in _OUTPUT_STATS}
      metrics['moe'] = moe_metrics(routing, self.moe.top_k, self.moe.balance_convention)
    return metrics


# The output's statistics (the rest are the MoE layers'), and those that are sums over a batch's
# tokens (the rest are means per forward pass).
_OUTPUT_STATS = ('log_z_sum', 'log_z_sq_sum', 'mtp_loss_sum')
_SUMMED = ('tokens_per_expert', *_OUTPUT_STATS)


def _first(micro_batches):
  return jax.tree.map(lambda x: x[0], micro_batches)


def _zeros(shapes):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def make_eval_step(train_setup: ModelSetup, token_bytes: np.ndarray):
  """`eval(params, batch) -> {loss_sum, tokens, bytes, log_z_sum, max_attention_logit}`: sums
  (so batches and hosts add up) and the batch's largest attention logit (a maximum).

  bytes counts the UTF-8 bytes the target tokens stand for (bits per byte = nats / ln 2 / bytes);
  log_z_sum the output's log Z over the target tokens; max_attention_logit is q·kᵀ·scale's
  largest allowed value over every layer and head (Wortsman et al. 2023's attention-logit growth).
  """
  table = jnp.asarray(token_bytes, jnp.float32)

  def evaluate(params, batch):
    losses, stats = _forward(train_setup, params, batch, train=False, probe=True)
    mask = batch['loss_mask']
    return {
      'loss_sum': losses.sum(),
      'tokens': mask.sum(),
      'bytes': (table[batch['targets']] * mask).sum(),
      'log_z_sum': stats['log_z_sum'],
      'max_attention_logit': jnp.max(stats['max_attention_logit']),
    }

  return jax.jit(
    evaluate,
    in_shardings=(train_setup.param_shardings, batch_sharding(train_setup.mesh)),
    out_shardings=replicated(train_setup.mesh),
  )


def eval_summary(totals: dict) -> dict:
  """Mean loss, perplexity, bits per byte and mean log Z from summed eval outputs, and the
  largest attention logit (`make_eval_step`)."""
  tokens = max(totals['tokens'], 1.0)
  loss = totals['loss_sum'] / tokens
  return {
    'loss': loss,
    'perplexity': math.exp(min(loss, 700.0)),
    'bits_per_byte': totals['loss_sum'] / math.log(2) / max(totals['bytes'], 1.0),
    'tokens': totals['tokens'],
    'log_z': totals['log_z_sum'] / tokens,
    'max_attention_logit': totals['max_attention_logit'],
  }


def synthetic_batch(config, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
  """A random batch of the configured shape (benchmarks and smoke tests)."""
  rng = rng or np.random.default_rng(0)
  B, T = config.data.batch_size, config.data.seq_len
  tokens = rng.integers(0, config.model.vocab_size, (B, T + 1), dtype=np.int32)
  return {
    'inputs': tokens[:, :-1],
    'targets': tokens[:, 1:],
    'positions': np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
    'segment_ids': np.ones((B, T), np.int32),
    'loss_mask': np.ones((B, T), np.float32),
  }


def benchmark_step(config, mesh=None):
  """(step_fn, state, batch) for timing the training step of `config` on synthetic tokens."""
  from mllm.train.sharding import global_batch, make_mesh
  from mllm.train.state import setup

  mesh = mesh or make_mesh(config.mesh)
  train_setup, init = setup(config, mesh)
  return make_train_step(train_setup), init(), global_batch(synthetic_batch(config), mesh)
