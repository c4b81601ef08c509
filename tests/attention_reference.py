"""Float64 NumPy attention with its analytic backward: the reference every implementation meets.

Forward (Vaswani et al. 2017, eq. 1): S = q·kᵀ·scale + bias, masked; P = softmax(S); O = P·v.
With a soft cap c (Gemma 2): S = c·tanh(q·kᵀ·scale / c) + bias.
Backward (Dao et al. 2022, App. B.2): dV = Pᵀ·dO, dP = dO·vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)),
d_bias = dS, dX = dS ∘ (1 − tanh²(X / c)) (dS without a cap), dQ = dX·k·scale,
dK = dXᵀ·q·scale. Grouped heads share K/V, so dK and dV sum over the G query heads of a group.
A query with no allowed key outputs 0 and passes no gradient.
"""

from __future__ import annotations

import numpy as np


def allowed_mask(B, T, S, *, causal=True, window=None, q_seg=None, kv_seg=None, q_offset=None):
  """Boolean [B, T, S]: may query t (at key index q_offset + t) attend key j."""
  offset = S - T if q_offset is None else q_offset
  d = (offset + np.arange(T))[:, None] - np.arange(S)[None, :]  # i − j
  ok = np.broadcast_to(_visible(d, causal, window), (B, T, S)).copy()
  if q_seg is not None:
    ok &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
  return ok


def alibi_bias(slopes, q_pos, kv_pos):
  """[B, N, T, S]: m_h · (pos_k − pos_q) (Press et al. 2022, sec. 3)."""
  rel = np.asarray(kv_pos, np.float64)[:, None, :] - np.asarray(q_pos, np.float64)[:, :, None]
  return np.asarray(slopes, np.float64)[None, :, None, None] * rel[:, None]


def positions_mask(q_pos, kv_pos, *, causal=True, window=None):
  """Boolean [B, T, S] for a mask ordered by positions (a KV cache): d = pos_q − pos_k obeys the
  same rules as i − j above, and a key at a negative position is an empty slot."""
  d = np.asarray(q_pos)[:, :, None] - np.asarray(kv_pos)[:, None, :]
  return _visible(d, causal, window) & (np.asarray(kv_pos) >= 0)[:, None, :]


def _visible(d, causal, window):
  """May a query see a key d = i − j places before it: causal needs d >= 0, a window d < W
  (and d > −W when not causal)."""
  ok = np.ones(np.shape(d), bool)
  if causal:
    ok &= d >= 0
  if window is not None:
    ok &= d < window
    if not causal:
      ok &= d > -window
  return ok


def attention_with_grads(
  q,
  k,
  v,
  d_out=None,
  *,
  scale=None,
  bias=None,
  softcap=None,
  sinks=None,
  allowed=None,
  **mask_kwargs,
):
  """out [B, T, N, H_v] and, given d_out, (dq, dk, dv, d_bias [B, N, T, S]), with `sinks` [N] also
  d_sinks [N]; all float64. `allowed` [B, T, S], if given, replaces the mask built from
  `mask_kwargs`. A sink s_n adds exp(s_n) to head n's normalizer and no value, so
  d s_n = −Σ_{b,t} P_sink · rowsum(dO ∘ O)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  scale = H**-0.5 if scale is None else scale
  k_n = np.repeat(k, G, axis=2)  # query head n reads KV head n // G
  v_n = np.repeat(v, G, axis=2)
  ok = (allowed_mask(B, T, S, **mask_kwargs) if allowed is None else np.asarray(allowed))[:, None]
  x = np.einsum('btnh,bsnh->bnts', q, k_n) * scale
  logits = x if softcap is None else softcap * np.tanh(x / softcap)
  if bias is not None:
    logits = logits + np.broadcast_to(np.asarray(bias, np.float64), logits.shape)
  logits = np.where(ok, logits, -np.inf)
  peak = np.max(logits, axis=-1, keepdims=True)
  sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
  if sink is not None:
    peak = np.maximum(peak, sink)
  peak = np.where(np.isfinite(peak), peak, 0.0)
  p = np.exp(logits - peak)
  total = p.sum(-1, keepdims=True)
  if sink is not None:
    total = total + np.exp(sink - peak)
  p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
  out = np.einsum('bnts,bsnh->btnh', p, v_n)
  if d_out is None:
    return out
  d_out = np.asarray(d_out, np.float64)
  dv_n = np.einsum('bnts,btnh->bsnh', p, d_out)
  dp = np.einsum('btnh,bsnh->bnts', d_out, v_n)
  delta = np.einsum('btnh,btnh->bnt', d_out, out)[..., None]
  ds = p * (dp - delta)
  dx = ds if softcap is None else ds * (1.0 - np.tanh(x / softcap) ** 2)
  dq = np.einsum('bnts,bsnh->btnh', dx, k_n) * scale
  dk_n = np.einsum('bnts,btnh->bsnh', dx, q) * scale
  dk = dk_n.reshape(B, S, K, G, H).sum(3)
  dv = dv_n.reshape(B, S, K, G, v.shape[-1]).sum(3)  # v's head size may differ (MLA)
  if sink is None:
    return out, (dq, dk, dv, ds)
  p_sink = np.exp(sink - peak) / total  # [B, N, T, 1]
  return out, (dq, dk, dv, ds, -(p_sink * delta).sum(axis=(0, 2, 3)))


def relative_error(got, want) -> float:
  """‖got − want‖ / ‖want‖ in float64 (Frobenius)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def rope_half(x, theta=10000.0, rotated=None):
  """RoPE of x [N, T, H] at positions 0..T−1, 'half' layout (x_i paired with x_{i+r/2}), on the
  first `rotated` dims (default all; the rest pass through), frequencies θ^(−2i/rotated)."""
  r = x.shape[-1] if rotated is None else rotated
  angles = np.arange(x.shape[1])[:, None] * theta ** (-np.arange(0, r, 2) / r)  # [T, r/2]
  cos, sin = np.cos(angles), np.sin(angles)
  x1, x2 = x[..., : r // 2], x[..., r // 2 : r]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]], axis=-1)


def causal_layer_attention(x, weights, gate=None, window=None, rope=False, value_residual=None):
  """An attention layer in float64: x [T, D], weights {'query': [D, N, H], 'key', 'value':
  [D, K, H] (query head n reads key head n // (N / K)), 'out': [N, H, D]}; causal (and with a
  `window`, the `window` most recent keys), scale 1/√H; `rope`: q and k rotated (`rope_half`).
  `gate`: an output gate's kernel, [D, N] (one σ per head) or [D, N, H] (per dimension),
  multiplying each head's output before the projection (Qiu et al. 2025). `value_residual`:
  (the first layer's values [K, T, H], (λ₁, λ₂)): v = λ₁·v + λ₂·v_first (ResFormer)."""
  q, k, v = (np.einsum('td,dnh->nth', x, weights[name]) for name in ('query', 'key', 'value'))
  if value_residual is not None:
    first, (l1, l2) = value_residual
    v = l1 * v + l2 * first
  if rope:
    q, k = rope_half(q), rope_half(k)
  k, v = (np.repeat(t, q.shape[0] // t.shape[0], axis=0) for t in (k, v))
  scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
  T = x.shape[0]
  allowed = np.tril(np.ones((T, T), bool))
  if window is not None:
    allowed &= np.triu(np.ones((T, T), bool), -(window - 1))
  scores = np.where(allowed, scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  heads = (p / p.sum(-1, keepdims=True)) @ v  # [N, T, H]
  if gate is not None:
    g = 1.0 / (1.0 + np.exp(-np.einsum('td,d...->t...', x, gate)))  # [T, N] or [T, N, H]
    heads = heads * (g.T[..., None] if g.ndim == 2 else g.transpose(1, 0, 2))
  return np.einsum('nth,nhd->td', heads, weights['out'])
