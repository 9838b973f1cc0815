"""The torch-free core: requests, sampling parameters, KV-cache managers, schedulers and the step loop.

The real engine and the simulator both run this code unchanged; nothing here imports torch or numpy, and
nothing here knows of the model, the server or the benchmarks (``make test`` checks both with import-linter).
"""
