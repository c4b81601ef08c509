"""The MoE layer's Hugging Face mapping (the layer is moe.py): Mixtral's and Qwen3-MoE's
config.json expert fields ↔ `model.ffn.moe.*`, and the MoE settings HF export compares (`moe_math`)."""

from __future__ import annotations

from typing import Any

from mllm.hf_errors import HFImportError, refuse
from mllm.layers.moe import expert_hidden_dim, moe_layers


def moe_keys_from_hf(hf: dict, family: str) -> dict[str, Any]:
  """Mixtral: every layer sparse, experts of intermediate_size; Qwen3-MoE: decoder_sparse_step,
  mlp_only_layers (a leading run only), moe_intermediate_size, norm_topk_prob."""
  refuse(hf, 'router_jitter_noise', lambda v: not v, '0 (mllm has no jitter noise)')
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
    'ffn.moe.num_experts': experts,
    'ffn.moe.top_k': hf['num_experts_per_tok'],
    'ffn.moe.expert.kind': 'swiglu',
    'ffn.moe.expert_d_ff': expert_d_ff,
    'ffn.moe.num_shared_experts': 0,
    'ffn.moe.every': every,
    'ffn.moe.first_dense_layers': first_dense,
    'ffn.moe.router': 'softmax',
    'ffn.moe.renormalize': renormalize,
    'ffn.moe.noise': 'none',
    'ffn.moe.expert_bias': False,
    # Dropless: capacity dispatch drops tokens, transformers never does.
    'ffn.moe.dispatch': 'dropless',
    'ffn.moe.grouped_matmul': 'ragged_dot',
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
  return {}


def moe_math(m) -> dict[str, Any]:
  """The MoE settings that change the network, resolved, for HF export's `math_of`."""
  moe = m.ffn.moe
  return {
    'ffn.moe.num_experts': moe.num_experts,
    'ffn.moe.top_k': moe.top_k,
    'ffn.moe.expert.kind': moe.expert.kind,
    'ffn.moe.expert_d_ff': expert_hidden_dim(m),
    'ffn.moe.num_shared_experts': moe.num_shared_experts,
    'ffn.moe.layers': moe_layers(m),
    'ffn.moe.router': moe.router,
    'ffn.moe.renormalize': bool(moe.renormalize),
    'ffn.moe.expert_bias': bool(moe.expert_bias),
  }
