"""GLU Variants Improve Transformer (Shazeer 2020), Table 1: the eight FFNs at matched parameters
(gated FFNs get d_ff · 2/3), plus MoE top-2 at equal active parameters as a ninth row."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS
from mllm.layers.ffn import hidden_dim

# Table 1, log-perplexity on C4 after 65,536 steps (Shazeer 2020).
_PAPER = {
  'relu': 1.997,
  'gelu': 1.983,
  'swish': 1.994,
  'glu': 1.982,
  'bilinear': 1.960,
  'geglu': 1.942,
  'swiglu': 1.944,
  'reglu': 1.953,
}

SUITE = Suite(
  name='ffn',
  description='the FFN variants at matched parameters, and MoE top-2 at equal active params',
  base='configs/base.py:pos=rope,norm=rmsnorm,placement=pre',
  variants=tuple(
    Variant(kind, f'ffn={kind}', paper={'eval_loss': loss}) for kind, loss in _PAPER.items()
  )
  + (
    # Each expert half the dense SwiGLU's width: top-2 activates the dense FFN's parameters.
    Variant(
      'moe-top2',
      'ffn=moe',
      {'model.moe.num_experts': 4, 'model.moe.top_k': 2, 'model.moe.expert_kind': 'swiglu'},
      derived=lambda c: {
        'model.moe.expert_d_ff': hidden_dim(c.model.ffn, c.model.d_model, 'swiglu') // 2
      },
    ),
  ),
  refine_lr=('relu', 'glu'),
  presets=PRESETS,
  paper_source='Shazeer 2020, Table 1 (C4 log-perplexity, 65k steps)',
)
