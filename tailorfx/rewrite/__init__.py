"""The IR layer: capture, analyses, the memory model and the pass machinery."""
