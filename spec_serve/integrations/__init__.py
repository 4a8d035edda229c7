"""Adapters that let other training stacks use spec-serve as their target backend."""
