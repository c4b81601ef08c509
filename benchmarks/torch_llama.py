"""A plain PyTorch Llama with the shapes and math of mllm's `configs/rope_swiglu.py` model.

The baseline of `benchmarks/train_step.py` and the independent model of
`benchmarks/ffn_replication.py` (which also trains its ReLU FFN, with packed documents: explicit
positions and a same-document mask); PyTorch is never a dependency of mllm itself.
Same as the JAX model: token embedding tied to the output head, pre-LN RMSNorm (ε inside the root,
statistics in float32), grouped-query attention with RoPE in the 'half' layout (HF Llama's
rotate_half), SwiGLU with mllm's hidden size (`mllm.layers.ffn.hidden_dim`), a final RMSNorm,
float32 throughout, no biases. Linear weights are stored [out, in] as usual in PyTorch, so every
tensor has the same number of elements as its JAX counterpart and the parameter counts agree.

Attention is `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, what HF
transformers' Llama uses by default ('sdpa'): PyTorch's own fused CPU kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.eps = eps
    self.scale = nn.Parameter(torch.ones(dim))

  def forward(self, x):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return (y * self.scale).to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float):
  """cos, sin [T, head_dim // 2] of m·θ_i, θ_i = theta^(−2i/d) (no scaling)."""
  inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
  angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
  return angles.cos().float(), angles.sin().float()


def rotate_half_layout(x, cos, sin):
  """x [B, heads, T, H]; rotates (x_i, x_{i+H/2}) by the angles ([T, H/2], or [B, 1, T, H/2] for
  per-sequence positions), like mllm's layout='half'."""
  x1, x2 = x.chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
  def __init__(
    self, d: int, n_heads: int, n_kv: int, head_dim: int, init_std: float, out_std: float
  ):
    super().__init__()
    self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
    self.query = nn.Linear(d, n_heads * head_dim, bias=False)
    self.key = nn.Linear(d, n_kv * head_dim, bias=False)
    self.value = nn.Linear(d, n_kv * head_dim, bias=False)
    self.out = nn.Linear(n_heads * head_dim, d, bias=False)
    for lin in (self.query, self.key, self.value):
      nn.init.normal_(lin.weight, std=init_std)
    nn.init.normal_(self.out.weight, std=out_std)

  def forward(self, x, cos, sin, mask=None):
    """mask: None (causal) or bool [B, 1, T, T], True where a query may attend."""
    B, T, _ = x.shape
    q = self.query(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
    k = self.key(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
    v = self.value(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
    q, k = rotate_half_layout(q, cos, sin), rotate_half_layout(k, cos, sin)
    o = F.scaled_dot_product_attention(
      q,
      k,
      v,
      attn_mask=mask,
      is_causal=mask is None,
      enable_gqa=self.n_kv != self.n_heads,
    )
    return self.out(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
  def __init__(self, d: int, d_ff: int, init_std: float, out_std: float):
    super().__init__()
    self.gate = nn.Linear(d, d_ff, bias=False)
    self.up = nn.Linear(d, d_ff, bias=False)
    self.down = nn.Linear(d_ff, d, bias=False)
    nn.init.normal_(self.gate.weight, std=init_std)
    nn.init.normal_(self.up.weight, std=init_std)
    nn.init.normal_(self.down.weight, std=out_std)

  def forward(self, x):
    return self.down(F.silu(self.gate(x)) * self.up(x))


class ReLU(nn.Module):
  """down(relu(up(x))) (Vaswani et al. 2017, eq. 2, without biases)."""

  def __init__(self, d: int, d_ff: int, init_std: float, out_std: float):
    super().__init__()
    self.up = nn.Linear(d, d_ff, bias=False)
    self.down = nn.Linear(d_ff, d, bias=False)
    nn.init.normal_(self.up.weight, std=init_std)
    nn.init.normal_(self.down.weight, std=out_std)

  def forward(self, x):
    return self.down(F.relu(self.up(x)))


FFNS = {'swiglu': SwiGLU, 'relu': ReLU}


class Block(nn.Module):
  def __init__(self, cfg, d_ff: int):
    super().__init__()
    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5 if cfg.depth_scaled_init else cfg.init_std
    self.attention_norm = RMSNorm(cfg.d_model, cfg.norm.eps)
    self.attention = Attention(
      cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim, cfg.init_std, out_std
    )
    self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm.eps)
    self.ffn = FFNS[cfg.ffn.kind](cfg.d_model, d_ff, cfg.init_std, out_std)

  def forward(self, x, cos, sin, mask=None):
    x = x + self.attention(self.attention_norm(x), cos, sin, mask)
    return x + self.ffn(self.ffn_norm(x))


class TorchLlama(nn.Module):
  """`model(tokens[B, T]) -> logits[B, T, vocab]` for an mllm model config (`config.model`, or
  any object with its attributes); `d_ff` given, mllm is not imported (a venv with torch alone)."""

  def __init__(self, cfg, d_ff: int | None = None):
    super().__init__()
    checks = {
      'position.kind': (cfg.position.kind, 'rope'),
      'position.rope.layout': (cfg.position.rope.layout, 'half'),
      'position.rope.scaling.kind': (cfg.position.rope.scaling.kind, 'none'),
      'ffn.kind': (cfg.ffn.kind, tuple(FFNS)),
      'norm.kind': (cfg.norm.kind, 'rmsnorm'),
      'norm.placement': (cfg.norm.placement, 'pre'),
      'tie_embeddings': (cfg.tie_embeddings, True),
      'dtype': (cfg.dtype, 'float32'),
    }
    for key, (got, want) in checks.items():
      if got not in (want if isinstance(want, tuple) else (want,)):
        raise ValueError(f'TorchLlama supports only {key}={want!r}, got {got!r}')
    self.head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    self.theta = cfg.position.rope.theta
    self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    nn.init.normal_(self.embed.weight, std=cfg.init_std)
    if d_ff is None:
      from mllm.layers.ffn import hidden_dim

      d_ff = hidden_dim(cfg.ffn, cfg.d_model)
    self.blocks = nn.ModuleList([Block(cfg, d_ff) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm.eps)
    self._rope = {}

  def rope(self, seq_len: int):
    if seq_len not in self._rope:
      self._rope[seq_len] = rope_cos_sin(seq_len, self.head_dim, self.theta)
    return self._rope[seq_len]

  def forward(self, tokens, positions=None, segment_ids=None):
    """positions, segment_ids [B, T] (packed documents, as mllm's data.document_mask): RoPE at
    each token's position in its document, and attention within a document (causal); without
    them one causal sequence at positions 0..T-1."""
    T = tokens.shape[1]
    cos, sin = self.rope(T if positions is None else int(positions.max()) + 1)
    mask = None
    if positions is not None:
      cos, sin = cos[positions][:, None], sin[positions][:, None]  # [B, 1, T, H/2]
    if segment_ids is not None:
      causal = torch.ones(T, T, dtype=torch.bool).tril()
      mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
      mask = mask[:, None]  # [B, 1, T, T]
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, cos, sin, mask)
    return F.linear(self.final_norm(x), self.embed.weight)  # tied head


def make_optimizer(
  model: nn.Module, learning_rate: float, b1: float, b2: float, eps: float, weight_decay: float
) -> torch.optim.AdamW:
  """AdamW with decoupled weight decay on the matrices only (not embeddings, not norm gains), as
  the benchmark's JAX step does."""
  decay, no_decay = [], []
  for name, p in model.named_parameters():
    (decay if p.ndim == 2 and not name.startswith('embed') else no_decay).append(p)
  return torch.optim.AdamW(
    [{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}],
    lr=learning_rate,
    betas=(b1, b2),
    eps=eps,
  )


def make_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float = 1.0):
  """step(inputs[B, T], targets[B, T]) -> loss: cross-entropy, backward, clip, AdamW update."""

  def step(inputs, targets):
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip:
      torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.detach()

  return step


def count_params(model: nn.Module) -> int:
  return sum(p.numel() for p in model.parameters())
