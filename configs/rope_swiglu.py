"""Llama-style: RoPE, SwiGLU, RMSNorm pre-LN, grouped-query attention (8 query heads, 2 KV heads)."""

from configs import base
from mllm.config import join_choices

DEFAULTS = 'pos=rope,ffn=swiglu,norm=rmsnorm,placement=pre,n_kv_heads=2'


def get_config(arg: str | None = None):
  return base.get_config(join_choices(DEFAULTS, arg))
