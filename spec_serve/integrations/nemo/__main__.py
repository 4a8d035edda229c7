"""``python -m spec_serve.integrations.nemo CONFIG.yaml``: NeMo's EAGLE-3 recipe with spec-serve as its target."""

import sys

from spec_serve.integrations.nemo.recipe import main

sys.exit(main())
