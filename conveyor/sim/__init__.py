"""The simulator: the real scheduler and KV managers on a virtual clock, priced by a roofline cost model (no torch)."""
