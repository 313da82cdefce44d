"""Examples that use txmq end to end (run from the repository root)."""
