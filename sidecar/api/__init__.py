"""api layer (see docs/design.md §2)."""
