"""control layer (see DESIGN.md §2)."""
