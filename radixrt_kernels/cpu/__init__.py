"""The CPU kernels: C sources built into one library on first use, and their Python wrappers.

Each wrapper beside the C file(s) it calls:
- :mod:`~radixrt_kernels.cpu.library`: builds and loads the library (``load``);
- :mod:`~radixrt_kernels.cpu.attention` (``attention.c``): attention through slot indices;
- :mod:`~radixrt_kernels.cpu.linear` (``linear_amx.c``, ``linear_vec.c``): bf16 linear layers
  on packed weights, by ISA;
- :mod:`~radixrt_kernels.cpu.quant` (``quant.c``, ``quant_x86.c``): linear layers on
  GGUF-quantized weights (row-invariant by construction);
- :mod:`~radixrt_kernels.cpu.elementwise` (``elementwise.c``): RMS norm, rotary embedding,
  SiLU-and-mul;
- :mod:`~radixrt_kernels.cpu.sampling_ops` (``sampling.c``): argmax and the grammar bitmask;
- :mod:`~radixrt_kernels.cpu.chain` (``chain.c``): several steps in one call.
The wrappers call the library ``library.load`` returns (passed in as ``lib``); none builds it.
"""
