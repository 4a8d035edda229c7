"""The supervision cache: capture a row once, serve it every epoch (docs/cache.md).

``RemoteTargetModel(cache=DIR)`` puts a ``front.CacheFront`` in front of the client's ordinary batch
path; ``spec-serve capture`` fills ``DIR`` offline, ``spec-serve cache stats|verify|prune`` inspect and
trim it. Modules: ``rows`` (a row's key, span and stored form), ``entry`` (an entry's bytes and
digest), ``store`` (the directory: segments, index, eviction), ``front`` (a client's hits, misses and
writes), ``capture`` and ``admin`` (the commands' bodies).
"""
