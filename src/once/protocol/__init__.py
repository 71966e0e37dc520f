"""Pure data shared by all layers; imports nothing else from once."""
