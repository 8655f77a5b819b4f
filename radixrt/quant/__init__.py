"""Quantized weights: GGUF block formats and the arithmetic their linear layers compute."""
