"""GPT-2-style: learned absolute positions, GELU FFN, LayerNorm pre-LN, biases everywhere, MHA."""

from configs import base
from mllm.config import join_choices

DEFAULTS = (
  'pos=learned,ffn=gelu,norm=layernorm,placement=pre,'
  'model.ffn.use_bias=true,model.attention.use_bias=true,model.norm.eps=1e-5'
)


def get_config(arg: str | None = None):
  return base.get_config(join_choices(DEFAULTS, arg))
