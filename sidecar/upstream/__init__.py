"""upstream layer (see DESIGN.md §2)."""
