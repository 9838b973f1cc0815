"""Model families over shared layers, attention over block tables, and weight loading (GGUF, safetensors)."""
