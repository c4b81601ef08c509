"""Building blocks of the transformer, one concept per file, each variant in a name → class registry."""


def resolved_head_dim(model_cfg) -> int:
  """`model.head_dim`, or d_model // n_heads when it is unset."""
  return model_cfg.head_dim or model_cfg.d_model // model_cfg.n_heads


def rotary_head_dim(model_cfg) -> int:
  """The dims of each head RoPE rotates in (before `rope.fraction`): the head, or under MLA its
  decoupled RoPE part, `attention.mla.rope_head_dim` (None: head_dim // 2, DeepSeek-V2's d_R)."""
  if model_cfg.attention.kind == 'mla':
    return model_cfg.attention.mla.rope_head_dim or resolved_head_dim(model_cfg) // 2
  return resolved_head_dim(model_cfg)


# The MoE registers itself as the FFN kind 'moe' (ffn.FFNS; moe.py imports ffn.py, so ffn.py cannot
# import it): imported here, so FFNS is the same whichever module of the package comes first.
# Likewise MLA, the attention kind 'mla' (attention.ATTENTIONS; mla.py subclasses attention.py's).
from mllm.layers import mla as _mla  # noqa: E402, F401
from mllm.layers import moe as _moe  # noqa: E402, F401
