"""The FFN activations of 2021-26 against GELU at matched parameters, each at its own tuned
learning rate: ReLU² (Primer, So et al. 2021, sec. 3 and Fig. 2: ahead of GELU; modded-nanogpt's
FFN) and the tanh GeGLU of Gemma, beside ReLU and SwiGLU (`ffn`'s rows, again here so the four are
paired on one set of seeds). Defined and planned; not run yet."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

SUITE = Suite(
  name='ffn_2024',
  description='GELU vs ReLU² (Primer), tanh GeGLU (Gemma), ReLU and SwiGLU at matched parameters, '
  'each at its own learning rate',
  base='configs/base.py:pos=rope,norm=rmsnorm,placement=pre',
  variants=(
    Variant('gelu', 'ffn=gelu'),
    Variant('relu2', 'ffn=relu2', expect='better'),
    Variant('geglu_tanh', 'ffn=geglu_tanh', expect='better'),
    Variant('relu', 'ffn=relu', expect='worse'),
    Variant('swiglu', 'ffn=swiglu', expect='better'),
  ),
  presets=PRESETS,
  extra_metrics='decode',  # each row's decode tokens/s and KV-cache bytes per token
  paper_source='So et al. 2021 (Primer: squared ReLU ahead of GELU at equal parameters); '
  'Shazeer 2020 (GeGLU and SwiGLU ahead, ReLU behind GELU)',
)
