"""Pictures drawn from scheduler traces (matplotlib, no screen needed)."""
