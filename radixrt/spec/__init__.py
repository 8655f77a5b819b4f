"""Speculative decoding drafted from the radix tree (``speculative_algorithm="NGRAM"``)."""
