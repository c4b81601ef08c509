"""mllm model config → Hugging Face config.json, exactly or not at all.

Export (`hf_config`) writes the HF fields of an mllm model; `check_exact` maps them back
(hf_config.config_overrides) and compares every setting that changes what the network computes
(`math_of`): a difference is a one-line refusal naming the mllm key. So whatever is exported imports
to the same network.
"""

from __future__ import annotations

from typing import Any

from mllm.interop.hf_config import ARCHITECTURES, FAMILIES, HFExportError
from mllm.layers import resolved_head_dim
from mllm.layers.ffn import hidden_dim
from mllm.layers.moe import expert_hidden_dim, moe_layers
from mllm.model import dense_ffn_kind

# The model keys whose values `math_of` compares as they are (the rest it resolves first).
MATH_KEYS = (
  'vocab_size',
  'd_model',
  'n_layers',
  'n_heads',
  'n_kv_heads',
  'tie_embeddings',
  'embed_scale',
  'position.kind',
  'norm.kind',
  'norm.placement',
  'norm.eps',
  'norm.final_norm',
  'ffn.kind',
  'ffn.use_bias',
  'attention.qk_norm',
  'attention.use_bias',
  'attention.qkv_bias',
  'attention.sliding_window',
)


def family_for(m) -> str:
  """The HF family an mllm model config is exported as (checked afterwards by `check_exact`)."""
  if m.ffn.kind == 'moe':
    return 'qwen3_moe' if m.attention.qk_norm else 'mixtral'
  if m.position.kind == 'learned':
    return 'gpt2'
  if m.attention.qk_norm:
    return 'qwen3'
  if m.attention.qkv_bias:
    return 'qwen2'
  return 'mistral' if m.attention.sliding_window else 'llama'


def _hf_rope(m) -> dict[str, Any]:
  p = m.position
  params: dict[str, Any] = {'rope_type': 'default', 'rope_theta': float(p.rope_theta)}
  if p.rope_scaling == 'linear':
    params.update(rope_type='linear', factor=float(p.rope_scaling_factor))
  elif p.rope_scaling == 'yarn':
    params.update(
      rope_type='yarn',
      factor=float(p.rope_scaling_factor),
      original_max_position_embeddings=int(p.rope_original_max_len or m.max_seq_len),
      beta_fast=float(p.yarn_beta_fast),
      beta_slow=float(p.yarn_beta_slow),
    )
  elif p.rope_scaling == 'llama3':
    params.update(
      rope_type='llama3',
      factor=float(p.rope_scaling_factor),
      low_freq_factor=float(p.llama3_low_freq_factor),
      high_freq_factor=float(p.llama3_high_freq_factor),
      original_max_position_embeddings=int(p.rope_original_max_len or m.max_seq_len),
    )
  # Both spellings: transformers ≥ 5 reads rope_parameters, earlier versions rope_theta and
  # rope_scaling.
  legacy = (
    None
    if params['rope_type'] == 'default'
    else {k: v for k, v in params.items() if k != 'rope_theta'}
  )
  return {'rope_parameters': params, 'rope_theta': params['rope_theta'], 'rope_scaling': legacy}


def _gpt2_fields(m) -> dict[str, Any]:
  """GPT-2's own field names (n_embd, n_layer, ...)."""
  # Another FFN is written as GPT-2's own, and check_exact names the difference.
  kind = {'gelu_tanh': 'gelu_new', 'gelu': 'gelu'}.get(m.ffn.kind, 'gelu_new')
  return {
    'n_embd': m.d_model,
    'n_layer': m.n_layers,
    'n_head': m.n_heads,
    'n_positions': m.max_seq_len,
    'n_inner': hidden_dim(m.ffn, m.d_model),
    'activation_function': kind,
    'layer_norm_epsilon': float(m.norm.eps),
    'resid_pdrop': 0.0,
    'embd_pdrop': 0.0,
    'attn_pdrop': 0.0,
    'scale_attn_weights': True,
  }


def _family_fields(m, family: str) -> dict[str, Any]:
  """The fields only some Llama-like families have: biases, windows, experts."""
  out: dict[str, Any] = {}
  if family in ('llama', 'qwen3', 'qwen3_moe'):
    out['attention_bias'] = bool(m.attention.use_bias)
  if family == 'llama':
    out['mlp_bias'] = bool(m.ffn.use_bias)
  if family in ('mistral', 'mixtral'):
    out['sliding_window'] = m.attention.sliding_window
  if family in ('qwen2', 'qwen3', 'qwen3_moe'):
    out.update(use_sliding_window=False, sliding_window=None)
  if family == 'mixtral':
    out.update(
      num_local_experts=m.moe.num_experts,
      num_experts_per_tok=m.moe.top_k,
      intermediate_size=expert_hidden_dim(m),
      router_jitter_noise=0.0,
    )
  if family == 'qwen3_moe':
    out.update(
      num_experts=m.moe.num_experts,
      num_experts_per_tok=m.moe.top_k,
      moe_intermediate_size=expert_hidden_dim(m),
      decoder_sparse_step=m.moe.every,
      mlp_only_layers=list(range(m.moe.first_dense_layers)),
      norm_topk_prob=bool(m.moe.renormalize),
    )
  return out


def hf_config(m, family: str, dtype: str) -> dict[str, Any]:
  """config.json for model config `m` as `family` (unchecked: see `check_exact`)."""

  head_dim = resolved_head_dim(m)
  common = {
    'architectures': [ARCHITECTURES[family]],
    'model_type': family,
    'vocab_size': m.vocab_size,
    'tie_word_embeddings': bool(m.tie_embeddings),
    'dtype': dtype,
    'bos_token_id': None,
    'eos_token_id': None,
    'pad_token_id': None,
  }
  if family == 'gpt2':
    return {**common, **_gpt2_fields(m)}
  out = {
    **common,
    'hidden_size': m.d_model,
    'num_hidden_layers': m.n_layers,
    'num_attention_heads': m.n_heads,
    'num_key_value_heads': m.n_kv_heads,
    'head_dim': head_dim,
    'max_position_embeddings': m.max_seq_len,
    'intermediate_size': hidden_dim(m.ffn, m.d_model, dense_ffn_kind(m)),
    'rms_norm_eps': float(m.norm.eps),
    'hidden_act': 'silu',
    'attention_dropout': 0.0,
    **_hf_rope(m),
  }
  return {**out, **_family_fields(m, family)}


def math_of(m) -> dict[str, Any]:
  """The settings of model config `m` that change what the network computes, resolved (a None
  that means a default is replaced by the value it means), keyed by their mllm key."""
  out = {k: _get(m, k) for k in MATH_KEYS}
  head_dim = resolved_head_dim(m)
  out['head_dim'] = head_dim
  out['attention.softmax_scale'] = m.attention.softmax_scale or head_dim**-0.5
  out['norm.use_bias'] = (
    m.norm.kind == 'layernorm' if m.norm.use_bias is None else bool(m.norm.use_bias)
  )
  if m.norm.kind == 'partial_rmsnorm':
    out['norm.partial_p'] = m.norm.partial_p
  if len(moe_layers(m)) < m.n_layers:  # there are dense layers (all of them without MoE)
    out['ffn.d_ff'] = hidden_dim(m.ffn, m.d_model, dense_ffn_kind(m))
  if m.position.kind == 'learned':
    out['max_seq_len'] = m.max_seq_len
  if m.position.kind == 'rope':
    out.update(_rope_math(m))
  if m.ffn.kind == 'moe':
    out.update(_moe_math(m))
  return out


def _rope_math(m) -> dict[str, Any]:
  """RoPE's settings that change the network, for `math_of`."""
  p = m.position
  out = {
    'position.rope_theta': float(p.rope_theta),
    'position.rope_layout': p.rope_layout,
    'position.rope_scaling': p.rope_scaling,
  }
  if p.rope_scaling != 'none':
    out['position.rope_scaling_factor'] = float(p.rope_scaling_factor)
  if p.rope_scaling in ('ntk', 'yarn', 'llama3'):
    out['position.rope_original_max_len'] = p.rope_original_max_len or m.max_seq_len
  if p.rope_scaling == 'yarn':
    out.update(
      {'position.yarn_beta_fast': p.yarn_beta_fast, 'position.yarn_beta_slow': p.yarn_beta_slow}
    )
  if p.rope_scaling == 'llama3':
    out.update(
      {
        'position.llama3_low_freq_factor': p.llama3_low_freq_factor,
        'position.llama3_high_freq_factor': p.llama3_high_freq_factor,
      }
    )
  return out


def _moe_math(m) -> dict[str, Any]:
  """The MoE settings that change the network, for `math_of`."""
  moe = m.moe
  return {
    'moe.num_experts': moe.num_experts,
    'moe.top_k': moe.top_k,
    'moe.expert_kind': moe.expert_kind,
    'moe.expert_d_ff': expert_hidden_dim(m),
    'moe.num_shared_experts': moe.num_shared_experts,
    'moe.layers': moe_layers(m),
    'moe.router': moe.router,
    'moe.renormalize': bool(moe.renormalize),
    'moe.expert_bias': bool(moe.expert_bias),
  }


def _get(m, key: str) -> Any:
  node = m
  for part in key.split('.'):
    node = node[part]
  return node


def check_exact(m, family: str, back) -> None:
  """Refuse, naming the first mllm key, a model `m` whose export `back` (its config.json mapped
  back to mllm) would compute something else."""
  want, got = math_of(m), math_of(back)
  for key in want:
    if want[key] != got.get(key):
      shown = 'model.moe.every / first_dense_layers' if key == 'moe.layers' else f'model.{key}'
      raise HFExportError(
        f'{shown}={want[key]!r}: Hugging Face\'s {ARCHITECTURES[family]} (the nearest class) '
        f'has {got.get(key)!r}; allowed: a model a transformers class computes exactly '
        f'({", ".join(FAMILIES)})'
      )
