"""How bytes move: the socket factory, host buffers, ingress limits, the same-host plane, NCCL pairs."""
