"""Quantized weights: the GGUF block formats decoded exactly and packed into the kernels' tiles (formats.py,
k_quants.py), the projections that run them (linear.py), and which kernel runs each shape on this machine
(kernel_choice.py for float weights, dot_choice.py for quantized ones)."""
