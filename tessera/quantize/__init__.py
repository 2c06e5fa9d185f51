"""Quantized models out: torchao weight-only schemes applied to a trained model, written as an HF
directory that transformers' torchao integration loads, and read back by tessera (``api.load``)."""
