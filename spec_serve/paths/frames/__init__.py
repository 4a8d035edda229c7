"""Frames: a reply's bytes as safetensors frames over the worker's ZeroMQ data socket."""
