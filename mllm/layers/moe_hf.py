"""The MoE layer's Hugging Face mapping (the layer is moe.py): Mixtral's and Qwen3-MoE's
config.json expert fields ↔ `model.ffn.moe.*`, and the MoE settings HF export compares (`moe_math`)."""

from __future__ import annotations

from typing import Any

from mllm.hf_errors import HFExportError, HFImportError, refuse
from mllm.layers.moe import expert_hidden_dim, moe_layers


def _deepseek_v3_keys(hf: dict) -> dict[str, Any]:
  """DeepSeek-V3's DeepSeekMoE (arXiv 2412.19437, sec. 2.1.2): sigmoid scores, the selection bias
  (e_score_correction_bias: mllm's expert_bias), group-limited top-k, gates normalised over the k
  and scaled, and one always-on shared MLP of n_shared_experts × moe_intermediate_size (the sum
  of that many experts, as one wider MLP), after first_k_dense_replace dense layers."""
  refuse(hf, 'norm_topk_prob', lambda v: v, "true (mllm's sigmoid router normalises its gates)")
  refuse(hf, 'n_shared_experts', lambda v: v and v >= 1, 'at least 1')
  groups = hf.get('n_group') or 1
  top_groups = hf.get('topk_group') or groups
  return {
    'ffn.moe.num_experts': hf['n_routed_experts'],
    'ffn.moe.top_k': hf['num_experts_per_tok'],
    'ffn.moe.expert_d_ff': hf['moe_intermediate_size'],
    'ffn.moe.num_shared_experts': 1,
    'ffn.moe.shared_d_ff': hf['moe_intermediate_size'] * hf['n_shared_experts'],
    'ffn.moe.every': 1,
    'ffn.moe.first_dense_layers': hf.get('first_k_dense_replace', 0),
    'ffn.moe.router': 'sigmoid',
    'ffn.moe.renormalize': True,
    'ffn.moe.routed_scale': float(hf.get('routed_scaling_factor', 1.0)),
    'ffn.moe.groups': groups,
    'ffn.moe.top_groups': None if top_groups == groups else top_groups,
    'ffn.moe.expert_bias': True,
  }


def _gpt_oss_keys(hf: dict) -> dict[str, Any]:
  """gpt-oss's MoE in every layer: the top k of the router's logits (with its bias), softmaxed
  over those k (the softmax over all experts renormalised over the k), experts with biases and
  the clamped SwiGLU of swiglu_alpha and swiglu_limit."""
  return {
    'ffn.moe.num_experts': hf.get('num_local_experts') or hf['num_experts'],
    'ffn.moe.top_k': hf['num_experts_per_tok'],
    'ffn.moe.expert.kind': 'clamped_swiglu',
    'ffn.moe.expert.clamped_swiglu.alpha': float(hf.get('swiglu_alpha', 1.702)),
    'ffn.moe.expert.clamped_swiglu.limit': float(hf.get('swiglu_limit', 7.0)),
    'ffn.moe.expert_d_ff': hf['intermediate_size'],
    'ffn.moe.num_shared_experts': 0,
    'ffn.moe.every': 1,
    'ffn.moe.first_dense_layers': 0,
    'ffn.moe.router': 'softmax',
    'ffn.moe.router_bias': True,
    'ffn.moe.renormalize': True,
    'ffn.moe.expert_bias': False,
  }


def moe_keys_from_hf(hf: dict, family: str) -> dict[str, Any]:
  """Mixtral: every layer sparse, experts of intermediate_size; Qwen3-MoE: decoder_sparse_step,
  mlp_only_layers (a leading run only), moe_intermediate_size, norm_topk_prob; DeepSeek-V3:
  `_deepseek_v3_keys`."""
  refuse(hf, 'router_jitter_noise', lambda v: not v, '0 (mllm has no jitter noise)')
  common = {
    'ffn.kind': 'moe',
    'ffn.moe.expert.kind': 'swiglu',
    'ffn.moe.noise': 'none',
    # Dropless: capacity dispatch drops tokens, transformers never does.
    'ffn.moe.dispatch': 'dropless',
    'ffn.moe.grouped_matmul': 'ragged_dot',
  }
  if family == 'deepseek_v3':
    return {**common, **_deepseek_v3_keys(hf)}
  if family == 'gpt_oss':
    return {**common, **_gpt_oss_keys(hf)}
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
    **common,
    'ffn.moe.num_experts': experts,
    'ffn.moe.top_k': hf['num_experts_per_tok'],
    'ffn.moe.expert_d_ff': expert_d_ff,
    'ffn.moe.num_shared_experts': 0,
    'ffn.moe.every': every,
    'ffn.moe.first_dense_layers': first_dense,
    'ffn.moe.router': 'softmax',
    'ffn.moe.renormalize': renormalize,
    'ffn.moe.expert_bias': False,
  }


def moe_hf_fields(m, family: str) -> dict[str, Any]:
  """The expert fields of model config `m` in `family`'s config.json (none outside MoE families)."""
  if family == 'mixtral':
    return dict(
      num_local_experts=m.ffn.moe.num_experts,
      num_experts_per_tok=m.ffn.moe.top_k,
      intermediate_size=expert_hidden_dim(m),
      router_jitter_noise=0.0,
    )
  if family == 'qwen3_moe':
    return dict(
      num_experts=m.ffn.moe.num_experts,
      num_experts_per_tok=m.ffn.moe.top_k,
      moe_intermediate_size=expert_hidden_dim(m),
      decoder_sparse_step=m.ffn.moe.every,
      mlp_only_layers=list(range(m.ffn.moe.first_dense_layers)),
      norm_topk_prob=bool(m.ffn.moe.renormalize),
    )
  if family == 'gpt_oss':
    # The clamp's section (at its defaults under another expert FFN, written as gpt-oss's:
    # check_exact then names the difference).
    clamp = m.ffn.moe.expert.clamped_swiglu
    return dict(
      num_local_experts=m.ffn.moe.num_experts,
      num_experts_per_tok=m.ffn.moe.top_k,
      intermediate_size=expert_hidden_dim(m),
      swiglu_alpha=float(clamp.alpha),
      swiglu_limit=float(clamp.limit),
      router_aux_loss_coef=float(m.ffn.moe.balance_coef),
    )
  if family == 'deepseek_v3':
    moe = m.ffn.moe
    if not moe.num_shared_experts:
      raise HFExportError(
        'model.ffn.moe.num_shared_experts=0: DeepseekV3ForCausalLM has a shared expert in each '
        'MoE layer; allowed: 1 or more'
      )
    # One shared MLP n_shared_experts × moe_intermediate_size wide: mllm's shared experts of
    # shared_d_ff each, summed, are that MLP when shared_d_ff is a multiple of the experts' size.
    shared = (moe.shared_d_ff or expert_hidden_dim(m)) * moe.num_shared_experts
    return dict(
      n_routed_experts=moe.num_experts,
      num_experts_per_tok=moe.top_k,
      moe_intermediate_size=expert_hidden_dim(m),
      n_shared_experts=shared // expert_hidden_dim(m),
      first_k_dense_replace=moe.first_dense_layers,
      norm_topk_prob=True,
      routed_scaling_factor=float(moe.routed_scale),
      n_group=moe.groups,
      topk_group=moe.top_groups or moe.groups,
    )
  return {}


def moe_math(m) -> dict[str, Any]:
  """The MoE settings that change the network, resolved, for HF export's `math_of`."""
  moe = m.ffn.moe
  return {
    'ffn.moe.num_experts': moe.num_experts,
    'ffn.moe.top_k': moe.top_k,
    'ffn.moe.expert.kind': moe.expert.kind,
    # The experts' FFN's own settings (gpt-oss's clamp), resolved.
    'ffn.moe.expert.settings': moe.expert[moe.expert.kind].to_dict()
    if moe.expert.kind in moe.expert
    else None,
    'ffn.moe.router_bias': bool(moe.router_bias),
    'ffn.moe.expert_d_ff': expert_hidden_dim(m),
    'ffn.moe.num_shared_experts': moe.num_shared_experts,
    'ffn.moe.shared_d_ff': (moe.shared_d_ff or expert_hidden_dim(m))
    if moe.num_shared_experts
    else 0,
    'ffn.moe.layers': moe_layers(m),
    'ffn.moe.router': moe.router,
    'ffn.moe.renormalize': bool(moe.renormalize),
    'ffn.moe.expert_bias': bool(moe.expert_bias),
    'ffn.moe.routed_scale': moe.routed_scale,
    'ffn.moe.groups': moe.groups,
    'ffn.moe.top_groups': moe.top_groups if moe.top_groups != moe.groups else None,
  }
