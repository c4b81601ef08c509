"""The headline FFN table (`ffn_4m`) again on English prose: the King James Bible
(`data.source='kjv'`, Debian's bible-kjv-text; 1.7 M training tokens under the cpu preset's BPE,
so 4 M tokens are 2.3 epochs), beside the Python code of every other table. Same rows, budget,
√2 retuning around `ffn`'s rates (tuned on code: the grid widens past an edge) and 10 paired
seeds; evaluation over the whole validation split (18 chapters, 26 k tokens)."""

from experiments.suites import ffn
from experiments.suites._longer import headline_copy

SUITE = headline_copy(
  ffn.SUITE,
  name='ffn_4m_kjv',
  description='the FFN variants at matched parameters over 4 M tokens of English prose (KJV)',
  seeds=10,
  overrides={'data.source': 'kjv'},
)
