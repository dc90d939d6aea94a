"""Benchmarks (``pd-connector bench <name>`` calls ``pd_connector.dev.benchmarks.<name>.main(argv)``).

Measurements, not tests: each prints a table and writes JSON plus a PNG plot, every figure
measured in the same run as its baselines. No timed assertions anywhere.
"""
