"""The scheduler -> worker messages of pd_connector.engine.metadata (no Scheduler needed, but the
module's task types take vLLM's base classes where vLLM is installed: not a unit test)."""

from pd_connector.core.params import LeaseRef
from pd_connector.engine.metadata import ExtendTask, extend_tasks


def test_extensions_are_grouped_one_message_per_prefill_peer_in_first_seen_order():
    targets = [("h1", 1, "a"), ("h2", 1, "b"), ("h1", 1, "c"), ("h1", 2, "d")]
    refs = [LeaseRef("e", host, port, rid) for host, port, rid in targets]
    assert extend_tasks(refs) == [
        ExtendTask("h1", 1, 1, ["a", "c"]),
        ExtendTask("h2", 1, 1, ["b"]),
        ExtendTask("h1", 2, 1, ["d"]),
    ]
    assert extend_tasks([]) == []
