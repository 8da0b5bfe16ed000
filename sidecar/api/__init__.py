"""api layer (see DESIGN.md §2)."""
