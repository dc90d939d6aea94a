"""Pure tests of D's trust in a handoff (pd_connector.core.trust and its use in
``handoff.decide_on_decode``): P seals what it issues, D verifies the seal (or, without a secret,
P's host against the allow-list) before anything that contacts P, the release included.

The property: no mutation of a sealed handoff's fields reaches the network (no release target,
nothing accepted), and without a secret no handoff naming a host off the allow-list does.
"""

from __future__ import annotations

import copy

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core import trust
from pd_connector.core.handoff import Accepted, Refused, decide_on_decode, trusted_release_target
from pd_connector.core.params import KEY_CHECKPOINTS, KEY_FIRST_TOKEN, encode_handoff_params
from pd_connector.core.protocol import CheckpointBlocks
from pd_connector.core.recompute_profile import RecomputeProfile

SECRET = b"s3cret-shared-by-p-and-d"
KEY = trust.seal_key(SECRET)
NOW = 1_700_000_000.0
PROFILE = RecomputeProfile(has_recurrent_state=True)
LOCAL = trust.parse_allow_list(["local"])
SEALED = trust.Trust(key=KEY, hosts=trust.parse_allow_list(["*"]))
UNSEALED = trust.Trust(hosts=LOCAL)


def issued(offset=10, *, key=KEY, host="127.0.0.1", first_token=None, checkpoints=(), expires_at=NOW + 600) -> dict:
    return encode_handoff_params(
        offset,
        [[1, 2, 3], [7]],
        engine_id="prefill-engine-0",
        request_id="cmpl-abc-0",
        host=host,
        port=5660,
        fingerprint="fp-v1:abc",
        lease_seconds=30.0,
        checkpoints=list(checkpoints),
        block_sizes=[16, 0],
        first_token=first_token,
        expires_at=expires_at,
        seal_key=key,
    )


def decide(raw, trust_in, n=12, now=NOW, token_at=None):
    return decide_on_decode(raw, n, PROFILE, num_groups=2, trust_in=trust_in, now=now, prompt_token_at=token_at)


def test_a_sealed_handoff_is_accepted_and_released_to_its_p():
    assert isinstance(decide(issued(), SEALED), Accepted)
    refused = decide(issued(offset=12), SEALED)  # no token left to recompute: refused, but trusted
    assert isinstance(refused, Refused) and refused.kind == "offset_out_of_range"
    assert refused.release is not None and refused.release.port == 5660


def test_a_router_reserializing_the_json_keeps_the_seal_valid():
    raw = issued(checkpoints=[CheckpointBlocks(8, [[], [4]])])
    round_tripped = msgspec.json.decode(msgspec.json.encode(raw))
    round_tripped["pd_lease_seconds"] = 30  # an integer where P wrote 30.0
    round_tripped[KEY_CHECKPOINTS] = dict(reversed(list(round_tripped[KEY_CHECKPOINTS].items())))
    assert isinstance(decide(dict(reversed(list(round_tripped.items()))), SEALED), Accepted)


SEALED_EDITS = {
    "remote_host": "10.9.9.9",
    "remote_port": 6000,
    "remote_engine_id": "prefill-engine-evil",
    "remote_request_id": "cmpl-other-0",
    "remote_block_ids": [[1, 2, 4], [7]],
    "replay_offset": 9,
    "remote_num_tokens": 9,
    "tp_size": 2,
    "pd_prompt_fingerprint": "fp-v1:abd",
    "pd_lease_seconds": 3000.0,
    "pd_block_sizes": [32, 0],
    KEY_CHECKPOINTS: {"version": 1, "states": [{"position": 8, "block_ids": [[], [5]]}]},
    KEY_FIRST_TOKEN: 5,
    trust.KEY_EXPIRES_AT: NOW + 10**6,
}


@pytest.mark.parametrize("field", sorted(SEALED_EDITS))
def test_params_rewritten_in_transit_are_refused_before_any_contact(field):
    raw = issued()
    raw[field] = SEALED_EDITS[field]
    if field == "replay_offset":
        raw["remote_num_tokens"] = SEALED_EDITS[field]  # both edited consistently: still caught
    decision = decide(raw, SEALED)
    assert isinstance(decision, Refused) and decision.kind == "unauthenticated", decision
    assert decision.release is None
    assert trusted_release_target(raw, SEALED, NOW) is None


def test_negative_control_the_unedited_params_pass_every_check_above():
    assert isinstance(decide(issued(), SEALED), Accepted)
    assert trusted_release_target(issued(), SEALED, NOW) is not None


def test_missing_or_foreign_seals_are_refused():
    unsealed = issued(key=b"")
    assert decide(unsealed, SEALED).kind == "unauthenticated"
    other = issued(key=trust.seal_key(b"another deployment's secret"))
    refused = decide(other, SEALED)
    assert refused.kind == "unauthenticated" and "another shared secret" in refused.reason
    assert refused.release is None


def test_an_expired_handoff_is_refused_without_contact():
    raw = issued(expires_at=NOW - trust.CLOCK_SKEW_SECONDS - 1)
    refused = decide(raw, SEALED)
    assert refused.kind == "handoff_expired" and refused.release is None
    # Inside the clock-skew slack it still passes (P's lease and single grant bound a replay).
    assert isinstance(decide(issued(expires_at=NOW - 1), SEALED), Accepted)


def test_the_side_channel_key_and_the_seal_key_differ():
    assert KEY != SECRET and trust.seal_key(b"") == b""


# --- without a secret: the allow-list ---------------------------------------------------------


@pytest.mark.parametrize("host", ["10.0.0.7", "evil.example.com", "192.0.2.1", "::ffff:10.0.0.7", "0.0.0.0"])
def test_without_a_secret_a_host_off_the_allow_list_is_refused_before_any_contact(host):
    raw = issued(key=b"", host=host)
    decision = decide(raw, UNSEALED)
    assert isinstance(decision, Refused) and decision.kind == "host_not_allowed"
    assert host in decision.reason and "PD_CONNECTOR_SHARED_SECRET" in decision.reason
    assert decision.release is None
    # Broken params naming that host are not released there either.
    broken = dict(raw, pd_protocol_version=-1)
    assert decide(broken, UNSEALED).release is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost", "LOCALHOST", "::ffff:127.0.0.1"])
def test_without_a_secret_local_hosts_pass(host):
    assert isinstance(decide(issued(key=b"", host=host), UNSEALED), Accepted)


def test_allow_list_entries():
    hosts = trust.parse_allow_list(["10.0.0.0/16", "p1.cluster.local", "192.0.2.5"], local=["vm"])
    assert hosts.allows("10.0.200.1") and not hosts.allows("10.1.0.1")
    assert hosts.allows("P1.cluster.local.") and not hosts.allows("p2.cluster.local")
    assert hosts.allows("192.0.2.5") and not hosts.allows("192.0.2.6")
    assert not hosts.allows("127.0.0.1")  # "local" was not listed
    assert trust.parse_allow_list(["local"], local=["vm", "192.0.2.9"]).allows("192.0.2.9")
    assert trust.parse_allow_list(["*"]).allows("anything")
    for bad in ["10.0.0.0/99", "not a host", "a/b", ""]:
        with pytest.raises(ValueError, match="allowed_prefill_hosts entry"):
            trust.parse_allow_list([bad])


def test_with_a_secret_an_explicit_allow_list_applies_too():
    both = trust.Trust(key=KEY, hosts=trust.parse_allow_list(["10.0.0.0/8"]))
    refused = decide(issued(host="192.0.2.1"), both)
    assert refused.kind == "host_not_allowed" and refused.release is None
    assert isinstance(decide(issued(host="10.1.2.3"), both), Accepted)


# --- zero replay: P's first token ---------------------------------------------------------------


def test_zero_replay_accepts_d_prompt_of_p_tokens_plus_the_first_token():
    raw = issued(offset=12, first_token=42)
    tokens = list(range(12)) + [42]
    assert isinstance(decide(raw, SEALED, n=13, token_at=tokens.__getitem__), Accepted)


def test_first_token_altered_in_transit_is_refused():
    raw = issued(offset=12, first_token=42)
    raw[KEY_FIRST_TOKEN] = 43
    assert decide(raw, SEALED, n=13, token_at=(list(range(12)) + [43]).__getitem__).kind == "unauthenticated"
    # Without a secret the seal cannot catch it: D's own prompt token is checked against it.
    unsealed = issued(offset=12, first_token=42, key=b"")
    refused = decide(unsealed, UNSEALED, n=13, token_at=(list(range(12)) + [43]).__getitem__)
    assert refused.kind == "first_token_mismatch" and refused.release is not None


def test_zero_replay_with_the_clients_prompt_instead_of_the_first_token_is_refused():
    raw = issued(offset=12, first_token=42)
    refused = decide(raw, SEALED, n=12, token_at=list(range(12)).__getitem__)
    assert refused.kind == "resume_mismatch"
    one_off = decide(raw, SEALED, n=14, token_at=(list(range(12)) + [42, 1]).__getitem__)
    assert one_off.kind == "resume_mismatch"


# --- the property: no mutation of sealed params reaches the network -----------------------------

values = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=False, width=32), st.text(max_size=12),
    st.lists(st.lists(st.integers(0, 50), max_size=4), max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(sorted(SEALED_EDITS) + [trust.KEY_SEAL, "pd_protocol_version"]), values), min_size=1, max_size=4),
    st.sampled_from([None, 42]),
)
def test_no_mutation_of_a_sealed_handoff_reaches_the_network_or_the_cache(edits, first_token):
    original = issued(offset=12 if first_token else 10, first_token=first_token)
    raw = copy.deepcopy(original)
    for field, value in edits:
        raw[field] = value
    n = 13 if first_token else 12
    tokens = list(range(12)) + [42]
    decision = decide(raw, SEALED, n=n, token_at=tokens.__getitem__)
    if _same_values(raw, original):
        return  # an edit that changes no value (30 for 30.0, a value written back) is no edit
    assert isinstance(decision, Refused), (edits, decision)
    assert decision.release is None
    assert trusted_release_target(raw, SEALED, NOW) is None


def _same_values(a: dict, b: dict) -> bool:
    try:
        return msgspec.json.decode(msgspec.json.encode(a)) == msgspec.json.decode(msgspec.json.encode(b)) or all(
            a.get(k) == b.get(k) and type(a.get(k)) in (type(b.get(k)), int, float) for k in set(a) | set(b)
        )
    except (TypeError, msgspec.EncodeError):
        return False


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=30), values)
def test_without_a_secret_no_host_off_the_list_is_contacted(host, noise):
    raw = issued(key=b"", host=host)
    raw["pd_prompt_fingerprint"] = noise if isinstance(noise, str) else raw["pd_prompt_fingerprint"]
    decision = decide(raw, UNSEALED)
    target = decision.release if isinstance(decision, Refused) else decision.params.lease
    if target is not None:
        assert LOCAL.allows(target.host)
    assert trusted_release_target(raw, UNSEALED, NOW) is None or LOCAL.allows(host)


# --- start-up: what an unauthenticated side channel beyond loopback exposes ----------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "p1.cluster.local", "::"])
def test_a_non_loopback_side_channel_without_a_secret_says_what_is_exposed(host):
    warning = trust.exposure_warning(host, has_secret=False)
    assert host in warning and "NIXL agent metadata" in warning and "PD_CONNECTOR_SHARED_SECRET" in warning


@pytest.mark.parametrize("host,secret", [("127.0.0.1", False), ("::1", False), ("localhost", False), ("10.0.0.5", True)])
def test_negative_control_loopback_or_a_secret_says_nothing(host, secret):
    assert trust.exposure_warning(host, has_secret=secret) == ""


def test_zero_replay_registers_the_checkpoints_of_ps_prompt_not_ds():
    from pd_connector.core.checkpoints import checkpoint_prompt_length

    zero = decide(issued(offset=12, first_token=42), SEALED, n=13, token_at=(list(range(12)) + [42]).__getitem__)
    assert checkpoint_prompt_length(zero, 13) == 12
    # Negative control: under replay D's own prompt is the one aggregated serving computed.
    assert checkpoint_prompt_length(decide(issued(offset=10), SEALED), 12) == 12
