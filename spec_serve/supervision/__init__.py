"""The supervision contract: names, shapes and dtypes, the EAGLE-3 math, draft vocabularies."""
