"""Public alias of the tensor codec, ``spec_serve.protocol.wire``: ``from spec_serve import wire`` keeps working."""

from spec_serve.protocol.wire import *  # noqa: F401,F403  (the codec's __all__)
from spec_serve.protocol.wire import __all__  # noqa: F401
