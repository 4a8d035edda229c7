"""The same-host plane: a reply's bytes lent through memory both processes map (shared memory, CUDA IPC)."""
