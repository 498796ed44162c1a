"""Runtime code that rewritten graphs call: opaque custom ops, kernels and measurement helpers."""
