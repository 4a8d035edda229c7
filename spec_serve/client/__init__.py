"""The client: ``RemoteTargetModel`` and what it raises; its I/O thread, retries and assembly.

``from spec_serve.client import RemoteTargetModel`` is the public import; the names below are the
package's public surface. A request's path: ``api`` (RemoteTargetModel prepares it) -> ``io_thread``
(the sockets) -> ``pending`` (waiting, retries) -> ``worker_replies`` (what workers send back) ->
``assembly`` (the caller's tensors), checked by ``integrity``.
"""

from spec_serve.client.api import RemoteTargetModel
from spec_serve.client.errors import BrokerUnreachable, IntegrityError, RemoteError, TargetChangedError
from spec_serve.client.stats import ClientStats
from spec_serve.transport.sockets import Security

__all__ = ["BrokerUnreachable", "ClientStats", "IntegrityError", "RemoteError", "RemoteTargetModel", "Security",
           "TargetChangedError"]
