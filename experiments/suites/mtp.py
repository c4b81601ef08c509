"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437, sec. 2.2: one extra depth, its loss
weighted 0.3 then 0.1) against next-token training alone, each at its own tuned learning rate, the
next-token eval loss compared. Gloeckle et al. 2024 (arXiv 2404.19737) find that multi-token
prediction hurts small models and helps large ones: expected worse at this size. Run 2026-12-02
(3 seeds, 1 M tokens; next-token's runs copied from `ffn_2024`'s gelu row, the same configuration):
the extra depth is ahead, −0.030 [−0.058, −0.002] (within noise project-wide), at the same tuned
rate; unexplained: Gloeckle et al. measure code benchmarks after training 4 parallel heads, not
the next-token loss with DeepSeek-V3's one sequential depth."""

from experiments import diagnosis
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU

_DIAGNOSES = {
  'mtp': diagnosis.unexplained(
    diagnosis.rates_tuned('mtp', 'next_token'),
    not_ruled_out="the measure (Gloeckle et al.'s small models lose on MBPP and HumanEval with 4 "
    "parallel heads; this is the next-token loss with DeepSeek-V3's one sequential depth, which "
    "DeepSeek-V3's ablations find ahead), the depth's own parameters (+230k, 27%, trained only), "
    'the token budget (1.2 tokens/param)',
    rests_on='mtp: eval loss − next_token per seed',
  ),
}

SUITE = Suite(
  name='mtp',
  description='next-token training vs one multi-token-prediction depth (DeepSeek-V3), each at its '
  'own learning rate, on the next-token loss',
  base='configs/base.py',
  variants=(
    Variant('next_token'),
    Variant('mtp', overrides={'model.multi_token_prediction': True}, expect='worse'),
  ),
  presets=PRESETS_CPU_GELU,
  extra_metrics='decode',  # each row's decode tokens/s and KV-cache bytes per token
  diagnoses=_DIAGNOSES,
  paper_source='Gloeckle et al. 2024 (multi-token prediction hurts small models, helps large ones); '
  'DeepSeek-V3 (one depth, weight 0.3 then 0.1)',
)
