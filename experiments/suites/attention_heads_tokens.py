"""Diagnosis of the `attention_heads` suite's GQA-2 row (worse than MHA at 1 M tokens after
per-variant lr tuning, where Ainslie et al. 2023, Table 1 and Fig. 6, put GQA with a few groups on
par with MHA): MHA and GQA-2 trained 4x longer (4 M tokens, ~5 tokens per parameter), evaluated
every 250 steps, so loss_vs_tokens.png shows whether sharing K/V heads costs less as training goes
on (a token-budget effect: the papers train for billions of tokens) or keeps its cost. Both rates
are tuned again at this budget (retune_lr), around the ones the `attention_heads` suite tuned at 1 M
tokens (lr_from): a rate tuned for a quarter of the budget could favour either row. (MQA, whose
direction agrees with its paper, is left out to fit the 2-core budget.)"""

from experiments.suites import attention_heads
from experiments.suites._longer import longer_copy

SUITE = longer_copy(
  attention_heads.SUITE,
  name='attention_heads_tokens',
  description='MHA vs GQA-2 over 4x the tokens, eval loss against tokens',
  keep=('MHA', 'GQA-2'),
  retune_lr=('MHA', 'GQA-2'),
)
