"""The machine under the engine: what the CPU can run (cpu.py) and where files are cached (cache_dir.py).

Torch-free: the engine, the model runner, the simulator and the benchmarks all ask here.
"""
