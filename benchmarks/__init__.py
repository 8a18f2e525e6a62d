"""GPU benchmark harness for vjpforge's generated kernels (``python -m benchmarks.run``)."""
