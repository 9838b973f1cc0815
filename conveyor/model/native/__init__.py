"""The native CPU kernels: their C++ sources (csrc/) and the build that compiles them on first use (kernels.py)."""
