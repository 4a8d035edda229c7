"""NCCL: a reply's tensors over a private 2-rank group between a worker and the one client bound to it."""
