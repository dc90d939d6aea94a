#!/usr/bin/env python
"""Scheduler-side cost benchmark: see pd_connector/dev/benchmarks/scheduler.py (`--help`)."""
import sys; from pd_connector.dev.benchmarks.scheduler import main; sys.exit(main(sys.argv[1:]))  # noqa: E702
