"""How bytes move between processes: the one socket factory and its security (sockets.py), ingress limits
(ingress.py, bounded.py), connection watching (connwatch.py) and the HTTP shim; the reply paths live in
spec_serve/paths."""
