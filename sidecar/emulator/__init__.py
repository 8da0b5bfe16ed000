"""emulator layer (see DESIGN.md §2)."""
