"""Hugging Face tensor names ↔ mllm parameters: one list of links per family, read both ways.

A `Link` ties some HF tensors to some mllm parameters with a map each way, so import and export
are the same table and a round trip is exact by construction (transposes and reshapes only):
  - PyTorch Linear weights are [out, in]; mllm's kernels are [in, ..., out] with the heads split
    out: [D, N, H] for q/k/v, [N, H, D] for the output projection.
  - GPT-2's Conv1D weights are already [in, out]; its q, k and v are one fused c_attn tensor.
  - Mixtral and Qwen3-MoE store each expert's FFN separately; mllm stacks them [E, D, F]; gpt-oss
    stacks them too, gate and up interleaved in one tensor.
mllm parameters are named by their path in `nnx.to_pure_dict`, '/'-joined ('blocks/0/ffn/up/kernel').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from mllm.layers import resolved_head_dim
from mllm.layers.mla import MLADims
from mllm.layers.moe import moe_layers


@dataclasses.dataclass(frozen=True)
class Link:
  hf: tuple[str, ...]
  mllm: tuple[str, ...]
  to_mllm: Callable[..., tuple[np.ndarray, ...]]
  to_hf: Callable[..., tuple[np.ndarray, ...]]


def _one(hf: str, mllm: str, to_mllm, to_hf) -> Link:
  return Link((hf,), (mllm,), lambda w: (to_mllm(w),), lambda p: (to_hf(p),))


def same(hf: str, mllm: str) -> Link:
  return _one(hf, mllm, lambda w: w, lambda p: p)


def transposed(hf: str, mllm: str) -> Link:
  """A Linear [out, in] ↔ a kernel [in, out]."""
  return _one(hf, mllm, lambda w: w.T, lambda p: p.T)


def heads_in(hf: str, mllm: str, heads: int, head_dim: int) -> Link:
  """A q/k/v Linear [heads·head_dim, D] ↔ a kernel [D, heads, head_dim]."""
  return _one(
    hf,
    mllm,
    lambda w: w.T.reshape(w.shape[1], heads, head_dim),
    lambda p: p.reshape(p.shape[0], heads * head_dim).T,
  )


def heads_out(hf: str, mllm: str, heads: int, head_dim: int) -> Link:
  """The output Linear [D, heads·head_dim] ↔ a kernel [heads, head_dim, D]."""
  return _one(
    hf,
    mllm,
    lambda w: w.T.reshape(heads, head_dim, w.shape[0]),
    lambda p: p.reshape(heads * head_dim, p.shape[-1]).T,
  )


def head_bias(hf: str, mllm: str, heads: int, head_dim: int) -> Link:
  return _one(hf, mllm, lambda b: b.reshape(heads, head_dim), lambda p: p.reshape(-1))


def experts(hf: list[str], mllm: str) -> Link:
  """One Linear per expert ([out, in] each) ↔ a stacked kernel [E, in, out]."""
  return Link(
    tuple(hf), (mllm,), lambda *ws: (np.stack([w.T for w in ws]),), lambda p: tuple(e.T for e in p)
  )


def interleaved_pair(hf: str, mllm: tuple[str, str]) -> Link:
  """gpt-oss's gate_up_proj [E, D, 2F] (bias [E, 2F]), gate and up alternating on the last axis
  ↔ gate and up [E, D, F] ([E, F])."""

  def to_hf(gate, up):
    return (np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1]),)

  return Link((hf,), mllm, lambda w: (w[..., 0::2], w[..., 1::2]), to_hf)


def fused_qkv(hf: str, mllm: tuple[str, str, str], heads: int, head_dim: int) -> Link:
  """GPT-2's c_attn, Conv1D [D, 3·N·H] (bias [3·N·H]) ↔ query, key, value [D, N, H] ([N, H]):
  the same split on the last axis for the weight and the bias."""
  shape = (heads, head_dim)

  def to_mllm(w):
    return tuple(part.reshape(*part.shape[:-1], *shape) for part in np.split(w, 3, axis=-1))

  def to_hf(*parts):
    return (np.concatenate([p.reshape(*p.shape[:-2], heads * head_dim) for p in parts], -1),)

  return Link((hf,), mllm, to_mllm, to_hf)


# --- The families ------------------------------------------------------------------------------


def _attention_links(c, p: str, m: str) -> list[Link]:
  """Llama-style self_attn (q/k/v/o_proj; biases; Qwen3's q_norm/k_norm)."""
  n, k, h = c.n_heads, c.n_kv_heads, resolved_head_dim(c)
  links = [
    heads_in(f'{p}q_proj.weight', f'{m}query/kernel', n, h),
    heads_in(f'{p}k_proj.weight', f'{m}key/kernel', k, h),
    heads_in(f'{p}v_proj.weight', f'{m}value/kernel', k, h),
    heads_out(f'{p}o_proj.weight', f'{m}out/kernel', n, h),
  ]
  if c.attention.use_bias or c.attention.qkv_bias:
    links += [
      head_bias(f'{p}{x}_proj.bias', f'{m}{name}/bias', heads, h)
      for x, name, heads in (('q', 'query', n), ('k', 'key', k), ('v', 'value', k))
    ]
  if c.attention.use_bias:
    links.append(same(f'{p}o_proj.bias', f'{m}out/bias'))
  if c.attention.qk_norm:
    links += [
      same(f'{p}q_norm.weight', f'{m}query_norm/scale'),
      same(f'{p}k_norm.weight', f'{m}key_norm/scale'),
    ]
  if c.attention.sinks:  # gpt-oss
    links.append(same(f'{p}sinks', f'{m}sinks'))
  return links


def _mla_links(c, p: str, m: str) -> list[Link]:
  """DeepSeek's MLA (mllm/layers/mla.py): q_proj, or q_a_proj, q_a_layernorm and q_b_proj;
  kv_a_proj_with_mqa ([W^DKV; W^KR]), kv_a_layernorm, kv_b_proj ([W^UK; W^UV] per head), o_proj."""
  dims = MLADims.of(c)
  qk = dims.nope + dims.rope
  links = [
    transposed(f'{p}kv_a_proj_with_mqa.weight', f'{m}kv_down/kernel'),
    same(f'{p}kv_a_layernorm.weight', f'{m}kv_norm/scale'),
    heads_in(f'{p}kv_b_proj.weight', f'{m}kv_up/kernel', dims.heads, dims.nope + dims.value),
    heads_out(f'{p}o_proj.weight', f'{m}out/kernel', dims.heads, dims.value),
  ]
  if dims.q_rank is None:
    return links + [heads_in(f'{p}q_proj.weight', f'{m}query/kernel', dims.heads, qk)]
  return links + [
    transposed(f'{p}q_a_proj.weight', f'{m}query_down/kernel'),
    same(f'{p}q_a_layernorm.weight', f'{m}query_latent_norm/scale'),
    heads_in(f'{p}q_b_proj.weight', f'{m}query/kernel', dims.heads, qk),
  ]


def _dense_ffn_links(c, p: str, m: str) -> list[Link]:
  links = [transposed(f'{p}{x}_proj.weight', f'{m}{x}/kernel') for x in ('gate', 'up', 'down')]
  if c.ffn.use_bias:
    links += [same(f'{p}{x}_proj.bias', f'{m}{x}/bias') for x in ('gate', 'up', 'down')]
  return links


def _moe_links(c, family: str, p: str, m: str) -> list[Link]:
  """Mixtral: block_sparse_moe.{gate, experts.E.w1 (gate), w3 (up), w2 (down)};
  Qwen3-MoE: mlp.{gate, experts.E.gate_proj, up_proj, down_proj}. The router is a Linear [E, D]."""
  e = range(c.ffn.moe.num_experts)
  if family == 'gpt_oss':  # stacked experts already, gate and up interleaved, biases everywhere
    p = p + 'mlp.'
    return [
      transposed(f'{p}router.weight', f'{m}router'),
      same(f'{p}router.bias', f'{m}router_bias'),
      interleaved_pair(f'{p}experts.gate_up_proj', (f'{m}experts/gate', f'{m}experts/up')),
      interleaved_pair(
        f'{p}experts.gate_up_proj_bias', (f'{m}experts/gate_bias', f'{m}experts/up_bias')
      ),
      same(f'{p}experts.down_proj', f'{m}experts/down'),
      same(f'{p}experts.down_proj_bias', f'{m}experts/down_bias'),
    ]
  if family == 'mixtral':
    p, names = p + 'block_sparse_moe.', {'gate': 'w1', 'up': 'w3', 'down': 'w2'}
  else:
    p, names = p + 'mlp.', {x: f'{x}_proj' for x in ('gate', 'up', 'down')}
  links = [transposed(f'{p}gate.weight', f'{m}router')] + [
    experts([f'{p}experts.{i}.{names[x]}.weight' for i in e], f'{m}experts/{x}')
    for x in ('gate', 'up', 'down')
  ]
  if family == 'deepseek_v3':  # the routing bias and one shared MLP, a stack of one expert
    links.append(same(f'{p}gate.e_score_correction_bias', f'{m}expert_bias'))
    links += [
      experts([f'{p}shared_experts.{x}_proj.weight'], f'{m}shared/{x}')
      for x in ('gate', 'up', 'down')
    ]
  return links


def llama_links(c, family: str) -> list[Link]:
  """Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, OLMo 2, StableLM, Gemma 2, DeepSeek-V3,
  gpt-oss:
  model.{embed_tokens, layers.i, norm}, lm_head; each family's layer norms in LAYER_NORMS."""

  sparse = set(moe_layers(c))

  def norm(hf: str, mllm: str) -> list[Link]:  # StableLM's LayerNorms have biases
    links = [same(f'{hf}.weight', f'{mllm}/scale')]
    return links + [same(f'{hf}.bias', f'{mllm}/bias')] if family == 'stablelm' else links

  links = [same('model.embed_tokens.weight', 'embed/embedding'), *norm('model.norm', 'final_norm')]
  if not c.tie_embeddings:
    links.append(transposed('lm_head.weight', 'head/kernel'))
  for i in range(c.n_layers):
    p, m = f'model.layers.{i}.', f'blocks/{i}/'
    attention = _mla_links if c.attention.kind == 'mla' else _attention_links
    links += attention(c, p + 'self_attn.', m + 'attention/')
    links += (
      _moe_links(c, family, p, m + 'ffn/')
      if i in sparse
      else _dense_ffn_links(c, p + 'mlp.', m + 'ffn/')
    )
    for hf_norm, mllm_norm in LAYER_NORMS.get(family, LAYER_NORMS['llama']):
      links += norm(p + hf_norm, m + mllm_norm)
  return links


# Each layer's norms, HF name → mllm name: Llama's before each sublayer; OLMo 2's one on each
# sublayer's output; Gemma 2's before and after each (weights stored as w of 1 + w, as mllm's with
# norm.unit_offset).
LAYER_NORMS = {
  'llama': (('input_layernorm', 'attention_norm'), ('post_attention_layernorm', 'ffn_norm')),
  'olmo2': (
    ('post_attention_layernorm', 'attention_norm'),
    ('post_feedforward_layernorm', 'ffn_norm'),
  ),
  'gemma2': (
    ('input_layernorm', 'attention_norm'),
    ('post_attention_layernorm', 'attention_out_norm'),
    ('pre_feedforward_layernorm', 'ffn_norm'),
    ('post_feedforward_layernorm', 'ffn_out_norm'),
  ),
}


def gpt2_links(c, prefix: str = 'transformer.') -> list[Link]:
  """GPT2LMHeadModel: transformer.{wte, wpe, h.i, ln_f}; Conv1D weights are [in, out] already."""
  n, h = c.n_heads, resolved_head_dim(c)
  t = prefix

  def norm(hf: str, mllm: str) -> list[Link]:
    return [same(f'{t}{hf}.weight', f'{mllm}/scale'), same(f'{t}{hf}.bias', f'{mllm}/bias')]

  links = [
    same(f'{t}wte.weight', 'embed/embedding'),
    same(f'{t}wpe.weight', 'position/table'),
    *norm('ln_f', 'final_norm'),
  ]
  if not c.tie_embeddings:
    links.append(transposed('lm_head.weight', 'head/kernel'))
  for i in range(c.n_layers):
    p, m = f'{t}h.{i}.', f'blocks/{i}/'
    qkv = tuple(f'{m}attention/{x}/' for x in ('query', 'key', 'value'))
    links += [
      fused_qkv(p + 'attn.c_attn.weight', tuple(x + 'kernel' for x in qkv), n, h),
      fused_qkv(p + 'attn.c_attn.bias', tuple(x + 'bias' for x in qkv), n, h),
      _one(
        p + 'attn.c_proj.weight',
        m + 'attention/out/kernel',
        lambda w: w.reshape(n, h, w.shape[-1]),
        lambda k: k.reshape(n * h, -1),
      ),
      same(p + 'attn.c_proj.bias', m + 'attention/out/bias'),
      same(p + 'mlp.c_fc.weight', m + 'ffn/up/kernel'),
      same(p + 'mlp.c_fc.bias', m + 'ffn/up/bias'),
      same(p + 'mlp.c_proj.weight', m + 'ffn/down/kernel'),
      same(p + 'mlp.c_proj.bias', m + 'ffn/down/bias'),
      *norm(f'h.{i}.ln_1', m + 'attention_norm'),
      *norm(f'h.{i}.ln_2', m + 'ffn_norm'),
    ]
  return links


def links_for(c, family: str, names: list[str] | None = None) -> list[Link]:
  """The links of model config `c` in HF `family`. names: the checkpoint's tensor names, if read
  (GPT-2 checkpoints exist with and without the 'transformer.' prefix)."""
  if family == 'gpt2':
    bare = names is not None and not any(n.startswith('transformer.') for n in names)
    return gpt2_links(c, '' if bare else 'transformer.')
  return llama_links(c, family)


# --- Between a pure dict and '/'-paths ----------------------------------------------------------


def flat(tree: dict, prefix: str = '') -> dict[str, np.ndarray]:
  out = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    out.update(flat(value, path + '/') if isinstance(value, dict) else {path: value})
  return out


def nested(flat_params: dict[str, np.ndarray]) -> dict:
  """Back to a pure dict; numeric path parts become int keys (nnx.List indices)."""
  out: dict = {}
  for path, value in flat_params.items():
    node = out
    *parents, leaf = [int(p) if p.isdigit() else p for p in path.split('/')]
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return out


def layer_path(path: str, i: int | None) -> str:
  """'blocks/x' → 'blocks/i/x' (i None: the path as is)."""
  return path if i is None else f'blocks/{i}/{path[len("blocks/") :]}'


def unstack_layers(params: dict[str, np.ndarray], n_layers: int) -> dict[str, np.ndarray]:
  """scan_layers' 'blocks/x' [L, ...] as 'blocks/i/x' (the same parameters, one per layer)."""
  out = {}
  for path, value in params.items():
    layers = range(n_layers) if path.startswith('blocks/') else [None]
    out.update({layer_path(path, i): value if i is None else value[i] for i in layers})
  return out
