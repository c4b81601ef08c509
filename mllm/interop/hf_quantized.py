"""Quantized Hugging Face checkpoints mllm reads, dequantized to float32 as they are read (the model
holds the checkpoint's exact values; a float checkpoint reads as before):

- MXFP4 (gpt-oss's hub experts; OpenAI 2025, arXiv 2508.10925, sec. 2.3; the OCP Microscaling
  format v1.0, sec. 5.3: 4-bit E2M1 values in blocks of 32 sharing one E8M0 power-of-two
  scale): `<name>_blocks` [E, rows, G, 16] uint8, two values a byte, the low nibble first, and
  `<name>_scales` [E, rows, G] uint8, the block's exponent + 127; the 32 values of a block run
  along the float weight's input axis (`dequantize_mxfp4`).
- Fine-grained FP8 (DeepSeek-V3, arXiv 2412.19437, sec. 3.3.2; the Qwen3-FP8 checkpoints): each
  linear weight [out, in] in float8 E4M3 beside `<weight>_scale_inv` [⌈out / b⌉, ⌈in / b⌉]
  float32, one multiplier per b × b block, b from `weight_block_size` (`dequantize_fp8`). Their
  `activation_scheme: dynamic` quantizes activations on the fly in FP8 kernels; mllm computes
  with the dequantized weights, as transformers does when it dequantizes.

Other methods and schemes are refused in one line (`check_quantization`).
"""

from __future__ import annotations

import numpy as np

from mllm.hf_errors import HFImportError

MXFP4, FP8 = 'mxfp4', 'fp8'
# The 16 E2M1 values by their 4-bit code (OCP MX v1.0, Table 5): sign bit, 2 exponent bits, 1
# mantissa bit.
E2M1_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)
BLOCKS, SCALES, SCALE_INV = '_blocks', '_scales', '_scale_inv'


def check_quantization(hf: dict) -> dict | None:
  """The checkpoint's quantization_config if mllm reads it (None: a float checkpoint); any
  other method or scheme is an HFImportError."""
  quantization = hf.get('quantization_config')
  if not quantization:
    return None
  method = quantization.get('quant_method')
  if method not in (MXFP4, FP8):
    raise HFImportError(
      f'quantization_config.quant_method={method!r}: mllm reads float checkpoints, MXFP4 '
      f"experts (gpt-oss) and fine-grained FP8 (DeepSeek-V3, Qwen3-FP8); allowed: {MXFP4!r}, "
      f"{FP8!r}, or the checkpoint saved again after a dequantizing load"
    )
  if method == FP8:
    settings = {
      'fmt': (quantization.get('fmt', 'e4m3'), ('e4m3',)),
      'activation_scheme': (quantization.get('activation_scheme', 'dynamic'), ('dynamic',)),
    }
    for key, (value, allowed) in settings.items():
      if value not in allowed:
        raise HFImportError(
          f'quantization_config.{key}={value!r}: allowed with fp8: {", ".join(allowed)}'
        )
    block = quantization.get('weight_block_size')
    if not (
      isinstance(block, list | tuple)
      and len(block) == 2
      and all(type(b) is int and b > 0 for b in block)
    ):
      raise HFImportError(
        f'quantization_config.weight_block_size={block!r}: allowed with fp8: [rows, columns] '
        'of each scale block, e.g. [128, 128]'
      )
  return quantization


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


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """A fine-grained FP8 weight as float32: weight [out, in] (E4M3 values) times its block's
  multiplier, scale_inv [⌈out / b_r⌉, ⌈in / b_c⌉], the last blocks cut at the edges."""
  rows, cols = weight.shape
  grid = (-(-rows // block[0]), -(-cols // block[1]))
  if scale_inv.shape != grid:
    raise HFImportError(
      f'an FP8 weight of shape {[rows, cols]} with weight_block_size {list(block)} needs '
      f'weight_scale_inv of shape {list(grid)}, the checkpoint gives {list(scale_inv.shape)}'
    )
  full = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], 0), block[1], 1)
  return weight.astype(np.float32) * full[:rows, :cols]


def packed_names(names, quantization: dict | None) -> dict[str, tuple[str, ...]]:
  """{float name: the stored names it is read from} of the quantized tensors among `names`."""
  names = set(names)
  method = (quantization or {}).get('quant_method')
  pairs = {}
  for name in names:
    if method == MXFP4 and name.endswith(BLOCKS) and name[: -len(BLOCKS)] + SCALES in names:
      base = name[: -len(BLOCKS)]
      pairs[base] = (name, base + SCALES)
    elif method == FP8 and name + SCALE_INV in names:
      pairs[name] = (name, name + SCALE_INV)
  return pairs


def dequantize(quantization: dict, *stored: np.ndarray) -> np.ndarray:
  """The float32 tensor that `stored` (packed_names' order) holds."""
  if quantization['quant_method'] == MXFP4:
    return dequantize_mxfp4(*stored)
  return dequantize_fp8(*stored, tuple(int(b) for b in quantization['weight_block_size']))
