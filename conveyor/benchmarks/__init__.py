"""The `conveyor bench` command: seeded workloads, peers through the same HTTP client, and the figures they print.

The repository's root bench/ folder holds the scripts run by path instead: peer set-ups, random-weight GGUF
files at real model sizes, and one-off experiments."""
