"""The sections of benchmarks/gpu_check.py: one module each, sharing the recorder in record.py."""
