"""A worker: serves one target replica's supervision to clients through the broker."""
