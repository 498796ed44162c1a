"""tailorfx."""
