"""attention: exact context-parallel attention over packed variable-length documents."""
