"""mllm model config → Hugging Face config.json, exactly or not at all.

Export (`hf_config`) writes the HF fields of an mllm model; `check_exact` maps them back
(hf_config.config_overrides) and compares every setting that changes what the network computes
(`math_of`): a difference is a one-line refusal naming the mllm key. So whatever is exported imports
to the same network.
"""

from __future__ import annotations

from typing import Any

from mllm.interop.hf_config import (
  ARCHITECTURES,
  FAMILIES,
  GEMMA2_FFN,
  GPT2_FFNS,
  LLAMA_FFN,
  HFExportError,
)
from mllm.layers import resolved_head_dim
from mllm.layers.attention import ATTENTIONS, layer_windows
from mllm.layers.ffn import FFNS, hidden_dim
from mllm.layers.mla import MLADims
from mllm.layers.moe import moe_layers
from mllm.layers.moe_hf import moe_hf_fields, moe_math
from mllm.layers.norms import NORMS
from mllm.layers.parametrization import attention_scale, width_multiplier
from mllm.layers.positions import POSITIONS, RotaryPositions
from mllm.layers.rope import deepseek_mscale_all_dim
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
  'final_logit_softcap',
  'attention.logit_softcap',
  'attention.output_gate',
  'position.kind',
  'norm.kind',
  'norm.placement',
  'norm.eps',
  'norm.unit_offset',
  'norm.final_norm',
  'ffn.kind',
  'ffn.use_bias',
  'attention.qk_norm',
  'attention.qk_norm_over',
  'attention.use_bias',
  'attention.qkv_bias',
  'attention.sliding_window',
  'attention.global_every',
  'attention.value_residual',
  'attention.sinks',
  'attention.kind',
  'multi_token_prediction',
)


def family_for(m) -> str:
  """The HF family an mllm model config is exported as (checked afterwards by `check_exact`)."""
  if m.attention.kind == 'mla':
    return 'deepseek_v3'
  if m.attention.sinks:
    return 'gpt_oss'
  if moe_layers(m):
    return 'qwen3_moe' if m.attention.qk_norm else 'mixtral'
  if m.position.kind == 'learned':
    return 'gpt2'
  if m.norm.placement == 'sandwich':
    return 'gemma2'
  if m.norm.placement == 'output':
    return 'olmo2'
  if m.position.kind == 'rope' and m.position.rope.fraction != 1.0:
    return 'stablelm'
  if m.attention.qk_norm:
    return 'qwen3'
  if m.attention.qkv_bias:
    return 'qwen2'
  return 'mistral' if m.attention.sliding_window else 'llama'


def _gpt2_fields(m) -> dict[str, Any]:
  """GPT-2's own field names (n_embd, n_layer, ...)."""
  # Another FFN is written as GPT-2's default, and check_exact names the difference.
  kind = m.ffn.kind if m.ffn.kind in GPT2_FFNS else GPT2_FFNS[0]
  return {
    'n_embd': m.d_model,
    'n_layer': m.n_layers,
    'n_head': m.n_heads,
    'n_positions': m.max_seq_len,
    'n_inner': hidden_dim(m.ffn, m.d_model),
    'activation_function': FFNS[kind].hf_activations[0],
    'layer_norm_epsilon': float(m.norm.eps),
    'resid_pdrop': 0.0,
    'embd_pdrop': 0.0,
    'attn_pdrop': 0.0,
    'scale_attn_weights': True,
  }


def _gemma2_fields(m) -> dict[str, Any]:
  """Gemma 2's own fields (its FFN's activation, soft caps, score scale, layer types); a model
  it does not compute (no √d embedding scale, a gain not stored as 1 + w, another FFN) is
  written as Gemma 2 and check_exact names the difference."""
  scale = m.attention.softmax_scale or attention_scale(m, resolved_head_dim(m))
  full = [window is None for window in layer_windows(m)]
  return {
    'hidden_activation': FFNS[GEMMA2_FFN].hf_activations[0],
    # An integer in transformers: scores × its −½ power (another scale: check_exact refuses).
    'query_pre_attn_scalar': round(scale**-2.0),
    'attn_logit_softcapping': m.attention.logit_softcap,
    'final_logit_softcapping': m.final_logit_softcap,
    'sliding_window': m.attention.sliding_window,
    'layer_types': ['full_attention' if f else 'sliding_attention' for f in full],
    'attention_bias': bool(m.attention.use_bias),
  }


def _deepseek_v3_fields(m) -> dict[str, Any]:
  """DeepSeek-V3's MLA sizes (mllm/layers/mla.py's mapping), RoPE's layout, and, for a model
  without MoE layers, every layer dense (first_k_dense_replace = n_layers)."""
  dims = MLADims.of(m)
  out = {
    'qk_nope_head_dim': dims.nope,
    'qk_rope_head_dim': dims.rope,
    'head_dim': dims.rope,  # transformers' RoPE reads its size here
    'v_head_dim': dims.value,
    'kv_lora_rank': dims.kv_rank,
    'q_lora_rank': dims.q_rank,
    'rope_interleave': m.position.rope.layout == 'interleaved',
    'attention_bias': False,
    'num_nextn_predict_layers': 0,
  }
  if not moe_layers(m):
    out['first_k_dense_replace'] = m.n_layers
  return out


def _with_deepseek_mscale(m, out: dict[str, Any]) -> dict[str, Any]:
  """`out` with the `mscale_all_dim` that gives DeepSeek-V3 the model's softmax scale where RoPE
  is scaled (transformers' `yarn_apply_mscale`); any other scale is left for check_exact."""
  scale, kind = m.attention.softmax_scale, m.position.rope.scaling.kind
  if scale is None or out['rope_scaling'] is None:  # RoPE not scaled in transformers' terms
    return out
  qk_dim, _ = ATTENTIONS[m.attention.kind].head_dims(m)
  factor = m.position.rope.scaling[kind].factor
  mscale_all_dim = deepseek_mscale_all_dim(scale, qk_dim, factor)
  if mscale_all_dim is None:
    return out
  field = {'mscale_all_dim': mscale_all_dim}
  return {
    **out,
    'rope_parameters': {**out['rope_parameters'], **field},
    'rope_scaling': {**out['rope_scaling'], **field},
  }


def _gpt_oss_fields(m) -> dict[str, Any]:
  """gpt-oss's window and `layer_types`, its attention biases and its experts."""
  full = [window is None for window in layer_windows(m)]
  return {
    'sliding_window': m.attention.sliding_window,
    'layer_types': ['full_attention' if f else 'sliding_attention' for f in full],
    'attention_bias': bool(m.attention.use_bias),
    **moe_hf_fields(m, 'gpt_oss'),
  }


def _family_fields(m, family: str) -> dict[str, Any]:
  """The fields only some Llama-like families have: biases, windows, experts."""
  out: dict[str, Any] = {}
  if family in ('llama', 'qwen3', 'qwen3_moe', 'olmo2'):
    out['attention_bias'] = bool(m.attention.use_bias)
  if family == 'llama':
    out['mlp_bias'] = bool(m.ffn.use_bias)
  if family in ('mistral', 'mixtral'):
    out['sliding_window'] = m.attention.sliding_window
  if family in ('qwen2', 'qwen3', 'qwen3_moe'):
    out.update(use_sliding_window=False, sliding_window=None)
  if family == 'stablelm':
    out.update(
      use_qkv_bias=bool(m.attention.qkv_bias),
      qk_layernorm=False,
      use_parallel_residual=False,
      hidden_dropout=0.0,
      layer_norm_eps=float(m.norm.eps),
    )
  out.update(moe_hf_fields(m, family))
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
    'hidden_act': FFNS[LLAMA_FFN].hf_activations[0],
    'attention_dropout': 0.0,
    **RotaryPositions.hf_fields(m),
  }
  if family == 'gemma2':
    del out['hidden_act']
    return {**out, **_gemma2_fields(m)}
  if family == 'gpt_oss':
    return {**out, **_gpt_oss_fields(m)}
  if family == 'deepseek_v3':
    moe = moe_hf_fields(m, family) if moe_layers(m) else {}
    return {**_with_deepseek_mscale(m, out), **_deepseek_v3_fields(m), **moe}
  if family == 'stablelm':  # LayerNorm's eps (its own field) and the rotated fraction
    del out['rms_norm_eps']
    fraction = float(m.position.rope.fraction)
    out['rope_parameters'] = {**out['rope_parameters'], 'partial_rotary_factor': fraction}
  return {**out, **_family_fields(m, family)}


def math_of(m) -> dict[str, Any]:
  """The settings of model config `m` that change what the network computes, resolved (a None
  that means a default is replaced by the value it means), keyed by their mllm key."""
  out = {k: _get(m, k) for k in MATH_KEYS}
  out['head_dim'] = resolved_head_dim(m)
  qk_dim, _ = ATTENTIONS[m.attention.kind].head_dims(m)
  out['attention.softmax_scale'] = m.attention.softmax_scale or attention_scale(m, qk_dim)
  if m.attention.kind == 'mla':
    out['attention.mla'] = MLADims.of(m)
  # µP away from its base width multiplies the logits by 1/m, which no transformers class does.
  out['parametrization.kind'] = 'standard' if width_multiplier(m) == 1.0 else m.parametrization.kind
  out['norm.use_bias'] = (
    m.norm.kind == 'layernorm' if m.norm.use_bias is None else bool(m.norm.use_bias)
  )
  out.update(NORMS[m.norm.kind].hf_math(m))
  if len(moe_layers(m)) < m.n_layers:  # there are dense layers (all of them without MoE)
    out['ffn.d_ff'] = hidden_dim(m.ffn, m.d_model, dense_ffn_kind(m))
  # Each variant names its own extra settings (RoPE's scaling, a learned table's size).
  out.update(POSITIONS[m.position.kind].hf_math(m))
  if moe_layers(m):
    out.update(moe_math(m))
  return out


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
      shown = (
        'model.ffn.moe.every / first_dense_layers' if key == 'ffn.moe.layers' else f'model.{key}'
      )
      raise HFExportError(
        f'{shown}={want[key]!r}: Hugging Face\'s {ARCHITECTURES[family]} (the nearest class) '
        f'has {got.get(key)!r}; allowed: a model a transformers class computes exactly '
        f'({", ".join(FAMILIES)})'
      )
