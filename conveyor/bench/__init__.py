"""Benchmarks: seeded workloads, and the figures they print."""
