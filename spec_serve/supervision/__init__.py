"""The supervision contract: names, shapes and dtypes, the EAGLE-3 math, draft vocabularies, and how far a
batch computed in another batch composition may lie from the reference (tolerance.py)."""
