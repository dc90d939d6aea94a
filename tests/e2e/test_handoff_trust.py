"""D acts only on handoffs P issued (docs/security.md), end to end on vLLM CPU servers.

With a shared secret (the sealed stack): params rewritten in transit, one field at a time, are
refused before D opens any connection to the address they name (a listener standing in for a
client's "P" sees none), D answers as aggregated serving and loads nothing from them.
Without a secret: a P host off D's allow-list is refused the same way. Negative control: the
same params unedited are loaded (D's own count of transferred tokens grows by R).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rig.cpu_matrix import E2E_SECRET, random_prompt
from rig.oracle import compare

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
EXTERNAL = ("vllm:prompt_tokens_by_source", {"source": "external_kv_transfer"})


class Listener:
    """A TCP listener standing in for a "P" a client chose: counts the connections it gets."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.2)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def listener():
    lst = Listener()
    yield lst
    lst.close()


def metric(server, name, labels=None) -> float:
    return server.metric(name, labels) or 0.0


def event(server, name: str) -> float:
    return metric(server, "vllm:pd_events_total", {"event": name})


def wait_for(read, target, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while read() < target:
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def edits(listener: Listener) -> dict:
    """One field of P's params at a time, as a client or router could rewrite it."""
    return {
        "p_port": lambda p: {**p, "remote_port": listener.port},
        "p_host_and_port": lambda p: {**p, "remote_host": listener.host, "remote_port": listener.port},
        "engine": lambda p: {**p, "remote_engine_id": "a-p-the-client-runs"},
        "block_ids": lambda p: {**p, "remote_block_ids": [ids[::-1] for ids in p["remote_block_ids"]]},
        "resume_point": lambda p: {**p, "replay_offset": p["replay_offset"] - 1, "remote_num_tokens": p["remote_num_tokens"] - 1},
        "checkpoints": lambda p: {**p, "pd_checkpoints": {"version": 1, "states": [{"position": 32, "block_ids": [[], [1]]}]}},
        "seal_dropped": lambda p: {k: v for k, v in p.items() if k != "pd_handoff_seal"},
    }


def test_sealed_params_rewritten_in_transit_are_refused_before_any_contact(stack, listener):
    if stack.kind not in E2E_SECRET:
        pytest.skip("runs on the stack whose P and D share a secret")
    d = stack.decode
    for case, edit in edits(listener).items():
        prompt = random_prompt(90, seed=400 + len(case))
        params = stack.prefill_only(prompt)
        assert params.get("pd_handoff_seal"), params
        refused, loaded = event(d, "refused:unauthenticated"), metric(d, *EXTERNAL)
        claims = metric(d, "vllm:pd_claim_seconds_count")
        got = stack.decode_with(prompt, edit(params), MAX_TOKENS)
        assert compare(stack.reference(prompt, MAX_TOKENS), got, tie_margin=1e-5, logprob_tol=1e-4).ok, case
        wait_for(lambda: event(d, "refused:unauthenticated"), refused + 1, f"{case}: refused:unauthenticated not counted")
        assert metric(d, *EXTERNAL) == loaded, f"{case}: D loaded tokens from edited params"
        assert metric(d, "vllm:pd_claim_seconds_count") == claims, f"{case}: D claimed from edited params"
        assert listener.accepted == 0, f"{case}: D opened {listener.accepted} connection(s) to the address a client chose"
    # Negative control: the same flow unedited loads R tokens from P.
    prompt = random_prompt(90, seed=499)
    params = stack.prefill_only(prompt)
    loaded = metric(d, *EXTERNAL)
    stack.decode_with(prompt, params, MAX_TOKENS)
    wait_for(lambda: metric(d, *EXTERNAL), loaded + params["replay_offset"], "the unedited handoff was not loaded")


def test_without_a_secret_a_p_host_off_the_allow_list_is_refused_before_any_contact(stack, listener):
    if stack.kind in E2E_SECRET:
        pytest.skip("runs on stacks without a shared secret")
    d = stack.decode
    prompt = random_prompt(90, seed=510)
    params = stack.prefill_only(prompt)
    assert "pd_handoff_seal" not in params
    refused, loaded = event(d, "refused:host_not_allowed"), metric(d, *EXTERNAL)
    # "127.1" reaches the listener through any resolver (inet_aton), but is not written as an
    # address or name on D's default allow-list ("local"): D must not resolve it to decide.
    got = stack.decode_with(prompt, {**params, "remote_host": "127.1", "remote_port": listener.port}, MAX_TOKENS)
    assert compare(stack.reference(prompt, MAX_TOKENS), got, tie_margin=1e-5, logprob_tol=1e-4).ok
    wait_for(lambda: event(d, "refused:host_not_allowed"), refused + 1, "refused:host_not_allowed not counted")
    assert metric(d, *EXTERNAL) == loaded
    assert listener.accepted == 0, f"D opened {listener.accepted} connection(s) to a host off its allow-list"
    # Negative control: the listener does count a connection to that spelling of the host.
    socket.create_connection(("127.1", listener.port), timeout=2).close()
    wait_for(lambda: listener.accepted, 1, "the listener cannot see connections: the check above proves nothing", 3)
