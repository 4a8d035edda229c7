"""What travels between peers: commands and constants, typed messages, the tensor codec, digests."""
