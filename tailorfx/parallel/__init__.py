"""Layouts across ranks: tensor, sequence, pipeline and data parallelism (see docs/parallel.md)."""
