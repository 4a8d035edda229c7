"""Reply paths that exist only for tests: each shows what adding a path takes (its folder, one line in
the registry's order, its tests)."""
