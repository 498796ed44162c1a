"""Turns rewritten graphs into things that run."""
