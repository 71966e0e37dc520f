"""agent layer (see DESIGN.md); built by a later issue."""
