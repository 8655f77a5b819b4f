"""Triton kernels of the attention path (store new K/V, extend (prefill) and decode attention)
and of the quantized linears.

Modules (each named after its kernel wrapper, or its two, so import from the module:
``from radixrt_kernels.triton.extend_attention import extend_attention``):
- :mod:`~radixrt_kernels.triton.store_kv`: ``store_kv`` writes new K/V rows at slots;
- :mod:`~radixrt_kernels.triton.extend_attention`: prefix + causal attention of new tokens;
- :mod:`~radixrt_kernels.triton.decode_attention`: split-KV flash decoding, one token per
  request;
- :mod:`~radixrt_kernels.triton.deterministic_attention`: decode and extend reducing every
  query over fixed key splits, so its bits do not depend on the batch or the forward mode;
- :mod:`~radixrt_kernels.triton.reference`: plain-torch twins of store and attention, for tests;
- :mod:`~radixrt_kernels.triton.quant_matmul`: ``quant_linear`` for weights in GGUF blocks, bit
  for bit ``radixrt.quant.arithmetic.linear`` (its reference); ``quantize_x``, ``quant_matmul``;
- :mod:`~radixrt_kernels.triton.quant_method`: ``TritonQuantLinear``, the quantized weights'
  linear method on a CUDA device.
Every wrapper checks its arguments and raises ``ValueError`` naming the bad one.
Set ``TRITON_INTERPRET=1`` before importing a kernel module to run on CPU (``INTERPRET``).
"""

from __future__ import annotations

from radixrt_kernels.triton._common import INTERPRET

__all__ = ["INTERPRET"]
