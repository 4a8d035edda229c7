"""The client: ``RemoteTargetModel`` and what it raises; its I/O thread, retries and assembly.

``from spec_serve.client import RemoteTargetModel`` is the public import; the names below are the
package's public surface, defined in ``spec_serve.client.api``.
"""

from spec_serve.client.api import (
    BrokerUnreachable,
    ClientStats,
    IntegrityError,
    RemoteError,
    RemoteTargetModel,
    TargetChangedError,
)

__all__ = ["BrokerUnreachable", "ClientStats", "IntegrityError", "RemoteError", "RemoteTargetModel",
           "TargetChangedError"]
