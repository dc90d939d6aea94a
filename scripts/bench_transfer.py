#!/usr/bin/env python
"""Transfer benchmark; see pd_connector/dev/benchmarks/transfer.py (or `pd-connector bench transfer`)."""
import sys; from pd_connector.dev.benchmarks.transfer import main; sys.exit(main())  # noqa: E702,E401
