"""BLOOM-style: ALiBi biases instead of position embeddings, GELU FFN, LayerNorm pre-LN."""

from configs import base
from mllm.config import join_choices

DEFAULTS = 'pos=alibi,ffn=gelu,norm=layernorm,placement=pre'


def get_config(arg: str | None = None):
  return base.get_config(join_choices(DEFAULTS, arg))
