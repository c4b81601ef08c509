"""The MoE layer against float64 NumPy: routing, top-k, the balancing and z losses, both
dispatches, capacity drops, shared experts, gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mllm import ConfigError
from mllm.layers.ffn import FFNS
from mllm.layers.moe import MoE, moe_metrics, uniform_assignment, update_expert_biases
from mllm.layers.moe_experts import capacity
from mllm.layers.moe_routing import (
  ExpertBias,
  balancing_objective,
  load_balancing_loss,
  load_summary,
  mixture_noise,
  noisy_topk_logits,
  router_probs,
  top_k,
  update_expert_bias,
  z_loss,
)

ACTIVATIONS = {  # float64 NumPy versions of the experts' activations
  'swiglu': lambda x: x / (1 + np.exp(-x)),
  'relu': lambda x: np.maximum(x, 0),
  'geglu': lambda x: 0.5 * x * (1 + np.vectorize(__import__('math').erf)(x / np.sqrt(2))),
}


def make_moe(d=8, e=4, k=2, f=16, seed=0, **kwargs):
  return MoE(
    d,
    num_experts=e,
    top_k=k,
    expert_d_ff=f,
    init_std=0.3,
    out_std=0.3,
    rngs=nnx.Rngs(params=seed, dropout=seed + 1),
    **kwargs,
  )  # as build_model


def np_expert(x, gate, up, down, kind):
  act = ACTIVATIONS[kind]
  hidden = act(x @ up) if gate is None else act(x @ gate) * (x @ up)
  return hidden @ down


def np_moe(moe: MoE, x_TD, kind='swiglu', renormalize=True, router='softmax'):
  """Mixtral-style reference: softmax router, top-k, gates renormalised over the k; or
  DeepSeek-V3's sigmoid scores, whose gates are always normalised over the chosen k."""
  x = np.asarray(x_TD, np.float64)
  f64 = lambda w: None if w is None else np.asarray(w[...], np.float64)  # noqa: E731
  gate, up, down = f64(moe.experts.gate), f64(moe.experts.up), f64(moe.experts.down)
  logits = x @ f64(moe.router)
  if router == 'sigmoid':
    probs = 1 / (1 + np.exp(-logits))
    renormalize = True
  else:
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    chosen = np.argsort(-probs[t])[: moe.k]
    g = probs[t, chosen] / (probs[t, chosen].sum() if renormalize else 1.0)
    for weight, e in zip(g, chosen):
      y[t] += weight * np_expert(x[t], None if gate is None else gate[e], up[e], down[e], kind)
  if moe.shared is not None:
    s_gate, s_up, s_down = f64(moe.shared.gate), f64(moe.shared.up), f64(moe.shared.down)
    for j in range(s_up.shape[0]):
      y += np_expert(x, None if s_gate is None else s_gate[j], s_up[j], s_down[j], kind)
  return y


def _run(moe: MoE, x):
  return moe(x)


# Jitted: one compile of the layer costs less than compiling each of its ops eagerly.
run = nnx.jit(_run)  # (y, the layer's routing statistics)


def balance(moe: MoE, stats):
  return load_balancing_loss(stats['tokens_per_expert'], stats['mean_prob'], moe.k)


def switch_loss(probs_TE, experts_Tk, convention='switch'):
  """The balancing loss from a router's probabilities and choices."""
  counts = jnp.sum(jax.nn.one_hot(experts_Tk, probs_TE.shape[-1]), axis=(0, 1))
  return load_balancing_loss(counts, jnp.mean(probs_TE, 0), experts_Tk.shape[1], convention)


def out(moe: MoE, x):
  return run(moe, x)[0]


def tokens(t=24, d=8, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(1, t, d)), jnp.float32)


def test_router_probabilities_sum_to_one_and_top_k_picks_the_largest():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(32, 8)) * 3, jnp.float32)
  probs = router_probs(logits.astype(jnp.bfloat16))
  assert probs.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-6)
  for k in (1, 2, 4):
    gates, experts = top_k(probs, k, renormalize=False)
    expected = np.argsort(-np.asarray(probs), axis=-1)[:, :k]
    np.testing.assert_array_equal(np.asarray(experts), expected)
    np.testing.assert_allclose(gates, np.take_along_axis(np.asarray(probs), expected, -1))
    renormed, _ = top_k(probs, k, renormalize=True)
    np.testing.assert_allclose(np.asarray(renormed).sum(-1), 1.0, rtol=1e-6)
  # A selection bias moves the choice, not the gates.
  bias = jnp.zeros(8).at[5].set(10.0)
  gates, experts = top_k(probs, 1, renormalize=False, selection_bias_E=bias)
  assert (np.asarray(experts) == 5).all()
  np.testing.assert_allclose(gates[:, 0], probs[:, 5])


@pytest.mark.parametrize('k', [1, 2, 4])
def test_balancing_loss_is_one_at_uniform_routing_and_larger_when_skewed(k):
  e, t = 8, 64
  probs = jnp.full((t, e), 1.0 / e)
  uniform = (np.arange(t)[:, None] * k + np.arange(k)[None, :]) % e  # each expert T·k/E times
  assert np.bincount(uniform.ravel(), minlength=e).tolist() == [t * k // e] * e
  assert float(switch_loss(probs, jnp.asarray(uniform))) == pytest.approx(1.0, abs=1e-6)
  # transformers' convention normalises each choice slot separately: k at uniform routing.
  assert float(switch_loss(probs, jnp.asarray(uniform), 'hf')) == pytest.approx(k)
  skewed_probs = jnp.asarray(np.tile(np.eye(e)[0] * 0.9 + 0.1 / e, (t, 1)))
  skewed = np.tile(np.arange(k), (t, 1))  # every token to experts 0..k-1
  expected = e * sum((1 / k) * float(skewed_probs[0, i]) for i in range(k))  # E Σ f_i P_i
  got = float(switch_loss(skewed_probs, jnp.asarray(skewed)))
  assert got == pytest.approx(expected, rel=1e-6) and got > 1.0


def test_z_loss_against_its_formula():
  logits = np.random.default_rng(0).normal(size=(16, 6)) * 4
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  assert float(z_loss(jnp.asarray(logits, jnp.float32))) == pytest.approx(np.mean(lse**2), rel=1e-5)


@pytest.mark.parametrize('dispatch', ['capacity', 'dropless'])
@pytest.mark.parametrize('kind', ['swiglu', 'relu', 'geglu'])
def test_top2_layer_equals_a_float64_mixtral_reference(dispatch, kind):
  # capacity_factor = E: room for every assignment, so nothing is dropped.
  moe = make_moe(ffn_kind=kind, dispatch=dispatch, capacity_factor=4.0)
  x = tokens()
  y = out(moe, x)
  np.testing.assert_allclose(
    np.asarray(y[0], np.float64), np_moe(moe, x[0], kind), rtol=2e-5, atol=2e-5
  )


def test_one_expert_top1_equals_the_dense_ffn_with_its_weights():
  moe = make_moe(e=1, k=1)
  dense = FFNS['swiglu'](8, 16, use_bias=False, init_std=0.1, out_std=0.1, rngs=nnx.Rngs(3))
  dense.gate.kernel[...] = moe.experts.gate[0]
  dense.up.kernel[...] = moe.experts.up[0]
  dense.down.kernel[...] = moe.experts.down[0]
  x = tokens()
  np.testing.assert_allclose(out(moe, x), dense(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('renormalize', [False, True])
def test_a_top1_router_gets_the_losss_gradient_only_when_its_gate_is_the_probability(renormalize):
  """Switch (Fedus et al. 2022, eq. 2) gates the top-1 expert by p_i: the output, and so the loss,
  depends on the router. Renormalised over k = 1 the gate is p_i / p_i = 1 and that gradient is
  zero. JAX's gradient against central differences of the float64 NumPy layer."""
  moe = make_moe(k=1, renormalize=renormalize, dispatch='dropless')  # NumPy's layer never drops
  x = tokens()
  target = np.random.default_rng(5).normal(size=(24, 8))
  router = np.asarray(moe.router[...], np.float64)

  def np_loss(w):
    moe.router[...] = jnp.asarray(w, jnp.float32)  # np_moe reads the router in float64
    moe_f64 = np_moe(moe, x[0], renormalize=renormalize)
    return np.mean((moe_f64 - target) ** 2)

  def jax_loss(m):
    return jnp.mean((m(x)[0][0] - target) ** 2)

  # Jitted: taken eagerly, the gradient built ~100 single-operation programs.
  grad = np.asarray(nnx.jit(nnx.grad(jax_loss))(moe).router[...], np.float64)
  eps, numeric = 1e-4, np.zeros_like(router)
  for index in np.ndindex(router.shape):
    step = np.zeros_like(router)
    step[index] = eps
    numeric[index] = (np_loss(router + step) - np_loss(router - step)) / (2 * eps)
  if renormalize:
    assert np.max(np.abs(numeric)) == 0.0  # the gate is exactly 1 in float64 too
    assert np.max(np.abs(grad)) < 1e-7  # float32 rounding of p / p; gated by p it is ~1e-2
  else:
    assert np.max(np.abs(numeric)) > 1e-3
    np.testing.assert_allclose(grad, numeric, rtol=2e-2, atol=2e-5)


def test_top1_with_renormalised_gates_trains_with_a_note(tiny):
  from mllm.layers.moe import training_note

  top1 = tiny('ffn=moe', model__ffn__moe__top_k=1).model.ffn.moe
  assert 'no gradient' in training_note(top1)
  gated = tiny('ffn=moe', model__ffn__moe__top_k=1, model__ffn__moe__renormalize=False)
  assert training_note(gated.model.ffn.moe) is None
  assert training_note(tiny('ffn=moe').model.ffn.moe) is None  # top-2: the gates keep their ratio


def test_shared_experts_add_exactly_their_dense_output():
  with_shared = make_moe(num_shared_experts=2, shared_d_ff=12)
  routed_only = make_moe()
  routed_only.router[...] = with_shared.router[...]
  for name in ('gate', 'up', 'down'):
    getattr(routed_only.experts, name)[...] = getattr(with_shared.experts, name)[...]
  x = tokens()
  s = with_shared.shared
  shared_out = np.zeros((24, 8))
  for j in range(2):
    shared_out += np_expert(
      np.asarray(x[0], np.float64),
      np.asarray(s.gate[j], np.float64),
      np.asarray(s.up[j], np.float64),
      np.asarray(s.down[j], np.float64),
      'swiglu',
    )
  both, routed = out(with_shared, x)[0], out(routed_only, x)[0]
  np.testing.assert_allclose(
    np.asarray(both - routed, np.float64), shared_out, rtol=1e-4, atol=1e-5
  )
  np.testing.assert_allclose(
    np.asarray(both, np.float64), np_moe(with_shared, x[0]), rtol=2e-5, atol=2e-5
  )


def routed_moe(preferences, k, cap_factor):
  """A MoE whose router logits are `preferences` (×10): x[:, :E] carries them, W_r = 10·I."""
  t, e = preferences.shape
  moe = make_moe(d=e + 2, e=e, k=k, capacity_factor=cap_factor, renormalize=False)
  moe.router[...] = jnp.zeros((e + 2, e)).at[jnp.arange(e), jnp.arange(e)].set(10.0)
  x = np.zeros((1, t, e + 2), np.float32)
  x[0, :, :e] = preferences
  x[0, :, e:] = np.random.default_rng(0).normal(size=(t, 2))
  return moe, jnp.asarray(x)


def test_capacity_drops_match_a_hand_computed_case():
  # 4 tokens, 2 experts, top-1, capacity ceil(4/2 · 1 · 0.5) = 1: tokens 0, 1, 2 want expert 0,
  # token 3 expert 1. Expert 0 keeps token 0 (token order); tokens 1 and 2 get nothing.
  assert capacity(4, 2, 1, 0.5) == 1
  prefs = np.array([[1, 0], [1, 0], [1, 0], [0, 1]], np.float32)
  moe, x = routed_moe(prefs, k=1, cap_factor=0.5)
  y, stats = run(moe, x)
  y = np.asarray(y[0])
  full = np.asarray(out(make_moe_like(moe, 8.0), x)[0])
  # Outputs near 1e-5 differ in the last bits between the two dispatches' summation orders (more
  # on a GPU); a wrongly dropped or doubled token would differ by its whole value.
  np.testing.assert_allclose(y[[0, 3]], full[[0, 3]], rtol=1e-5, atol=1e-6)
  assert np.all(y[[1, 2]] == 0)
  assert float(stats['drop_rate']) == pytest.approx(0.5)
  np.testing.assert_array_equal(stats['tokens_per_expert'], [3, 1])  # routed, before the drop
  # Top-2, capacity ceil(2/2 · 2 · 0.5) = 1, both tokens prefer expert 0, then 1. First choices
  # fill first: token 0 takes expert 0's slot; second choices: token 0 takes expert 1's. Token 1
  # is dropped twice.
  assert capacity(2, 2, 2, 0.5) == 1
  moe, x = routed_moe(np.array([[1, 0.5], [1, 0.5]], np.float32), k=2, cap_factor=0.5)
  y, stats = run(moe, x)
  y = np.asarray(y[0])
  full = np.asarray(out(make_moe_like(moe, 8.0), x)[0])
  np.testing.assert_allclose(y[0], full[0], rtol=1e-6)
  assert np.all(y[1] == 0)
  assert float(stats['drop_rate']) == pytest.approx(0.5)


def make_moe_like(moe: MoE, capacity_factor: float) -> MoE:
  """The same weights with another capacity factor."""
  graphdef, state = nnx.split(moe)
  other = nnx.merge(graphdef, state)
  other.capacity_factor = capacity_factor
  return other


def test_dropless_equals_capacity_with_a_large_factor_and_gradients_reach_everything():
  x = tokens(t=32)
  moe = make_moe(e=8, k=2, num_shared_experts=1, capacity_factor=8.0)
  dropless = make_moe_like(moe, 8.0)
  dropless.dispatch = 'dropless'
  np.testing.assert_allclose(out(moe, x), out(dropless, x), rtol=1e-5, atol=1e-6)

  @nnx.jit
  @nnx.grad
  def grad(m):
    y, aux = _run(m, x)
    return jnp.sum(y**2) + balance(m, aux) + aux['z_loss']

  g_cap, g_drop = grad(moe), grad(dropless)
  for grads in (g_cap, g_drop):
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
      assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)
  for a, b in zip(jax.tree.leaves(g_cap), jax.tree.leaves(g_drop)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_sigmoid_router_gates_are_normalised_over_the_chosen_k():
  moe = make_moe(router='sigmoid', renormalize=False, dispatch='dropless')
  x = tokens()
  np.testing.assert_allclose(
    np.asarray(out(moe, x)[0], np.float64),
    np_moe(moe, x[0], router='sigmoid'),
    rtol=2e-5,
    atol=2e-5,
  )


def test_bfloat16_compute_keeps_the_router_in_float32():
  moe = make_moe(dtype=jnp.bfloat16)
  y, stats = run(moe, tokens().astype(jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  assert stats['mean_prob'].dtype == jnp.float32
  np.testing.assert_allclose(float(stats['mean_prob'].sum()), 1.0, rtol=1e-5)


def test_bad_layer_arguments_are_refused():
  with pytest.raises(ValueError, match='top_k=5'):
    make_moe(e=4, k=5)
  with pytest.raises(ValueError, match='router'):
    make_moe(router='relu')


# --- Noise, aux-loss-free balancing, load statistics -------------------------------------------


def test_mixture_noise_keeps_a_distribution_and_averages_to_uniform():
  probs = router_probs(jnp.asarray(np.random.default_rng(0).normal(size=(20000, 8)), jnp.float32))
  noisy = np.asarray(mixture_noise(probs, 0.2, jax.random.key(0)))
  p = np.asarray(probs)
  np.testing.assert_allclose(noisy.sum(-1), 1.0, rtol=1e-5)
  assert np.all(noisy >= 0.8 * p - 1e-7) and np.all(noisy <= 0.8 * p + 0.2 + 1e-7)
  # ε is uniform on the simplex (Dirichlet(1)): its mean is 1/E per expert.
  epsilon = (noisy - 0.8 * p) / 0.2
  np.testing.assert_allclose(epsilon.mean(0), 1 / 8, atol=3e-3)
  np.testing.assert_array_equal(mixture_noise(probs, 0.0, jax.random.key(1)), probs)


def test_noisy_topk_adds_standard_normal_noise_scaled_by_softplus():
  logits = jnp.zeros((50000, 4))
  for raw, scale in ((0.0, np.log(2.0)), (3.0, np.log1p(np.exp(3.0)))):
    noise = np.asarray(noisy_topk_logits(logits, jnp.full((50000, 4), raw), jax.random.key(0)))
    assert abs(noise.mean()) < 0.01 * scale and noise.std() == pytest.approx(scale, rel=0.01)
  quiet = noisy_topk_logits(logits + 1.0, jnp.full((50000, 4), -40.0), jax.random.key(0))
  np.testing.assert_allclose(quiet, 1.0, atol=1e-12)


@pytest.mark.parametrize('noise', ['mixture', 'noisy_topk'])
def test_noise_only_in_training_and_reproducible_from_its_seed(noise):
  x = tokens(t=64)
  moe = make_moe(noise=noise, noise_alpha=0.5)
  clean = make_moe()
  clean.router[...] = moe.router[...]
  for name in ('gate', 'up', 'down'):
    getattr(clean.experts, name)[...] = getattr(moe.experts, name)[...]
  moe.eval()
  clean.eval()  # both infer (dropless): the same computation but for the noise
  np.testing.assert_allclose(out(moe, x), out(clean, x), rtol=1e-6)
  moe.train()
  nnx.reseed(moe, dropout=7)
  first = out(moe, x)
  nnx.reseed(moe, dropout=7)  # what a resumed training step does from (seed, step)
  np.testing.assert_array_equal(out(moe, x), first)
  nnx.reseed(moe, dropout=8)
  assert not np.allclose(out(moe, x), first)


def test_expert_bias_moves_toward_balance_and_gets_no_gradient():
  # A router that sends every token to expert 0 first: a large logit bias through x's last dim.
  e, t = 4, 256
  moe = make_moe(d=8, e=e, k=1, expert_bias=True, dispatch='dropless')
  router = np.zeros((8, e), np.float32)
  router[:4, :] = np.random.default_rng(0).normal(size=(4, e))
  router[7, 0] = 4.0
  moe.router[...] = jnp.asarray(router)
  x = np.random.default_rng(1).normal(size=(1, t, 8)).astype(np.float32)
  x[..., 7] = 1.0
  x = jnp.asarray(x)
  cv = []
  for _ in range(60):
    _, stats = run(moe, x)
    cv.append(float(load_summary(stats['tokens_per_expert'])['load_cv']))
    moe.expert_bias[...] = update_expert_bias(
      moe.expert_bias[...], stats['tokens_per_expert'], 0.01
    )
  assert cv[0] > 1.0 and max(cv[-10:]) < 0.3, cv
  bias = moe.expert_bias
  assert float(bias[0]) < 0 < float(bias[1:].min())  # the favourite pushed down
  # Not a parameter: the optimizer's view (nnx.Param) holds no bias, and no gradient reaches it.
  assert 'expert_bias' not in nnx.state(moe, nnx.Param)

  @nnx.jit
  @nnx.grad(argnums=nnx.DiffState(0, ExpertBias))
  def grad(m):
    y, aux = _run(m, x)
    return jnp.sum(y**2) + balance(m, aux)

  np.testing.assert_array_equal(grad(moe)['expert_bias'][...], 0.0)


def test_load_summary_and_router_entropy_against_numpy():
  counts = np.array([10.0, 0.0, 30.0, 20.0])
  got = load_summary(jnp.asarray(counts))
  assert float(got['load_cv']) == pytest.approx(counts.std() / counts.mean(), rel=1e-6)
  assert float(got['load_max_over_mean']) == pytest.approx(30 / 15)
  assert float(got['dead_experts']) == pytest.approx(0.25)
  even = load_summary(jnp.full((8,), 5.0))
  assert float(even['load_cv']) == 0.0 and float(even['load_max_over_mean']) == 1.0
  moe = make_moe()
  x = tokens()
  _, stats = run(moe, x)
  logits = np.asarray(x[0], np.float64) @ np.asarray(moe.router[...], np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  assert float(stats['router_entropy']) == pytest.approx(
    np.mean(-(p * np.log(p)).sum(-1)), rel=1e-5
  )


def test_forced_uniform_routing_balances_every_expert_exactly():
  for t, k, e in ((64, 2, 8), (48, 1, 4), (30, 4, 16)):
    experts = np.asarray(uniform_assignment(t, k, e))
    counts = np.bincount(experts.ravel(), minlength=e)
    assert counts.max() - counts.min() <= 1 and counts.sum() == t * k
    assert all(len(set(row)) == k for row in experts)  # k distinct experts per token
  moe = make_moe(e=4, k=2, force_uniform_routing=True, capacity_factor=1.0)
  _, stats = run(moe, tokens(t=32))
  np.testing.assert_array_equal(stats['tokens_per_expert'], [16, 16, 16, 16])
  assert float(stats['drop_rate']) == 0.0  # exactly full at capacity factor 1


def test_stacked_metrics_and_the_per_layer_bias_update():
  counts = jnp.asarray([[6.0, 6.0, 6.0, 6.0], [10.0, 2.0, 2.0, 2.0]])  # two layers, top-1
  probs = jnp.asarray([[0.25] * 4, [0.7, 0.1, 0.1, 0.1]])
  metrics = moe_metrics(
    {'tokens_per_expert': counts, 'mean_prob': probs, 'z_loss': jnp.zeros(2)}, 1, 'switch'
  )
  np.testing.assert_allclose(
    metrics['balance_loss'], [1.0, 4 * (10 * 0.7 + 3 * 2 * 0.1) / 16], rtol=1e-6
  )
  np.testing.assert_allclose(metrics['load_max_over_mean'], [1.0, 2.5], rtol=1e-6)
  # Each layer's ExpertBias moves by its own row of counts; other variables stay as they are.
  variables = nnx.State(
    {
      'blocks': {
        1: {'ffn': {'expert_bias': ExpertBias(jnp.zeros(4))}},
        3: {'ffn': {'expert_bias': ExpertBias(jnp.zeros(4)), 'other': nnx.Param(jnp.ones(2))}},
      }
    }
  )
  new = update_expert_biases(variables, counts, 0.5)
  np.testing.assert_array_equal(new['blocks'][1]['ffn']['expert_bias'][...], [0, 0, 0, 0])
  np.testing.assert_array_equal(new['blocks'][3]['ffn']['expert_bias'][...], [-0.5, 0.5, 0.5, 0.5])
  np.testing.assert_array_equal(new['blocks'][3]['ffn']['other'][...], [1, 1])
  stacked = nnx.State({'blocks': {'ffn': {'expert_bias': ExpertBias(jnp.zeros((2, 4)))}}})
  np.testing.assert_array_equal(
    update_expert_biases(stacked, counts, 0.5)['blocks']['ffn']['expert_bias'][...],
    [[0, 0, 0, 0], [-0.5, 0.5, 0.5, 0.5]],
  )


def test_megablox_gmm_in_interpret_mode_equals_ragged_dot_with_gradients():
  """The TPU grouped-matmul kernel (Pallas interpret mode on CPU) and ragged_dot, on uneven
  groups with an empty one and a row count that is not a whole tile (padded, then cut)."""
  from mllm.layers.moe_experts import grouped_matmul

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(150, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 16, 24)), jnp.float32)
  sizes = jnp.asarray([70, 0, 50, 30], jnp.int32)
  np.testing.assert_allclose(
    grouped_matmul(x, w, sizes, 'megablox'),
    grouped_matmul(x, w, sizes, 'ragged_dot'),
    rtol=1e-5,
    atol=1e-4,
  )
  grads = [  # jitted: op by op, the interpreted kernel's every step would be a program
    jax.jit(
      jax.grad(lambda a, b: jnp.sum(jnp.sin(grouped_matmul(a, b, sizes, impl))), argnums=(0, 1))  # noqa: B023 (runs within this iteration)
    )(x, w)
    for impl in ('ragged_dot', 'megablox')
  ]
  for a, b in zip(*grads):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
  moe = make_moe(dispatch='dropless')
  other = make_moe_like(moe, 1.25)
  other.grouped_matmul = 'megablox'
  np.testing.assert_allclose(out(other, tokens()), out(moe, tokens()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  'sizes,tile',
  [([70, 0, 50, 30], 32), ([150, 0, 0, 0], 128), ([1, 2, 3, 144], 16), ([40, 40, 40, 30], 7)],
)
def test_the_tiled_grouped_matmul_equals_ragged_dot_with_gradients(sizes, tile):
  """MegaBlocks-style tiles (each group padded to whole tiles) against ragged_dot: uneven and
  empty groups, one group holding every row, a tile that divides nothing, a tile over the rows."""
  from mllm.layers.moe_experts import grouped_matmul, tiled_grouped_matmul

  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(150, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 16, 24)), jnp.float32)
  sizes = jnp.asarray(sizes, jnp.int32)
  np.testing.assert_allclose(
    tiled_grouped_matmul(x, w, sizes, tile),
    grouped_matmul(x, w, sizes, 'ragged_dot'),
    rtol=1e-5,
    atol=1e-5,
  )
  grads = [
    jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), argnums=(0, 1)))(x, w)  # noqa: B023 (runs within this iteration)
    for f in (
      lambda a, b: grouped_matmul(a, b, sizes, 'ragged_dot'),
      lambda a, b: tiled_grouped_matmul(a, b, sizes, tile),
    )
  ]
  for a, b in zip(*grads):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_a_capacity_layer_infers_without_a_kernel_that_would_only_interpret_or_expand(monkeypatch):
  """grouped_matmul names the dropless path's kernel. A capacity layer reaches that path only at
  inference: on a CPU, where ragged_dot expands to E× the FLOPs, it takes the tiled matmul; on a
  GPU, where gmm would only interpret (slowly), ragged_dot. An explicit dropless layer keeps its
  kernel (megablox: the tests' interpret mode). The outputs are the same."""
  from mllm.layers import moe_experts as moe_module

  called, real = [], moe_module.grouped_matmul
  monkeypatch.setattr(
    moe_module, 'grouped_matmul', lambda *args: called.append(args[-1]) or real(*args)
  )
  capacity_layer = make_moe(dispatch='capacity', grouped_matmul='megablox')
  dropless_layer = make_moe(dispatch='dropless', grouped_matmul='megablox')
  capacity_layer.eval()
  monkeypatch.setattr(moe_module.on_mesh, 'backend', lambda: 'cpu')  # the choice, on any machine
  on_cpu = capacity_layer(tokens())[0]
  assert set(called) == {'tiled'}
  called.clear()
  monkeypatch.setattr(moe_module.on_mesh, 'backend', lambda: 'gpu')
  on_gpu = capacity_layer(tokens())[0]
  assert set(called) == {'ragged_dot'}
  np.testing.assert_allclose(on_cpu, on_gpu, rtol=1e-5, atol=1e-6)
  monkeypatch.undo()
  monkeypatch.setattr(
    moe_module, 'grouped_matmul', lambda *args: called.append(args[-1]) or real(*args)
  )
  called.clear()
  dropless_layer(tokens())
  assert set(called) == {'megablox'}


def np_transformers_balancing_loss(gate_logits_per_layer, num_experts, k):
  """transformers' `load_balancing_loss_func` (Mixtral, no attention mask), in float64 NumPy:
  the layers' logits concatenated, top-k of the softmax, E · Σ mean(one-hot) · mean(probs)."""
  logits = np.concatenate(gate_logits_per_layer, axis=0)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  chosen = np.argsort(-probs, axis=-1)[:, :k]
  mask = np.eye(num_experts)[chosen]  # [L·T, k, E]
  return num_experts * np.sum(mask.mean(0) * probs.mean(0)[None, :])


def test_hf_convention_equals_transformers_pooled_loss_and_switch_averages_layers():
  rng = np.random.default_rng(0)
  e, k, t = 6, 2, 40
  layers = [rng.normal(size=(t, e)) * s for s in (0.5, 3.0)]  # a balanced and a skewed layer
  counts, means, per_layer = [], [], []
  for logits in layers:
    probs = router_probs(jnp.asarray(logits, jnp.float32))
    _, experts = top_k(probs, k, renormalize=True)
    counts.append(jnp.sum(jax.nn.one_hot(experts, e), axis=(0, 1)))
    means.append(jnp.mean(probs, 0))
    per_layer.append(float(switch_loss(probs, experts)))
  counts, means = jnp.stack(counts), jnp.stack(means)
  assert float(balancing_objective(counts, means, k, 'hf')) == pytest.approx(
    np_transformers_balancing_loss(layers, e, k), rel=1e-5
  )
  assert float(balancing_objective(counts, means, k, 'switch')) == pytest.approx(
    np.mean(per_layer), rel=1e-6
  )


def test_group_limited_routing_and_scaled_gates_match_deepseek_v3_in_float64():
  """DeepSeek-V3's routing as its code computes it (and transformers' DeepseekV3TopkRouter), in
  float64 NumPy: sigmoid scores plus the selection bias; 8 experts in 4 groups, each scored by
  the sum of its two best; the 2 best groups kept; the top 2 of their experts; the gates their
  unbiased scores, normalised over the 2, × 2.5."""
  rng = np.random.default_rng(0)
  T, E, G, kept = 64, 8, 4, 2
  logits = rng.standard_normal((T, E)) * 2.0
  bias = rng.standard_normal(E) * 0.3
  scores = 1.0 / (1.0 + np.exp(-logits))
  biased = scores + bias
  group_score = np.sort(biased.reshape(T, G, E // G), axis=-1)[..., -2:].sum(-1)
  best_groups = np.argsort(-group_score, axis=-1)[:, :kept]
  allowed = np.zeros((T, E), bool)
  for t in range(T):
    for g in best_groups[t]:
      allowed[t, g * (E // G) : (g + 1) * (E // G)] = True
  want_experts = np.argsort(-np.where(allowed, biased, -np.inf), axis=-1)[:, :2]
  chosen = np.take_along_axis(scores, want_experts, -1)
  want_gates = chosen / chosen.sum(-1, keepdims=True) * 2.5

  gates, experts = top_k(
    router_probs(jnp.asarray(logits, jnp.float32), 'sigmoid'),
    2,
    renormalize=True,
    selection_bias_E=jnp.asarray(bias, jnp.float32),
    groups=G,
    top_groups=kept,
  )
  np.testing.assert_array_equal(np.asarray(experts), want_experts)
  # Some token's best two experts overall lie in a group the limit closes (else the test is moot).
  unlimited = np.argsort(-biased, axis=-1)[:, :2]
  assert (np.sort(unlimited, -1) != np.sort(want_experts, -1)).any()
  np.testing.assert_allclose(np.asarray(gates) * 2.5, want_gates, rtol=1e-5)
  # The layer scales its routed gates: its output is 2.5 times the unscaled one's.
  layer = make_moe(
    e=E, router='sigmoid', dispatch='dropless', routed_scale=2.5, groups=G, top_groups=kept
  )
  x = tokens()
  y_scaled = np.asarray(out(layer, x)[0], np.float64)
  layer.routed_scale = 1.0
  np.testing.assert_allclose(y_scaled, 2.5 * np.asarray(out(layer, x)[0], np.float64), rtol=1e-5)


@pytest.mark.parametrize(
  'keys,message',
  [
    ({'model.ffn.moe.groups': 3}, r'model.ffn.moe.groups=3: .*allowed: a divisor of 4 up to 2'),
    ({'model.ffn.moe.groups': 2, 'model.ffn.moe.top_groups': 3}, r'model.ffn.moe.top_groups=3'),
    # One group of 2 experts cannot hold top_k = 4.
    (
      {'model.ffn.moe.groups': 2, 'model.ffn.moe.top_groups': 1, 'model.ffn.moe.top_k': 4},
      r'model.ffn.moe.top_groups=1',
    ),
  ],
)
def test_group_limits_that_cannot_hold_are_refused_in_one_line(keys, message, tiny):
  keys = {'model.ffn.kind': 'moe', 'model.ffn.moe.num_experts': 4, **keys}
  with pytest.raises(ConfigError, match=message) as err:
    tiny(**{k.replace('.', '__'): v for k, v in keys.items()})
  assert '\n' not in str(err.value)


@pytest.mark.parametrize('dispatch', ['capacity', 'dropless'])
def test_a_gpt_oss_layer_with_biases_equals_its_float64_reference(dispatch):
  """gpt-oss's MoE (transformers' GptOssMLP): router logits x·W + b, the top k of them, a softmax
  over those k (the softmax over all experts renormalised over the k), experts with biases on
  gate, up and down and the clamped SwiGLU; a shared expert with biases beside them. Every bias
  random, and the pre-activations large enough that the clamps act."""
  from test_ffn import np_clamped_swiglu

  moe = make_moe(
    ffn_kind='clamped_swiglu',
    dispatch=dispatch,
    capacity_factor=4.0,
    router_bias=True,
    use_bias=True,
    num_shared_experts=1,
  )
  rng = np.random.default_rng(3)
  for part in (moe.experts, moe.shared):
    for name in ('gate_bias', 'up_bias', 'down_bias'):
      getattr(part, name)[...] = jnp.asarray(
        rng.normal(size=getattr(part, name).shape), jnp.float32
      )
  moe.router_bias[...] = jnp.asarray(rng.normal(size=4), jnp.float32)
  x = tokens() * 6.0
  f64 = lambda w: np.asarray(w[...], np.float64)  # noqa: E731
  xs = np.asarray(x[0], np.float64)

  def expert(part, e, rows):
    g = rows @ f64(part.gate)[e] + f64(part.gate_bias)[e]
    u = rows @ f64(part.up)[e] + f64(part.up_bias)[e]
    return np_clamped_swiglu(g, u) @ f64(part.down)[e] + f64(part.down_bias)[e]

  logits = xs @ f64(moe.router) + f64(moe.router_bias)
  want = expert(moe.shared, 0, xs)
  for t in range(xs.shape[0]):
    top = np.argsort(-logits[t])[:2]
    weights = np.exp(logits[t, top] - logits[t, top].max())
    for w, e in zip(weights / weights.sum(), top):
      want[t] += w * expert(moe.experts, e, xs[t])
  pre = xs @ f64(moe.experts.up)[0] + f64(moe.experts.up_bias)[0]
  assert np.abs(pre).max() > 7.0  # the clamp acts somewhere
  np.testing.assert_allclose(np.asarray(out(moe, x)[0], np.float64), want, rtol=1e-4, atol=1e-4)
