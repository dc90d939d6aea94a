#!/usr/bin/env python
"""End-to-end benchmark (pd_connector vs NixlConnector): see pd_connector/dev/benchmarks/e2e.py (`--help`)."""
import sys; from pd_connector.dev.benchmarks.e2e import main; sys.exit(main(sys.argv[1:]))  # noqa: E702
