"""How the model computes, and how it runs: runner.py decides (device, dtypes, kernels), decoder.py and its
layers compute any family, weights/ reads them, quant/ keeps them quantized, native/ builds the CPU kernels."""
