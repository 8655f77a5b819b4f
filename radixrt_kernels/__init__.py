"""radixrt's kernels, by where they run; no scheduler or model imports.

- :mod:`radixrt_kernels.triton`: the Triton kernels of the attention path (store K/V, extend
  and decode attention) and their pure-torch references;
- :mod:`radixrt_kernels.cpu`: the C kernels (sources, built on first use) and their Python
  wrappers, one wrapper module per concern.
"""
