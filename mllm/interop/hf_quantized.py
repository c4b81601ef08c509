"""Quantized Hugging Face checkpoints mllm reads: gpt-oss's MXFP4 experts.

The hub's gpt-oss checkpoints (OpenAI 2025, arXiv 2508.10925, sec. 2.3) store each expert stack in
MXFP4 (the OCP Microscaling format, v1.0, sec. 5.3: 4-bit E2M1 values in blocks of 32 sharing
one E8M0 power-of-two scale): `<name>_blocks` [E, rows, G, 16] uint8, two values a byte, the low
nibble first, and `<name>_scales` [E, rows, G] uint8, the block's exponent + 127; the 32 values
of a block run along the float weight's input axis. mllm dequantizes them to float32 as it
reads them (`dequantize_mxfp4`), so the model holds the checkpoint's exact values; a float
(`save_pretrained` after a dequantizing load) checkpoint reads as before. Other quantization
methods are refused in one line (`check_quantization`).
"""

from __future__ import annotations

import numpy as np

from mllm.hf_errors import HFImportError

MXFP4 = 'mxfp4'
# The 16 E2M1 values by their 4-bit code (OCP MX v1.0, Table 5): sign bit, 2 exponent bits, 1
# mantissa bit.
E2M1_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)
BLOCKS, SCALES = '_blocks', '_scales'


def check_quantization(hf: dict) -> str | None:
  """The checkpoint's quantization method ('mxfp4' or None: float); any other is an
  HFImportError."""
  quantization = hf.get('quantization_config')
  if not quantization:
    return None
  method = quantization.get('quant_method')
  if method != MXFP4:
    raise HFImportError(
      f'quantization_config.quant_method={method!r}: mllm reads float checkpoints and MXFP4 '
      f"experts (gpt-oss); allowed: {MXFP4!r}, or the checkpoint saved again after a "
      'dequantizing load'
    )
  return method


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """An MXFP4 stack as float32: blocks [..., rows, G, 16] uint8 and scales [..., rows, G] uint8
  → [..., G·32, rows], each value E2M1(code) · 2^(scale − 127) (the float layout: input axis
  before output axis)."""
  if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
    raise HFImportError(
      f'MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales '
      f'{scales.dtype}{list(scales.shape)}; allowed: uint8 blocks [..., G, 16] and uint8 '
      'scales [..., G]'
    )
  values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)
  values[..., 0::2] = E2M1_VALUES[blocks & 0x0F]
  values[..., 1::2] = E2M1_VALUES[blocks >> 4]
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)


def packed_pairs(names) -> dict[str, tuple[str, str]]:
  """{float name: (its blocks' name, its scales' name)} of the MXFP4 stacks among `names`."""
  names = set(names)
  pairs = {}
  for name in names:
    if name.endswith(BLOCKS) and name[: -len(BLOCKS)] + SCALES in names:
      base = name[: -len(BLOCKS)]
      pairs[base] = (name, base + SCALES)
  return pairs
