"""Llama-family layers, attention over block tables, and weight loading (GGUF, safetensors)."""
