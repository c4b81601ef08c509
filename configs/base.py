"""The base config: every key mllm reads, with its default. Named configs start from it.

    python launch.py --config=configs/base.py:pos=alibi,ffn=geglu,norm=layernorm,placement=post
    python launch.py --config=configs/base.py --config.model.n_layers=2

`arg` is a comma-separated list of choices: the short names pos, ffn, norm, placement, attn, window,
rope_scaling; any dotted path (model.n_layers=2); or any leaf name or tail of a path that is unique
(n_kv_heads=2, t5.num_buckets=64).
The keys, their defaults and what each does: mllm/config_schema.py.
"""

from mllm.config_schema import get_config

__all__ = ['get_config']
