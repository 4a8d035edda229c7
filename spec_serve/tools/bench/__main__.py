"""``python -m spec_serve.tools.bench``: see command.py."""

from spec_serve.tools.bench.command import main

main()
