"""P and D on two "hosts": network namespaces of their own, joined by a veth link through a
bridge (``rig/netns.py``), each with its own hostname and boot id, so that UCX finds no
shared memory between them and has to pick tcp. P's side channel binds P's link address; the
aggregated baseline runs on this machine's loopback. One P/D pair serves every test of the
module; the last one kills P.

Faults are timed against a READ in flight: P's outgoing traffic is capped (``tc``), so that the
READ of a long prompt lasts seconds, and D reports it (``read_slow`` after ``read_warn_seconds``)
before the fault is applied.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from rig import ucx_logs
from rig.cpu_matrix import CPU_MODELS, random_prompt
from rig.netns import TwoHosts, unavailable_reason
from rig.oracle import compare
from rig.process_groups import signal_group
from rig.prometheus import read_metric_labels
from rig.stack import PDStack, StackConfig
from rig.tiny_models import build_model

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
# D's settings (docs/configuration.md). The READ of LONG_PROMPT tokens from a capped P lasts
# several seconds: at least READ_WARN_S of it is seen before a fault is applied.
HANDSHAKE_TIMEOUT_S = 3.0
LEASE_S = 30.0
READ_WARN_S = 1.0
CAPPED_RATE = "2mbit"  # ~250 KB/s: the tiny Llama's ~1 KiB of KV per token takes ~4 s for 900 tokens
LONG_PROMPT = 900
# Room for a decode that outlasts P's death in the last test (the tiny model allows 2048).
MAX_MODEL_LEN = 2048
LINK_DOWN_S = 5.0
# How long after the fault (or the link coming back) a request may take to finish: the
# handshake timeout, a claim wait, and D's recompute and decode on a loaded 2-core box.
SETTLE_S = 60.0


def check(reference, candidate):
    return compare(reference, candidate, tie_margin=1e-5, logprob_tol=1e-4)


@pytest.fixture(scope="module")
def net():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"two namespaced hosts cannot be made here: {reason}")
    with TwoHosts() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def pair(net, models_root, artifacts):
    # Across hosts D contacts P only under a shared secret (or an allow-list naming P): the
    # production setup, so every handoff here is sealed by P and checked by D.
    ucx_tables = {"UCX_PROTO_INFO": "y", "PD_CONNECTOR_SHARED_SECRET": "two-hosts-secret"}
    config = StackConfig(
        model=str(build_model("llama", models_root)),
        server_args=CPU_MODELS["llama"],
        extra_config={"handshake_timeout_seconds": HANDSHAKE_TIMEOUT_S, "lease_seconds": LEASE_S,
                      "read_warn_seconds": READ_WARN_S},
        prefill_env=ucx_tables,
        decode_env=ucx_tables,
        with_proxy=False,
        log_dir=str(artifacts / "two_hosts"),
        max_model_len=MAX_MODEL_LEN,
        prefill_host=net.a,
        decode_host=net.b,
    )
    stack = PDStack(config).start()
    yield stack
    stack.close()


def external_tokens(server) -> float:
    return server.metric("vllm:prompt_tokens_by_source", {"source": "external_kv_transfer"}) or 0.0


def event(server, name: str) -> float:
    return server.metric("vllm:pd_events_total", {"event": name}) or 0.0


def load_failures(server) -> float:
    """D's ``load_failed:<stage>`` events, every stage."""
    stages = {labels["event"] for labels in read_metric_labels(server.base_url, "vllm:pd_events_total")
              if labels.get("event", "").startswith("load_failed:")}
    return sum(event(server, stage) for stage in stages)


def wait_until(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(poll)


def assert_no_blocks_held(*servers, timeout: float = LEASE_S + 30):
    usage = {}

    def empty():
        usage.update({s.base_url: s.metric("vllm:kv_cache_usage_perc") for s in servers})
        return all(v == 0 for v in usage.values())

    wait_until(empty, timeout, f"KV cache not released: {usage}")


class Background:
    """One request on a thread; ``result()`` re-raises its exception."""

    def __init__(self, fn, *args, **kw):
        self.value, self.error, self.done_at = None, None, None
        self.thread = threading.Thread(target=self._run, args=(fn, args, kw), daemon=True)
        self.thread.start()

    def _run(self, fn, args, kw):
        try:
            self.value = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc
        self.done_at = time.monotonic()

    def result(self, timeout: float):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"request still running after {timeout:.0f} s"
        if self.error is not None:
            raise self.error
        return self.value


def test_handoff_across_hosts_matches_aggregated_and_d_loads_from_p(pair, net):
    d = pair.decode
    before = external_tokens(d)
    loaded, failures = 0, []
    for n in (33, 64, 129, 300):
        prompt = random_prompt(n, seed=31)
        ref = pair.reference(prompt, MAX_TOKENS)
        params, got = pair.handoff(prompt, MAX_TOKENS)
        assert params["remote_host"] == net.a.address, params
        assert params["replay_offset"] == n - 1, params
        loaded += params["replay_offset"]
        verdict = check(ref, got)
        if not verdict.identical:
            failures.append(f"n={n}: {verdict.describe()}")
    assert not failures, "\n".join(failures)
    # vLLM publishes the per-source prompt counts with a step's stats: poll for the last ones.
    wait_until(lambda: external_tokens(d) - before >= loaded, 10, "external_kv_transfer tokens")
    assert external_tokens(d) - before == loaded


def test_ucx_read_over_tcp_not_shared_memory(pair, net):
    """UCX's own protocol tables: D's READs (ucp_get) over tcp on D's link, the peer on another
    node, and no shared-memory transport in any table of an endpoint to the other side (each
    agent's endpoint to itself, "self", uses cma within its own process). The tables come with
    UCX_PROTO_INFO=y; UCX_TLS is left unset, so tcp is UCX's own choice."""
    d_log, p_log = pair.decode.log_text(), pair.prefill.log_text()
    reads = ucx_logs.read_tables(d_log)
    assert reads, "no UCX_PROTO_INFO table of a READ in D's log"
    assert all(t.inter_node for t in reads), [t.title for t in reads]
    assert {c for t in reads for c in t.configs} == {f"tcp/{net.b.veth}"}
    for side, log in (("D", d_log), ("P", p_log)):
        tables = [t for t in ucx_logs.proto_tables(log) if t.to_peer]
        assert tables and all(t.inter_node for t in tables), f"{side}: {[t.title for t in tables]}"
        shared = ucx_logs.transports(tables) & set(ucx_logs.SHARED_MEMORY_TRANSPORTS)
        assert not shared, f"{side} used {shared}"


def test_link_down_before_the_claim_and_during_a_read_ends_in_aggregated_output_and_no_leaks(pair, net):
    """P's link goes down (1) after P's prefill, before D claims the blocks: D's claim gets no
    answer within handshake_timeout_seconds and D recomputes the prompt; (2) while D's READ is in
    flight, for LINK_DOWN_S: the READ resumes when the link is back (or D recomputes). Both end
    with the aggregated output in bounded time; once the link is back neither side holds a block
    (P frees the first request's blocks at lease expiry, D's release notice having been lost)
    and a new handoff is honoured."""
    d, p = pair.decode, pair.prefill
    prompt = random_prompt(200, seed=37)
    ref = pair.reference(prompt, MAX_TOKENS)
    params = pair.prefill_only(prompt)
    failed_line = f"failed (no answer from {params['remote_host']}:{params['remote_port']}"
    no_answer = d.log_text().count(failed_line)
    net.a.set_link(False)
    try:
        started = time.monotonic()
        got = pair.decode_with(prompt, params, MAX_TOKENS)
        took = time.monotonic() - started
    finally:
        net.a.set_link(True)
    assert check(ref, got).ok
    assert d.log_text().count(failed_line) == no_answer + 1
    print(f"\nlink down before the claim: D recomputed, the request took {took:.1f} s "
          f"(handshake_timeout_seconds {HANDSHAKE_TIMEOUT_S:g})")
    assert took < HANDSHAKE_TIMEOUT_S + SETTLE_S

    prompt = random_prompt(LONG_PROMPT, seed=32)
    ref = pair.reference(prompt, MAX_TOKENS)
    net.a.limit_rate(CAPPED_RATE)
    try:
        params = pair.prefill_only(prompt)
        slow = event(d, "read_slow")
        request = Background(pair.decode_with, prompt, params, MAX_TOKENS)
        wait_until(lambda: event(d, "read_slow") > slow, 60, "D's READ in flight (read_slow)")
        net.a.set_link(False)
        time.sleep(LINK_DOWN_S)
    finally:
        net.a.set_link(True)
        net.a.limit_rate(None)
    up_at = time.monotonic()
    got = request.result(SETTLE_S)
    assert check(ref, got).ok
    print(f"link down {LINK_DOWN_S:.0f} s during a READ: finished {request.done_at - up_at:.1f} s after the "
          f"link came back; D events: accepted {event(d, 'handoff_accepted')}, "
          f"load failures {load_failures(d)}")
    assert_no_blocks_held(p, d)
    # The link is back: P is reachable again and a new handoff is honoured.
    before = external_tokens(d)
    short = random_prompt(100, seed=33)
    params, got = pair.handoff(short, MAX_TOKENS)
    assert check(pair.reference(short, MAX_TOKENS), got).identical
    wait_until(lambda: external_tokens(d) - before >= params["replay_offset"], 10, "handoff after the link is back")
    assert_no_blocks_held(p, d)


def test_p_killed_during_a_read_and_a_decode_ends_in_aggregated_output(pair, net):
    """Two requests on D when P's process group is SIGKILLed: one handed over earlier and still
    decoding (it does not need P any more), one whose READ is in flight. Both end with the
    aggregated output within SETTLE_S, and D holds no block afterwards and keeps serving. The
    READ may still complete: a killed process's kernel keeps sending what its sockets had
    queued, which here is the whole READ; otherwise D recomputes (default load_failure_policy).
    Kills P: the module's last test."""
    d = pair.decode
    decoding_prompt = random_prompt(64, seed=34)
    long_decode = MAX_MODEL_LEN - len(decoding_prompt)
    reading_prompt = random_prompt(LONG_PROMPT, seed=35)
    ref_decoding = pair.reference(decoding_prompt, long_decode)
    ref_reading = pair.reference(reading_prompt, MAX_TOKENS)
    failed = load_failures(d)
    # The long READ is started first and seen in flight; only then is the short handoff made
    # and loaded, and P killed as soon as D has it, so the long decode is the one that cannot
    # have ended before the kill (started the other way round, with the READ's start between
    # the two, a fast box finished the 1984-token decode about a second before P died).
    params = pair.prefill_only(reading_prompt)
    decoding_params = pair.prefill_only(decoding_prompt)
    net.a.limit_rate(CAPPED_RATE)
    try:
        slow = event(d, "read_slow")
        reading = Background(pair.decode_with, reading_prompt, params, MAX_TOKENS)
        wait_until(lambda: event(d, "read_slow") > slow, 60, "D's READ in flight (read_slow)")
        loaded = external_tokens(d)
        decoding = Background(pair.decode_with, decoding_prompt, decoding_params, long_decode)
        short_r, long_r = decoding_params["replay_offset"], params["replay_offset"]
        # The short handoff's tokens loaded (the long READ's may land meanwhile, alone they do not count).
        wait_until(lambda: external_tokens(d) - loaded in (short_r, short_r + long_r), 60,
                   "the short handoff loaded while the long READ is in flight")
        killed_at = time.monotonic()
        signal_group(pair.prefill.pid, signal.SIGKILL)
    finally:
        net.a.limit_rate(None)
    got_reading = reading.result(SETTLE_S)
    got_decoding = decoding.result(SETTLE_S + 120)
    recomputed = load_failures(d) > failed
    print(f"\nP killed during a READ: that request finished {reading.done_at - killed_at:.1f} s later "
          f"({'recomputed by D' if recomputed else 'the READ completed'}); the one decoding finished "
          f"{decoding.done_at - killed_at:.1f} s later")
    assert decoding.done_at > killed_at, "the long decode was over before P died: nothing was tested"
    assert check(ref_reading, got_reading).ok
    assert check(ref_decoding, got_decoding).ok
    assert_no_blocks_held(d)
    # D keeps serving without its prefill peer.
    plain = random_prompt(40, seed=36)
    assert check(pair.reference(plain, MAX_TOKENS), pair.decode_with(plain, None, MAX_TOKENS)).identical
