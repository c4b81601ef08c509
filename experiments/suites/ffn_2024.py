"""The FFN activations of 2021-26 against GELU at matched parameters, each at its own tuned
learning rate: ReLU² (Primer, So et al. 2021, sec. 3 and Fig. 2: ahead of GELU; modded-nanogpt's
FFN) and the tanh GeGLU of Gemma, beside ReLU and SwiGLU (`ffn`'s rows, again here so the four are
paired on one set of seeds). Run 2026-12-02 (3 seeds, 1 M tokens: early training, 1.2 tokens/param):
GELU ahead of all four; ReLU² +0.052 and tanh GeGLU +0.054 behind it (both contradict their
papers, unexplained: the rates are tuned, the budget is not ruled out), ReLU +0.061 behind as
expected, SwiGLU +0.041 within noise."""

from experiments import diagnosis
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

# Primer's and Shazeer's gains were measured at 10-100x these tokens per parameter; `ffn` and
# `ffn_tokens` saw the GLUs' rank move with the budget. Recomputed on every report.
_BUDGET = 'the token budget (1.2 tokens/param: early training), the model\'s width (d_model 128)'
_DIAGNOSES = {
  'relu2': diagnosis.unexplained(
    diagnosis.rates_tuned('ffn_2024', 'gelu'),
    not_ruled_out=_BUDGET,
    rests_on='ffn_2024: eval loss − gelu per seed',
  ),
  'geglu_tanh': diagnosis.unexplained(
    diagnosis.rates_tuned('ffn_2024', 'gelu'),
    not_ruled_out=_BUDGET,
    rests_on='ffn_2024 and ffn: eval loss − gelu per seed',
    leads=(
      diagnosis.elsewhere('ffn', 'gelu', as_variant='geglu', where="as erf GEGLU in `ffn`'s seeds"),
    ),
  ),
}

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
  diagnoses=_DIAGNOSES,
  paper_source='So et al. 2021 (Primer: squared ReLU ahead of GELU at equal parameters); '
  'Shazeer 2020 (GeGLU and SwiGLU ahead, ReLU behind GELU)',
)
