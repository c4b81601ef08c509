"""The same weights in Hugging Face transformers' LlamaForCausalLM: the baseline of
`benchmarks/decode.py`'s comparison with `generate()`.

Only for benchmarks (transformers and torch are not dependencies of mllm; `pip install
torch transformers`). Handles exactly the Llama shape of configs/rope_swiglu.py: RoPE in the
'half' layout (HF's rotate_half), RMSNorm pre-LN, SwiGLU, no biases, tied embeddings, no scan.
mllm's kernels are [in, ..., out] (einsum layouts); PyTorch's Linear weights are [out, in].
"""

from __future__ import annotations

import numpy as np
import torch
from flax import nnx
from transformers import LlamaConfig, LlamaForCausalLM

from mllm.layers.ffn import hidden_dim


def check_llama_shaped(cfg) -> None:
  """ValueError unless `cfg` (a model config) is what this export maps one to one."""
  wanted = {
    'position.kind': 'rope',
    'position.rope.layout': 'half',
    'position.rope.scaling.kind': 'none',
    'ffn.kind': 'swiglu',
    'norm.kind': 'rmsnorm',
    'norm.placement': 'pre',
    'tie_embeddings': True,
    'scan_layers': False,
    'attention.use_bias': False,
    'attention.qk_norm': False,
    'attention.sliding_window': None,
    'ffn.use_bias': False,
  }
  for key, value in wanted.items():
    got = cfg
    for part in key.split('.'):
      got = got[part]
    if got != value:
      raise ValueError(f'model.{key}={got!r}: the HF Llama export needs {value!r}')


def hf_config(cfg) -> LlamaConfig:
  head_dim = cfg.d_model // cfg.n_heads if cfg.head_dim is None else cfg.head_dim
  return LlamaConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.d_model,
    intermediate_size=hidden_dim(cfg.ffn, cfg.d_model),
    num_hidden_layers=cfg.n_layers,
    num_attention_heads=cfg.n_heads,
    num_key_value_heads=cfg.n_kv_heads,
    head_dim=head_dim,
    max_position_embeddings=cfg.max_seq_len,
    rms_norm_eps=cfg.norm.eps,
    rope_theta=cfg.position.rope.theta,
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    hidden_act='silu',
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
  )


def _t(x) -> torch.Tensor:
  return torch.from_numpy(np.array(x, dtype=np.float32))


def to_hf_llama(model: nnx.Module, cfg) -> LlamaForCausalLM:
  """A float32 LlamaForCausalLM (eval mode, sdpa attention) holding `model`'s weights."""
  check_llama_shaped(cfg)
  hf = LlamaForCausalLM(hf_config(cfg)).to(torch.float32).eval()
  d = cfg.d_model
  weights = {
    'model.embed_tokens.weight': _t(model.embed.embedding[...]),
    'model.norm.weight': _t(model.final_norm.scale[...]),
  }
  for i, block in enumerate(model.blocks):
    att, ffn, p = block.attention, block.ffn, f'model.layers.{i}.'
    weights.update(
      {
        p + 'self_attn.q_proj.weight': _t(att.query.kernel[...].reshape(d, -1).T),
        p + 'self_attn.k_proj.weight': _t(att.key.kernel[...].reshape(d, -1).T),
        p + 'self_attn.v_proj.weight': _t(att.value.kernel[...].reshape(d, -1).T),
        p + 'self_attn.o_proj.weight': _t(att.out.kernel[...].reshape(-1, d).T),
        p + 'mlp.gate_proj.weight': _t(ffn.gate.kernel[...].T),
        p + 'mlp.up_proj.weight': _t(ffn.up.kernel[...].T),
        p + 'mlp.down_proj.weight': _t(ffn.down.kernel[...].T),
        p + 'input_layernorm.weight': _t(block.attention_norm.scale[...]),
        p + 'post_attention_layernorm.weight': _t(block.ffn_norm.scale[...]),
      }
    )
  missing, unexpected = hf.load_state_dict(weights, strict=False)
  missing = [m for m in missing if m != 'lm_head.weight']  # tied to the embedding
  if missing or unexpected:
    raise ValueError(f'HF Llama export: missing {missing}, unexpected {unexpected}')
  hf.tie_weights()
  return hf
