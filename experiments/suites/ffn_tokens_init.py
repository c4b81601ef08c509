"""Diagnosis of SwiGLU's gap to ReLU at 4 M tokens (`ffn_tokens`: +0.158; replicated in PyTorch
from mllm's initial weights, +0.157): the same two rows under GPT-2's fixed N(0, 0.02) init
instead of fan_in, each rate tuned again at this budget (around the rate `ffn_tokens` chose, a √2
grid), 3 seeds. The lead: PyTorch's own N(0, 0.02) init at fan_in's rates cut the gap to about
+0.04 (benchmarks/results/ffn_replication-cpu.md), ReLU losing 0.05 and SwiGLU gaining 0.06. If
the gap is gone here too, with the rates tuned for this init, the initialisation is the cause;
if it returns, the lead was the rate's."""

from experiments.suites import ffn_tokens
from experiments.suites._longer import longer_copy

SUITE = longer_copy(
  ffn_tokens.SUITE,
  name='ffn_tokens_init',
  description='ReLU vs SwiGLU over 4 M tokens under the fixed N(0, 0.02) init, rates tuned again',
  keep=('relu', 'swiglu'),
  retune_lr=('relu', 'swiglu'),
  overrides={'model.init': 'fixed'},
  diagnoses_of='ffn',
)
