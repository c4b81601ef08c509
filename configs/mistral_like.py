"""Mistral-style: RoPE, SwiGLU, RMSNorm, GQA (8 heads, 2 KV heads) and a sliding window (here 64)."""

from configs import base
from mllm.config import join_choices

DEFAULTS = (
  'pos=rope,ffn=swiglu,norm=rmsnorm,placement=pre,n_kv_heads=2,window=64,model.norm.eps=1e-5'
)


def get_config(arg: str | None = None):
  return base.get_config(join_choices(DEFAULTS, arg))
