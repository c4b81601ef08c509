"""Mixtral-style: the Mistral config (RoPE, RMSNorm, GQA 8:2, window 64) with a mixture of 8 SwiGLU
experts in every layer, top-2 with the gates renormalised over the two (Jiang et al. 2024)."""

from configs import base
from mllm.config import join_choices

DEFAULTS = (
  'pos=rope,ffn=moe,norm=rmsnorm,placement=pre,n_kv_heads=2,window=64,'
  'model.norm.eps=1e-5,model.moe.num_experts=8,model.moe.top_k=2,'
  'model.moe.expert_kind=swiglu,model.moe.renormalize=true,model.moe.router=softmax'
)


def get_config(arg: str | None = None):
  return base.get_config(join_choices(DEFAULTS, arg))
