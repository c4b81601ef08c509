"""Building blocks of the transformer, one concept per file, each variant in a name → class registry."""


def resolved_head_dim(model_cfg) -> int:
  """`model.head_dim`, or d_model // n_heads when it is unset."""
  return model_cfg.head_dim or model_cfg.d_model // model_cfg.n_heads


# The MoE registers itself as the FFN kind 'moe' (ffn.FFNS; moe.py imports ffn.py, so ffn.py cannot
# import it): imported here, so FFNS is the same whichever module of the package comes first.
from mllm.layers import moe as _moe  # noqa: E402, F401
