"""integrations layer (see DESIGN.md §2)."""
