"""The in-process Scheduler harness lives in ``pd_connector.dev.testing.scheduler_harness`` (the
scheduler benchmark uses it too); re-exported here for the tests' ``from harness import ...``."""

from pd_connector.dev.testing.scheduler_harness import (  # noqa: F401
    BLOCK,
    EOS,
    connector_half,
    finished_params,
    make_request,
    make_scheduler,
    run_step,
)
