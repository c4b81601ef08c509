"""Hugging Face config.json ↔ mllm config keys, for the families mllm represents exactly.

Import (`config_overrides`) maps each HF field to mllm keys and refuses, in one line naming the
field, anything that changes the math and has no mllm equivalent. Export is hf_config_export.py,
which checks each export by mapping it back here: nothing is approximated either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# model_type → the architecture transformers builds for it.
ARCHITECTURES = {
  'llama': 'LlamaForCausalLM',
  'mistral': 'MistralForCausalLM',
  'qwen2': 'Qwen2ForCausalLM',
  'qwen3': 'Qwen3ForCausalLM',
  'gpt2': 'GPT2LMHeadModel',
  'mixtral': 'MixtralForCausalLM',
  'qwen3_moe': 'Qwen3MoeForCausalLM',
}
FAMILIES = tuple(ARCHITECTURES)
MOE_FAMILIES = ('mixtral', 'qwen3_moe')


class HFImportError(ValueError):
  """A checkpoint mllm cannot represent exactly, or a malformed one (one line)."""


class HFExportError(ValueError):
  """An mllm model no transformers class represents exactly (one line)."""


# --- Import: HF fields → mllm keys ------------------------------------------------------------


def family_of(hf: dict) -> str:
  model_type = hf.get('model_type')
  if model_type not in FAMILIES:
    raise HFImportError(
      f'model_type={model_type!r}: not imported yet; allowed: {", ".join(FAMILIES)}'
    )
  return model_type


def _rope(hf: dict) -> dict[str, Any]:
  """Position keys from `rope_parameters` (transformers ≥ 5) or `rope_theta` + `rope_scaling`."""
  params = dict(hf.get('rope_parameters') or {})
  if not params:
    params = dict(hf.get('rope_scaling') or {})
    params.setdefault('rope_theta', hf.get('rope_theta', 10000.0))
  kind = params.get('rope_type', params.get('type', 'default'))
  out = {
    'position.kind': 'rope',
    'position.rope_layout': 'half',
    'position.rope_theta': float(params['rope_theta']),
  }
  if kind == 'default':
    return out
  original = params.get('original_max_position_embeddings')
  if kind == 'linear':
    out.update(
      {'position.rope_scaling': 'linear', 'position.rope_scaling_factor': float(params['factor'])}
    )
  elif kind == 'llama3':
    out.update(
      {
        'position.rope_scaling': 'llama3',
        'position.rope_scaling_factor': float(params['factor']),
        'position.llama3_low_freq_factor': float(params['low_freq_factor']),
        'position.llama3_high_freq_factor': float(params['high_freq_factor']),
        'position.rope_original_max_len': int(original),
      }
    )
  elif kind == 'yarn':
    for field in ('attention_factor', 'mscale', 'mscale_all_dim', 'partial_rotary_factor'):
      if params.get(field) is not None:
        raise HFImportError(
          f'rope_parameters.{field}={params[field]!r}: mllm\'s YaRN has the '
          'paper\'s attention factor 0.1·ln(s) + 1 only; allowed: unset'
        )
    if params.get('truncate', True) is not True:
      raise HFImportError(
        f"rope_parameters.truncate={params['truncate']!r}: mllm's YaRN rounds "
        'the correction range (floor/ceil); allowed: true'
      )
    factor = params.get('factor') or hf['max_position_embeddings'] / original
    out.update(
      {
        'position.rope_scaling': 'yarn',
        'position.rope_scaling_factor': float(factor),
        'position.rope_original_max_len': int(original or hf['max_position_embeddings']),
        # transformers reads 0 or null as the defaults too
        'position.yarn_beta_fast': float(params.get('beta_fast') or 32.0),
        'position.yarn_beta_slow': float(params.get('beta_slow') or 1.0),
      }
    )
  else:
    raise HFImportError(
      f'rope_type={kind!r}: not mapped to mllm yet; allowed: default, linear, llama3, yarn'
    )
  return out


def _refuse(hf: dict, field: str, allowed: Callable[[Any], bool], what: str) -> None:
  if field in hf and not allowed(hf[field]):
    raise HFImportError(f'{field}={hf[field]!r}: mllm has no equivalent; allowed: {what}')


def _window(hf: dict, family: str) -> int | None:
  window = hf.get('sliding_window')
  if family in ('qwen2', 'qwen3', 'qwen3_moe'):
    layer_types = hf.get('layer_types') or []
    sliding = hf.get('use_sliding_window', False) or 'sliding_attention' in layer_types
    if not sliding:
      return None
    if layer_types and set(layer_types) != {'sliding_attention'}:
      raise HFImportError(
        'layer_types mixes full and sliding attention; allowed: one kind for '
        'every layer (mllm has one window for all layers)'
      )
  return None if window is None else int(window)


def _moe(hf: dict, family: str) -> dict[str, Any]:
  """Mixtral: every layer sparse, experts of intermediate_size; Qwen3-MoE: decoder_sparse_step,
  mlp_only_layers (a leading run only), moe_intermediate_size, norm_topk_prob."""
  _refuse(hf, 'router_jitter_noise', lambda v: not v, '0 (mllm has no jitter noise)')
  if family == 'mixtral':
    experts, expert_d_ff, every, first_dense, renormalize = (
      hf['num_local_experts'],
      hf['intermediate_size'],
      1,
      0,
      True,
    )
  else:
    # transformers 5 writes num_local_experts (its attribute map); the hub's configs num_experts.
    experts = hf.get('num_experts') or hf['num_local_experts']
    expert_d_ff = hf['moe_intermediate_size']
    every, dense = hf.get('decoder_sparse_step', 1), list(hf.get('mlp_only_layers') or [])
    first_dense = len(dense)
    if dense != list(range(first_dense)):
      raise HFImportError(
        f'mlp_only_layers={dense!r}: mllm\'s dense layers are a leading run; '
        f'allowed: [0, 1, ..., k-1]'
      )
    renormalize = bool(hf.get('norm_topk_prob', True))
  return {
    'ffn.kind': 'moe',
    'moe.num_experts': experts,
    'moe.top_k': hf['num_experts_per_tok'],
    'moe.expert_kind': 'swiglu',
    'moe.expert_d_ff': expert_d_ff,
    'moe.num_shared_experts': 0,
    'moe.every': every,
    'moe.first_dense_layers': first_dense,
    'moe.router': 'softmax',
    'moe.renormalize': renormalize,
    'moe.noise': 'none',
    'moe.expert_bias': False,
    # Dropless: capacity dispatch drops tokens, transformers never does.
    'moe.dispatch': 'dropless',
    'moe.grouped_matmul': 'ragged_dot',
  }


def _llama_like(hf: dict, family: str) -> dict[str, Any]:
  _refuse(hf, 'hidden_act', lambda v: v == 'silu', "'silu' (SwiGLU)")
  _refuse(hf, 'pretraining_tp', lambda v: v in (None, 1), '1')
  _refuse(hf, 'attention_dropout', lambda v: not v, '0.0')
  n_heads = hf['num_attention_heads']
  out = {
    'vocab_size': hf['vocab_size'],
    'd_model': hf['hidden_size'],
    'n_layers': hf['num_hidden_layers'],
    'n_heads': n_heads,
    'n_kv_heads': hf.get('num_key_value_heads') or n_heads,
    'head_dim': hf.get('head_dim') or hf['hidden_size'] // n_heads,
    'max_seq_len': hf['max_position_embeddings'],
    'tie_embeddings': bool(hf.get('tie_word_embeddings', False)),
    'embed_scale': 1.0,
    'norm.kind': 'rmsnorm',
    'norm.placement': 'pre',
    'norm.eps': float(hf['rms_norm_eps']),
    'norm.final_norm': True,
    'ffn.kind': 'swiglu',
    'ffn.d_ff': hf['intermediate_size'],
    'ffn.match_params': False,
    'ffn.use_bias': bool(hf.get('mlp_bias', False)),
    'attention.use_bias': bool(hf.get('attention_bias', False)),
    'attention.qkv_bias': family == 'qwen2',
    'attention.qk_norm': family in ('qwen3', 'qwen3_moe'),
    'attention.softmax_scale': None,
    'attention.sliding_window': _window(hf, family),
  }
  out.update(_rope(hf))
  if family in MOE_FAMILIES:
    out.update(_moe(hf, family))
  return out


def _gpt2(hf: dict) -> dict[str, Any]:
  acts = {'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh', 'gelu': 'gelu'}
  _refuse(hf, 'activation_function', lambda v: v in acts, ', '.join(acts))
  _refuse(hf, 'scale_attn_by_inverse_layer_idx', lambda v: not v, 'false')
  _refuse(hf, 'reorder_and_upcast_attn', lambda v: not v, 'false')
  _refuse(hf, 'scale_attn_weights', lambda v: v, 'true')
  d = hf['n_embd']
  return {
    'vocab_size': hf['vocab_size'],
    'd_model': d,
    'n_layers': hf['n_layer'],
    'n_heads': hf['n_head'],
    'n_kv_heads': hf['n_head'],
    'head_dim': d // hf['n_head'],
    'max_seq_len': hf['n_positions'],
    'tie_embeddings': bool(hf.get('tie_word_embeddings', True)),
    'embed_scale': 1.0,
    'position.kind': 'learned',
    'norm.kind': 'layernorm',
    'norm.placement': 'pre',
    'norm.final_norm': True,
    'norm.eps': float(hf['layer_norm_epsilon']),
    'norm.use_bias': True,
    'ffn.kind': acts[hf.get('activation_function', 'gelu_new')],
    'ffn.d_ff': hf.get('n_inner') or 4 * d,
    'ffn.match_params': False,
    'ffn.use_bias': True,
    'attention.use_bias': True,
    'attention.qkv_bias': False,
    'attention.qk_norm': False,
    'attention.softmax_scale': None,
    'attention.sliding_window': None,
  }


def config_overrides(hf: dict) -> dict[str, Any]:
  """mllm config keys (dotted) that make the model of this HF config, in float32."""
  family = family_of(hf)
  model = _gpt2(hf) if family == 'gpt2' else _llama_like(hf, family)
  out = {f'model.{k}': v for k, v in model.items()}
  out.update(
    {
      'model.dtype': 'float32',
      'model.param_dtype': 'float32',
      'model.dropout': 0.0,
      'model.embed_dropout': 0.0,
      'model.attention.dropout': 0.0,
      'data.seq_len': model['max_seq_len'],
    }
  )
  return out
