"""Qwen3-style: RoPE (θ = 1e6), SwiGLU, RMSNorm with QK-norm, GQA (8 heads, 2 KV heads)."""

from configs import base
from mllm.config import join_choices

DEFAULTS = (
  'pos=rope,ffn=swiglu,norm=rmsnorm,placement=pre,n_kv_heads=2,'
  'model.attention.qk_norm=true,model.position.rope.theta=1000000.0'
)


def get_config(arg: str | None = None):
  return base.get_config(join_choices(DEFAULTS, arg))
