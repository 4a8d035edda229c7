"""Command line, demo, launcher, tiny target and benchmark: users of the runtime, never imported by it."""
