#!/usr/bin/env python
"""Scheduler-side cost benchmark: see pd_connector/benchmarks/scheduler.py (`--help`)."""
import sys; from pd_connector.benchmarks.scheduler import main; sys.exit(main(sys.argv[1:]))  # noqa: E702
