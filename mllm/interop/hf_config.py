"""Hugging Face config.json ↔ mllm config keys, for the families mllm represents exactly.

Import (`config_overrides`) maps each HF field to mllm keys and refuses, in one line naming the
field, anything that changes the math and has no mllm equivalent. Export is hf_config_export.py,
which checks each export by mapping it back here: nothing is approximated either way.

Here is each family's structure: which fields it has and which variants it is built of. A
variant's own fields are mapped by its class: RoPE's rope_parameters by `RotaryPositions`
(mllm/layers/rope.py), the experts by mllm/layers/moe_hf.py, an activation's HF names by the FFN
class (`hf_activations`).
"""

from __future__ import annotations

from typing import Any

from mllm.hf_errors import HFExportError as HFExportError
from mllm.hf_errors import HFImportError as HFImportError
from mllm.hf_errors import refuse as _refuse

# The errors live low, so that a variant's mapping in mllm/layers/ raises them; the names here stay.
from mllm.interop.hf_quantized import check_quantization
from mllm.layers.ffn import FFNS
from mllm.layers.moe_hf import moe_keys_from_hf
from mllm.layers.positions import RotaryPositions
from mllm.layers.rope import deepseek_softmax_scale, hf_rope_params

# model_type → the architecture transformers builds for it.
ARCHITECTURES = {
  'llama': 'LlamaForCausalLM',
  'mistral': 'MistralForCausalLM',
  'qwen2': 'Qwen2ForCausalLM',
  'qwen3': 'Qwen3ForCausalLM',
  'gpt2': 'GPT2LMHeadModel',
  'mixtral': 'MixtralForCausalLM',
  'qwen3_moe': 'Qwen3MoeForCausalLM',
  'gemma2': 'Gemma2ForCausalLM',
  'olmo2': 'Olmo2ForCausalLM',
  'stablelm': 'StableLmForCausalLM',
  'deepseek_v3': 'DeepseekV3ForCausalLM',
  'gpt_oss': 'GptOssForCausalLM',
}
FAMILIES = tuple(ARCHITECTURES)
MOE_FAMILIES = ('mixtral', 'qwen3_moe', 'deepseek_v3', 'gpt_oss')
# The FFN of every Llama-like family (and its experts): hidden_act names its gate's activation.
LLAMA_FFN = 'swiglu'
# The FFN kinds GPT-2's activation_function can name, its default first.
GPT2_FFNS = ('gelu_tanh', 'gelu')
# Gemma 2's FFN: a GeGLU whose gate is GELU's tanh approximation.
GEMMA2_FFN = 'geglu_tanh'


# --- Import: HF fields → mllm keys ------------------------------------------------------------


def family_of(hf: dict) -> str:
  model_type = hf.get('model_type')
  if model_type not in FAMILIES:
    raise HFImportError(
      f'model_type={model_type!r}: not imported yet; allowed: {", ".join(FAMILIES)}'
    )
  return model_type


def _window(hf: dict, family: str) -> tuple[int | None, int | None]:
  """(attention.sliding_window, attention.global_every): Qwen's `layer_types` may mix sliding
  and full layers, which mllm computes where every N-th layer is the full one."""
  window = hf.get('sliding_window')
  if family in ('qwen2', 'qwen3', 'qwen3_moe'):
    layer_types = hf.get('layer_types') or []
    sliding = hf.get('use_sliding_window', False) or 'sliding_attention' in layer_types
    if not sliding:
      return None, None
    if layer_types and set(layer_types) != {'sliding_attention'}:
      return int(window), _every_nth_full(layer_types)
  return (None if window is None else int(window)), None


def _sizes(hf: dict, tied_by_default: bool) -> dict[str, Any]:
  """The sizes every Llama-like family's config.json names alike, and whether the head is tied
  (`tied_by_default`: the family's default when the field is absent)."""
  n_heads = hf['num_attention_heads']
  return {
    'vocab_size': hf['vocab_size'],
    'd_model': hf['hidden_size'],
    'n_layers': hf['num_hidden_layers'],
    'n_heads': n_heads,
    'n_kv_heads': hf.get('num_key_value_heads') or n_heads,
    'head_dim': hf.get('head_dim') or hf['hidden_size'] // n_heads,
    'max_seq_len': hf['max_position_embeddings'],
    'tie_embeddings': bool(hf.get('tie_word_embeddings', tied_by_default)),
  }


def _windows_by_layer_types(hf: dict) -> dict[str, Any]:
  """attention.sliding_window and global_every from `layer_types` (default: every other layer
  sliding, Gemma 2's and gpt-oss's), any N-th-layer pattern of full layers."""
  layer_types = hf.get('layer_types') or [
    'sliding_attention' if (i + 1) % 2 else 'full_attention' for i in range(hf['num_hidden_layers'])
  ]
  global_every = _every_nth_full(layer_types)
  window = hf.get('sliding_window') if 'sliding_attention' in layer_types else None
  return {
    'attention.sliding_window': None if window is None else int(window),
    'attention.global_every': global_every if window is not None else None,
  }


def _llama_like(hf: dict, family: str) -> dict[str, Any]:
  act = FFNS[LLAMA_FFN].hf_activations
  _refuse(hf, 'hidden_act', lambda v: v in act, f'{act[0]!r} (SwiGLU)')
  _refuse(hf, 'pretraining_tp', lambda v: v in (None, 1), '1')
  _refuse(hf, 'attention_dropout', lambda v: not v, '0.0')
  stablelm = family == 'stablelm'  # LayerNorm, q/k/v biases, partial RoPE
  if stablelm:
    _refuse(hf, 'qk_layernorm', lambda v: not v, 'false (mllm has RMSNorm QK-norm only)')
    _refuse(hf, 'use_parallel_residual', lambda v: not v, 'false')
    _refuse(hf, 'hidden_dropout', lambda v: not v, '0.0')
  window, global_every = _window(hf, family)
  out = {
    **_sizes(hf, tied_by_default=False),
    'embed_scale': 1.0,
    'norm.kind': 'layernorm' if stablelm else 'rmsnorm',
    'norm.use_bias': True if stablelm else None,
    # OLMo 2 (Team OLMo 2025): the norm on each sublayer's output, QK-norm over whole projections.
    'norm.placement': 'output' if family == 'olmo2' else 'pre',
    'norm.eps': float(hf['layer_norm_eps' if stablelm else 'rms_norm_eps']),
    'norm.final_norm': True,
    'ffn.kind': LLAMA_FFN,
    'ffn.d_ff': hf['intermediate_size'],
    'ffn.match_params': False,
    'ffn.use_bias': bool(hf.get('mlp_bias', False)),
    'attention.use_bias': bool(hf.get('attention_bias', False)),
    'attention.qkv_bias': family == 'qwen2' or bool(stablelm and hf.get('use_qkv_bias')),
    'attention.qk_norm': family in ('qwen3', 'qwen3_moe', 'olmo2'),
    'attention.qk_norm_over': 'projection' if family == 'olmo2' else 'head',
    'attention.softmax_scale': None,
    'attention.sliding_window': window,
    'attention.global_every': global_every,
  }
  out.update(RotaryPositions.keys_from_hf(hf, partial=stablelm))
  if family in MOE_FAMILIES:
    out.update(moe_keys_from_hf(hf, family))
  return out


def _gpt2(hf: dict) -> dict[str, Any]:
  acts = {name: kind for kind in GPT2_FFNS for name in FFNS[kind].hf_activations}
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
    'ffn.kind': acts[hf.get('activation_function', 'gelu_new')],  # GPT2Config's default
    'ffn.d_ff': hf.get('n_inner') or 4 * d,
    'ffn.match_params': False,
    'ffn.use_bias': True,
    'attention.use_bias': True,
    'attention.qkv_bias': False,
    'attention.qk_norm': False,
    'attention.softmax_scale': None,
    'attention.sliding_window': None,
  }


def _every_nth_full(layer_types: list[str]) -> int | None:
  """N where every N-th layer (i + 1 divisible by N) is 'full_attention' and the rest
  'sliding_attention' (Gemma 2: 2); None where every layer is full; refused otherwise."""
  n = len(layer_types)
  for every in range(2, n + 1):
    if all((t == 'full_attention') == ((i + 1) % every == 0) for i, t in enumerate(layer_types)):
      return every
  if set(layer_types) == {'full_attention'}:
    return None
  raise HFImportError(
    f'layer_types={layer_types} mixes full and sliding attention otherwise than every N-th layer '
    'full; allowed: one kind for every layer, or every N-th layer full (model.attention.'
    'global_every)'
  )


def _gemma2(hf: dict) -> dict[str, Any]:
  """Gemma 2 (Team et al. 2024): sandwich norms, embeddings × √d, GeGLU (tanh), attention and
  final-logit soft caps, scores scaled by query_pre_attn_scalar^-½, sliding windows on the layers
  `layer_types` names (every other one), RMSNorm gains stored as w in 1 + w (norm.unit_offset)."""
  act = FFNS[GEMMA2_FFN].hf_activations
  _refuse(hf, 'hidden_activation', lambda v: v in act, f'{act[0]!r} (GeGLU, tanh)')
  _refuse(hf, 'attention_dropout', lambda v: not v, '0.0')
  _refuse(hf, 'use_bidirectional_attention', lambda v: not v, 'false (causal)')
  out = {
    **_sizes(hf, tied_by_default=True),
    **_windows_by_layer_types(hf),
    'embed_scale': float(hf['hidden_size']) ** 0.5,
    'final_logit_softcap': hf.get('final_logit_softcapping'),
    'norm.kind': 'rmsnorm',
    'norm.placement': 'sandwich',
    'norm.unit_offset': True,
    'norm.eps': float(hf['rms_norm_eps']),
    'norm.final_norm': True,
    'ffn.kind': GEMMA2_FFN,
    'ffn.d_ff': hf['intermediate_size'],
    'ffn.match_params': False,
    'ffn.use_bias': False,
    'attention.use_bias': bool(hf.get('attention_bias', False)),
    'attention.qkv_bias': False,
    'attention.qk_norm': False,
    'attention.softmax_scale': float(hf['query_pre_attn_scalar']) ** -0.5,
    'attention.logit_softcap': hf.get('attn_logit_softcapping'),
  }
  out.update(RotaryPositions.keys_from_hf(hf))
  return out


def _deepseek_v3(hf: dict) -> dict[str, Any]:
  """DeepSeek-V3 (arXiv 2412.19437; V2's MLA, arXiv 2405.04434): multi-head latent attention
  (mllm/layers/mla.py) with its own head sizes, SwiGLU in the first first_k_dense_replace layers,
  DeepSeekMoE after them (mllm/layers/moe_hf.py). Its config.json's `head_dim` is the rotated
  part's size (qk_rope_head_dim); mllm's head_dim is the part without position, qk_nope_head_dim.
  The multi-token-prediction layers (num_nextn_predict_layers) are not in transformers' model,
  so not in its checkpoints either. With RoPE scaled, `mscale_all_dim` scales the softmax too."""
  act = FFNS[LLAMA_FFN].hf_activations
  _refuse(hf, 'hidden_act', lambda v: v in act, f'{act[0]!r} (SwiGLU)')
  _refuse(hf, 'pretraining_tp', lambda v: v in (None, 1), '1')
  _refuse(hf, 'attention_dropout', lambda v: not v, '0.0')
  _refuse(hf, 'attention_bias', lambda v: not v, 'false (MLA without biases)')
  n_heads, n_layers = hf['num_attention_heads'], hf['num_hidden_layers']
  _refuse(hf, 'num_key_value_heads', lambda v: v in (None, n_heads), f'{n_heads} (= heads)')
  out = {
    **_sizes(hf, tied_by_default=False),
    'head_dim': hf['qk_nope_head_dim'],  # config.json's head_dim is the rotated part's
    'embed_scale': 1.0,
    **_pre_rmsnorm(hf),
    'ffn.kind': LLAMA_FFN,
    'ffn.d_ff': hf['intermediate_size'],
    'ffn.match_params': False,
    'ffn.use_bias': False,
    'attention.kind': 'mla',
    'attention.mla.kv_lora_rank': hf['kv_lora_rank'],
    'attention.mla.q_lora_rank': hf.get('q_lora_rank'),
    'attention.mla.rope_head_dim': hf['qk_rope_head_dim'],
    'attention.mla.v_head_dim': hf['v_head_dim'],
    'attention.softmax_scale': None,
    'attention.sliding_window': None,
  }
  out.update(RotaryPositions.keys_from_hf(hf))
  out['position.rope.layout'] = 'interleaved' if hf.get('rope_interleave', True) else 'half'
  mscale_all_dim = hf_rope_params(hf).get('mscale_all_dim')
  scaling = out.get('position.rope.scaling.kind')
  if mscale_all_dim and scaling is not None:  # RoPE scaled: DeepSeek's softmax scale with it
    factor = out[f'position.rope.scaling.{scaling}.factor']
    qk_dim = hf['qk_nope_head_dim'] + hf['qk_rope_head_dim']
    out['attention.softmax_scale'] = deepseek_softmax_scale(qk_dim, factor, mscale_all_dim)
  if hf.get('n_routed_experts') and hf.get('first_k_dense_replace', 0) < n_layers:
    out.update(moe_keys_from_hf(hf, 'deepseek_v3'))
  return out


def _pre_rmsnorm(hf: dict) -> dict[str, Any]:
  """Pre-LN RMSNorm with a final norm, at the checkpoint's eps (DeepSeek-V3, gpt-oss)."""
  return {
    'norm.kind': 'rmsnorm',
    'norm.placement': 'pre',
    'norm.eps': float(hf['rms_norm_eps']),
    'norm.final_norm': True,
  }


def _gpt_oss(hf: dict) -> dict[str, Any]:
  """gpt-oss (OpenAI 2025, arXiv 2508.10925): attention with sinks and q/k/v/o biases, a window in
  the layers `layer_types` names (every other one), YaRN; every layer an MoE whose router has a
  bias, whose experts have biases and the clamped SwiGLU (mllm/layers/moe_hf.py). hidden_act is
  not read by its experts; router_aux_loss_coef only weighs transformers' training loss."""
  _refuse(hf, 'attention_dropout', lambda v: not v, '0.0')
  out = {
    **_sizes(hf, tied_by_default=False),
    **_windows_by_layer_types(hf),
    'embed_scale': 1.0,
    **_pre_rmsnorm(hf),
    'ffn.d_ff': hf['intermediate_size'],
    'ffn.match_params': False,
    'ffn.use_bias': True,
    'attention.use_bias': bool(hf.get('attention_bias', True)),
    'attention.qkv_bias': False,
    'attention.sinks': True,
    'attention.softmax_scale': None,
  }
  out.update(RotaryPositions.keys_from_hf(hf))
  out.update(moe_keys_from_hf(hf, 'gpt_oss'))
  return out


def config_overrides(hf: dict) -> dict[str, Any]:
  """mllm config keys (dotted) that make the model of this HF config, in float32."""
  check_quantization(hf)  # a method mllm cannot read is refused before anything is built
  family = family_of(hf)
  if family == 'gpt2':
    model = _gpt2(hf)
  elif family == 'gemma2':
    model = _gemma2(hf)
  elif family == 'deepseek_v3':
    model = _deepseek_v3(hf)
  elif family == 'gpt_oss':
    model = _gpt_oss(hf)
  else:
    model = _llama_like(hf, family)
  out = {f'model.{k}': v for k, v in model.items()}
  out.update(
    {
      'model.dtype': 'float32',
      'model.param_dtype': 'float32',
      'model.dropout': 0.0,
      'model.embed_dropout': 0.0,
      'model.attention.dropout': 0.0,
      # A fine-tune's rate as given, not scaled from the default config's width.
      'model.parametrization.standard.lr_base_d_model': None,
      'data.seq_len': model['max_seq_len'],
    }
  )
  return out
