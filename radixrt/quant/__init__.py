"""Quantized weights: GGUF block formats (``formats``), GGUF files as model sources
(``gguf_model``), and the arithmetic the quantized linear kernels share (``reference``)."""
