"""The headline FFN table (`ffn_4m`) again on English prose: the King James Bible
(`data.source='kjv'`, Debian's bible-kjv-text; 1.7 M training tokens under the cpu preset's BPE,
so 4 M tokens are 2.3 epochs), beside the Python code of every other table. Same rows, budget,
√2 retuning around `ffn`'s rates (tuned on code: the grid widens past an edge) and 5 paired
seeds, issue 60's headline protocol; evaluation over the whole validation split (18 chapters,
26 k tokens). It replicates the code table's ranking on another corpus, so it is sized to see the
gaps that table found (SwiGLU +0.156, GLU, Bilinear) rather than `ffn_4m`'s 0.03 target: with
`ffn_4m`'s noise (σ 0.0201 at its 13 seeds) 5 seeds see ±0.048 (`python -m experiments plan
ffn_4m_kjv --noise_from ffn_4m`, which flags the corpus as a difference; 12 would see 0.03 at 63
more runs, about 17 run-hours with tuning at the pace of `ffn_4m`'s runs on the AVX512-BF16
EPYC, 0.19 s a step)."""

from experiments.suites import ffn
from experiments.suites._longer import headline_copy

SUITE = headline_copy(
  ffn.SUITE,
  name='ffn_4m_kjv',
  description='the FFN variants at matched parameters over 4 M tokens of English prose (KJV)',
  seeds=5,
  overrides={'data.source': 'kjv'},
)
