"""Benchmarks, run from a checkout: ``python -m benchmarks NAME [options]`` calls
``benchmarks.NAME.main(argv)`` (``python -m benchmarks`` lists them).

Measurements, not tests: each prints a table and writes JSON plus a PNG plot, every figure
measured in the same run as its baselines. No timed assertions anywhere. They run P/D on the
rig (``rig/``: tiny models, servers, synthetic TP ranks); the figures and how they were taken
are in docs/benchmarks.md.
"""
