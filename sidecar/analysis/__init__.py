"""analysis layer (see DESIGN.md §2)."""
