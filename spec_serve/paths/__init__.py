"""Reply paths: the ways a reply's bytes travel from a worker to the client that asked (frames over
ZeroMQ, the same-host plane, an NCCL pair group), one folder each."""
