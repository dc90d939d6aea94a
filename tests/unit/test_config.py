"""Pure tests of pd_connector.core.settings: kv_connector_extra_config parsing and validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core.settings import (
    DEFAULT_SIDE_CHANNEL_PORT,
    ENV_PREFIX,
    SECRET_ENV,
    ConnectorSettings,
    parse_settings,
)

# User-facing keys (``secret`` is filled from a file or the environment, never configured).
KNOWN = [f for f in ConnectorSettings.__struct_fields__ if f != "secret"]


def parse(config=None, env=None):
    return parse_settings(config, environ=env or {})


def test_defaults():
    s = parse()
    assert s == ConnectorSettings()
    assert s.side_channel_host == "127.0.0.1"
    assert s.side_channel_port == DEFAULT_SIDE_CHANNEL_PORT == 5660
    assert s.lease_seconds == 120.0
    assert s.handshake_timeout_seconds == 10.0
    assert s.load_failure_policy == "recompute"
    assert s.nixl_backends == ["UCX"]
    assert s.nixl_num_threads == 0
    assert s.nixl_ucx_error_handling == "peer"
    assert s.shared_secret_file == ""
    assert s.verify_state_digest is False
    assert s.claim_wait_seconds == 5.0
    assert s.read_warn_seconds == 5.0
    assert s.min_recompute_tokens == 0
    assert s.secret == b""
    assert parse({}) == parse(None)


def test_defaults_do_not_share_mutable_lists():
    a, b = parse(), parse()
    assert a.nixl_backends is not b.nixl_backends


@pytest.mark.parametrize(
    "key, value",
    [
        ("side_channel_host", "10.0.0.5"),
        ("side_channel_port", 6000),
        ("lease_seconds", 5.5),
        ("lease_seconds", 30),
        ("handshake_timeout_seconds", 0.25),
        ("load_failure_policy", "fail"),
        ("nixl_backends", ["UCX", "GDS"]),
        ("nixl_num_threads", 4),
        ("verify_state_digest", True),
        ("claim_wait_seconds", 0.5),
        ("read_warn_seconds", 30.0),
        ("nixl_ucx_error_handling", "none"),
        ("min_recompute_tokens", 3),
    ],
)
def test_each_key_is_honoured(key, value):
    assert getattr(parse({key: value}), key) == value


@pytest.mark.parametrize(
    "key, env_value, expected",
    [
        ("side_channel_host", "0.0.0.0", "0.0.0.0"),
        ("side_channel_port", "7001", 7001),
        ("lease_seconds", "2.5", 2.5),
        ("handshake_timeout_seconds", "3", 3.0),
        ("load_failure_policy", "fail", "fail"),
        ("nixl_backends", "UCX,LIBFABRIC", ["UCX", "LIBFABRIC"]),
        ("nixl_num_threads", "8", 8),
        ("verify_state_digest", "true", True),
        ("verify_state_digest", "0", False),
        ("claim_wait_seconds", "1.5", 1.5),
        ("read_warn_seconds", "2", 2.0),
        ("nixl_ucx_error_handling", "none", "none"),
        ("min_recompute_tokens", "2", 2),
    ],
)
def test_env_override(key, env_value, expected):
    env = {ENV_PREFIX + key.upper(): env_value}
    assert env == {f"PD_CONNECTOR_{key.upper()}": env_value}
    got = getattr(parse(None, env), key)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "env_value, expected",
    [
        (" UCX , LIBFABRIC ", ["UCX", "LIBFABRIC"]),
        ("UCX", ["UCX"]),
        ("\tGDS\n", ["GDS"]),
    ],
)
def test_env_nixl_backends_are_stripped(env_value, expected):
    assert parse(None, {"PD_CONNECTOR_NIXL_BACKENDS": env_value}).nixl_backends == expected


def test_config_nixl_backends_are_kept_verbatim():
    """Only the environment's comma list is split and stripped; a config list is typed JSON."""
    assert parse({"nixl_backends": ["UCX", "GDS_MT"]}).nixl_backends == ["UCX", "GDS_MT"]


def test_config_wins_over_env():
    env = {"PD_CONNECTOR_SIDE_CHANNEL_PORT": "7001", "PD_CONNECTOR_LEASE_SECONDS": "9"}
    s = parse({"side_channel_port": 6000}, env)
    assert s.side_channel_port == 6000  # from the config
    assert s.lease_seconds == 9.0  # from the environment


def test_unrelated_env_is_ignored():
    env = {"PD_CONNECTOR_BOGUS": "1", "SIDE_CHANNEL_PORT": "1", "pd_connector_lease_seconds": "1"}
    assert parse(None, env) == ConnectorSettings()


def test_default_environ_is_os_environ(monkeypatch):
    monkeypatch.setenv("PD_CONNECTOR_NIXL_NUM_THREADS", "3")
    assert parse_settings({}).nixl_num_threads == 3


@settings(max_examples=200, deadline=None)
@given(
    st.text(min_size=1, max_size=20).filter(
        lambda k: k not in KNOWN and k not in ("shared_secret", "_secret")
    ),
    st.integers(),
)
def test_unknown_key_is_refused_listing_known_keys(key, value):
    with pytest.raises(ValueError) as info:
        parse({key: value})
    msg = str(info.value)
    assert f"unknown kv_connector_extra_config key(s) {[key]}. Known keys: " in msg
    assert msg.endswith("Known keys: " + ", ".join(KNOWN))


def test_unknown_keys_are_all_named_sorted_even_next_to_valid_ones():
    with pytest.raises(ValueError) as info:
        parse({"zeta": 1, "side_channel_port": 6000, "alpha": "x", "lease_second": 3})
    assert "unknown kv_connector_extra_config key(s) ['alpha', 'lease_second', 'zeta']" in str(info.value)


def test_unknown_key_is_refused_even_when_env_would_fill_it():
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key"):
        parse({"bogus": 1}, {"PD_CONNECTOR_BOGUS": "1"})


@pytest.mark.parametrize("config", [{1: 2}, {None: 2}])
def test_non_string_unknown_key_is_refused(config):
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key"):
        parse(config)


@pytest.mark.parametrize("config", [{1: 2, "x": 3}, {None: 1, "side_channel_port": 6000, "y": 0}])
def test_unknown_keys_of_mixed_types_are_refused_naming_them(config):
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key"):
        parse(config)


@pytest.mark.parametrize(
    "key, value",
    [
        ("side_channel_host", 5),
        ("side_channel_host", None),
        ("side_channel_port", "not-a-port"),
        ("side_channel_port", 1.5),
        ("side_channel_port", True),
        ("side_channel_port", [5660]),
        ("lease_seconds", True),
        ("lease_seconds", "soon"),
        ("handshake_timeout_seconds", None),
        ("load_failure_policy", "retry"),
        ("load_failure_policy", 1),
        ("nixl_backends", "UCX"),  # a string is not a list (env splits, config does not)
        ("nixl_backends", [1]),
        ("nixl_num_threads", "many"),
        ("nixl_num_threads", 2.5),
        ("verify_state_digest", "maybe"),
        ("claim_wait_seconds", "later"),
        # Config values are strictly typed: numeric and boolean strings are refused too.
        ("side_channel_port", "5661"),
        ("lease_seconds", "2.5"),
        ("handshake_timeout_seconds", "3"),
        ("nixl_num_threads", "4"),
        ("nixl_num_threads", True),
        ("verify_state_digest", "true"),
        ("verify_state_digest", 1),
        ("verify_state_digest", 0),
        ("claim_wait_seconds", "1.5"),
        ("nixl_backends", "UCX,GDS"),
        ("load_failure_policy", ["fail"]),
        ("lease_seconds", 10**400),
    ],
)
def test_bad_types_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError) as info:
        parse({key: value})
    assert key in str(info.value)


def test_string_port_in_config_is_refused():
    """The example of the strict-typing change: JSON config gives numbers as numbers."""
    with pytest.raises(ValueError, match="side_channel_port"):
        parse({"side_channel_port": "5661"})
    assert parse(None, {"PD_CONNECTOR_SIDE_CHANNEL_PORT": "5661"}).side_channel_port == 5661


@pytest.mark.parametrize(
    "key, value",
    [
        ("side_channel_port", 0),
        ("side_channel_port", -1),
        ("side_channel_port", 65536),
        ("lease_seconds", 0),
        ("lease_seconds", -1.0),
        ("handshake_timeout_seconds", 0.0),
        ("handshake_timeout_seconds", -5),
        ("claim_wait_seconds", 0),
        ("claim_wait_seconds", -0.5),
        ("read_warn_seconds", 0),
        ("nixl_ucx_error_handling", "off"),
        ("nixl_ucx_error_handling", "PEER"),
        ("nixl_num_threads", -1),
        ("min_recompute_tokens", -1),
        ("nixl_backends", []),
        ("nixl_backends", [""]),
        ("nixl_backends", [" "]),
        ("nixl_backends", ["UCX", ""]),
        ("nixl_backends", ["\t", "GDS"]),
    ],
)
def test_bad_ranges_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError) as info:
        parse({key: value})
    assert key in str(info.value)


@pytest.mark.parametrize(
    "key, env_value",
    [
        ("side_channel_port", "http"),
        ("side_channel_port", " 5661 "),  # only nixl_backends are stripped
        ("side_channel_port", ""),
        ("side_channel_port", "2.5"),
        ("lease_seconds", "soon"),
        ("lease_seconds", "1e400"),
        ("handshake_timeout_seconds", ""),
        ("claim_wait_seconds", "later"),
        ("load_failure_policy", "ignore"),
        ("nixl_num_threads", "x"),
        ("verify_state_digest", "yes please"),
    ],
)
def test_unconvertible_env_values_are_refused_naming_the_variable(key, env_value):
    """The error names the environment variable and its value, not a config key."""
    var = ENV_PREFIX + key.upper()
    with pytest.raises(ValueError) as info:
        parse(None, {var: env_value})
    assert f"invalid {var}={env_value!r}: " in str(info.value)


def test_unconvertible_env_value_example_message():
    with pytest.raises(ValueError) as info:
        parse(None, {"PD_CONNECTOR_SIDE_CHANNEL_PORT": "http"})
    assert str(info.value).startswith("pd_connector: invalid PD_CONNECTOR_SIDE_CHANNEL_PORT='http': ")


@pytest.mark.parametrize(
    "key, env_value",
    [
        ("side_channel_port", "99999"),
        ("side_channel_port", "0"),
        ("lease_seconds", "-3"),
        ("lease_seconds", "0"),
        ("handshake_timeout_seconds", "-0.1"),
        ("claim_wait_seconds", "0"),
        ("nixl_num_threads", "-1"),
        ("nixl_backends", ""),
        ("nixl_backends", " , "),
        ("nixl_backends", "UCX,"),
    ],
)
def test_out_of_range_env_values_are_refused_naming_the_key(key, env_value):
    """Converted, then refused by the range checks, which name the key."""
    var = ENV_PREFIX + key.upper()
    with pytest.raises(ValueError) as info:
        parse(None, {var: env_value})
    assert key in str(info.value) or var in str(info.value)


def test_bad_env_value_is_ignored_when_the_config_sets_the_key():
    env = {"PD_CONNECTOR_SIDE_CHANNEL_PORT": "http", "PD_CONNECTOR_LEASE_SECONDS": "nan"}
    s = parse({"side_channel_port": 6000, "lease_seconds": 3.0}, env)
    assert s.side_channel_port == 6000 and s.lease_seconds == 3.0


@settings(max_examples=150, deadline=None)
@given(st.integers(-(2**20), 2**20))
def test_port_range(port):
    if 0 < port < 65536:
        assert parse({"side_channel_port": port}).side_channel_port == port
        assert parse(None, {"PD_CONNECTOR_SIDE_CHANNEL_PORT": str(port)}).side_channel_port == port
    else:
        with pytest.raises(ValueError, match="side_channel_port"):
            parse({"side_channel_port": port})


DURATIONS = [
    "lease_seconds", "handshake_timeout_seconds", "claim_wait_seconds", "read_warn_seconds", "prefill_engine_idle_seconds",
]


@pytest.mark.parametrize("key", DURATIONS)
@pytest.mark.parametrize("source", ["env", "config"])
def test_nan_durations_are_refused(key, source):
    """Regression: the check was `x <= 0`, which NaN passes: PD_CONNECTOR_LEASE_SECONDS=nan was
    accepted, every lease deadline became NaN and leases.LeaseTable.expire never freed the
    blocks (likewise a NaN handshake timeout)."""
    with pytest.raises(ValueError, match=key):
        if source == "env":
            parse(None, {ENV_PREFIX + key.upper(): "nan"})
        else:
            parse({key: float("nan")})


@pytest.mark.parametrize("key", DURATIONS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), -1e-9, 0.0])
def test_infinite_or_non_positive_durations_are_refused(key, value):
    with pytest.raises(ValueError, match=key):
        parse({key: value})
    with pytest.raises(ValueError, match=key):
        parse(None, {ENV_PREFIX + key.upper(): repr(value)})


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(DURATIONS), st.floats(allow_nan=True, allow_infinity=True))
def test_duration_accepted_iff_positive_and_finite(key, value):
    ok = value > 0 and value != float("inf")
    for source in ("config", "env"):
        try:
            if source == "config":
                got = getattr(parse({key: value}), key)
            else:
                got = getattr(parse(None, {ENV_PREFIX + key.upper(): repr(value)}), key)
        except ValueError as exc:
            assert not ok, (source, value, exc)
            assert key in str(exc)
        else:
            assert ok and got == value, (source, value)


@settings(max_examples=50, deadline=None)
@given(st.integers(-(2**20), 2**20))
def test_nixl_num_threads_accepted_iff_non_negative(n):
    for source in ("config", "env"):
        try:
            got = (parse({"nixl_num_threads": n}) if source == "config" else
                   parse(None, {"PD_CONNECTOR_NIXL_NUM_THREADS": str(n)})).nixl_num_threads
        except ValueError as exc:
            assert n < 0 and "nixl_num_threads" in str(exc), (source, n)
        else:
            assert n >= 0 and got == n, (source, n)


def test_settings_struct_refuses_unknown_fields_directly():
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"bogus": 1}, ConnectorSettings)


# --- shared secret ----------------------------------------------------------------------------


def test_secret_from_environment():
    assert parse(None, {SECRET_ENV: "s3cret"}).secret == b"s3cret"
    assert SECRET_ENV == "PD_CONNECTOR_SHARED_SECRET"


def test_secret_from_file_is_stripped_and_wins_over_environment(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"  from-file\n")
    s = parse({"shared_secret_file": str(path)}, {SECRET_ENV: "from-env"})
    assert s.secret == b"from-file"
    s = parse(None, {ENV_PREFIX + "SHARED_SECRET_FILE": str(path)})
    assert s.secret == b"from-file"


@pytest.mark.parametrize("key", ["shared_secret", "_secret"])
def test_secret_in_config_is_refused_pointing_to_the_env_var(key):
    for value in ("s3cret", 12345, None):
        with pytest.raises(ValueError) as info:
            parse({key: value, "side_channel_port": 6000})
        msg = str(info.value)
        assert SECRET_ENV in msg and "shared_secret_file" in msg
        assert "s3cret" not in msg and "12345" not in msg


def test_secret_field_name_is_not_a_config_key():
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['secret'\]"):
        parse({"secret": "s3cret"})


def test_unreadable_or_empty_secret_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="shared_secret_file"):
        parse({"shared_secret_file": str(tmp_path / "missing")})
    empty = tmp_path / "empty"
    empty.write_bytes(b" \n")
    with pytest.raises(ValueError, match="shared_secret_file"):
        parse({"shared_secret_file": str(empty)})


def test_secret_is_not_in_repr(tmp_path):
    s = parse(None, {SECRET_ENV: "s3cret-value"})
    assert "s3cret-value" not in repr(s) and "s3cret-value" not in str(s)
    assert "side_channel_port=5660" in repr(s)


@pytest.mark.parametrize("value", [["/etc/secret"], 2.5, {"path": "x"}, 1, 0, True, None, b"/etc/secret"])
def test_shared_secret_file_of_wrong_type_is_refused_naming_the_key(value, monkeypatch):
    """Regression: shared_secret_file reached open() before type validation: a list/float/dict
    raised TypeError (not ValueError naming the key); an int was opened as a file descriptor
    (1 or True read fd 1)."""
    def no_open(*args, **kwargs):
        raise AssertionError(f"open{args} called for a non-string shared_secret_file")

    # Shadows the builtin for pd_connector.core.settings only.
    monkeypatch.setattr("pd_connector.core.settings.open", no_open, raising=False)
    with pytest.raises(ValueError, match="shared_secret_file"):
        parse({"shared_secret_file": value}, {SECRET_ENV: "from-env"})


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 0.0])
def test_claim_wait_seconds_out_of_range_is_refused(value):
    """Regression: claim_wait_seconds had no range check (negative and NaN were accepted)."""
    with pytest.raises(ValueError, match="claim_wait_seconds"):
        parse({"claim_wait_seconds": value})


# --- the hold cap and the claim deadline ------------------------------------------------------


def test_a_hold_cap_below_the_claim_deadline_is_refused_naming_both_and_the_fix():
    """Regression: max_hold_seconds 10 with claim_deadline_seconds 30 was accepted; a claim 10 to
    30 s after the prefill was then granted a 0 s hold (D read, discarded it as lease_lost and
    recomputed)."""
    with pytest.raises(ValueError) as info:
        parse({"max_hold_seconds": 10, "claim_deadline_seconds": 30})
    message = str(info.value)
    assert "max_hold_seconds=10" in message and "claim_deadline_seconds=30" in message
    assert "Raise max_hold_seconds" in message
    with pytest.raises(ValueError, match="claim_deadline_seconds=30"):
        parse(None, {"PD_CONNECTOR_MAX_HOLD_SECONDS": "10", "PD_CONNECTOR_CLAIM_DEADLINE_SECONDS": "30"})
    with pytest.raises(ValueError, match="max_hold_seconds=10"):
        parse({"max_hold_seconds": 10})  # against the default claim deadline (30 s)


def test_negative_control_a_hold_cap_equal_to_or_above_the_claim_deadline_is_accepted():
    assert parse({"max_hold_seconds": 30, "claim_deadline_seconds": 30}).max_hold_seconds == 30
    assert parse({"max_hold_seconds": 31, "claim_deadline_seconds": 30}).max_hold_seconds == 31
    assert parse({"max_hold_seconds": 10, "claim_deadline_seconds": 10}).claim_deadline_seconds == 10


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-3, 1e6), st.floats(1e-3, 1e6))
def test_hold_cap_accepted_iff_at_least_the_claim_deadline(hold, claim):
    try:
        parse({"max_hold_seconds": hold, "claim_deadline_seconds": claim})
    except ValueError as exc:
        assert hold < claim, exc
        assert "max_hold_seconds" in str(exc) and "claim_deadline_seconds" in str(exc)
    else:
        assert hold >= claim


# --- docs/configuration.md is the reference: every key, its default --------------------------


def _documented_keys() -> dict[str, str]:
    """``key -> default`` from the table rows ``| `key` | default | effect |``."""
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", doc.read_text(), flags=re.M)
    return {key: default.strip().strip("`") for key, default in rows}


def _as_documented(value) -> str:
    import json

    if value == "" or value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def test_configuration_reference_documents_every_key_with_its_default():
    documented = _documented_keys()
    assert sorted(documented) == sorted(KNOWN), "docs/configuration.md and ConnectorSettings differ"
    defaults = ConnectorSettings()
    for key in KNOWN:
        assert documented[key] == _as_documented(getattr(defaults, key)), key


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 1000.5])
def test_idle_step_wait_outside_0_to_1000_ms_is_refused(value):
    """NaN passes a plain range check; a negative wait would raise inside Event.wait in every
    idle engine step, and a long one would hold new requests back that long."""
    with pytest.raises(ValueError, match="idle_step_wait_ms"):
        parse({"idle_step_wait_ms": value})
    with pytest.raises(ValueError, match="idle_step_wait_ms"):
        parse(None, {ENV_PREFIX + "IDLE_STEP_WAIT_MS": repr(value)})


def test_idle_step_wait_zero_disables_the_wait():
    assert parse({"idle_step_wait_ms": 0}).idle_step_wait_ms == 0


@pytest.mark.parametrize("value", [-1, 1_000_001])
def test_nixl_progress_delay_outside_0_to_1s_is_refused(value):
    with pytest.raises(ValueError, match="nixl_progress_delay_us"):
        parse({"nixl_progress_delay_us": value})


def test_nixl_progress_delay_defaults_to_100us_over_dram_and_nixls_own_over_vram():
    """NIXL 1.5.1's own 0 spins a core per connected agent (python -m benchmarks nixl_progress);
    GPU hosts keep NIXL's and NixlConnector's behaviour unless asked."""
    assert parse({}).progress_delay_for("DRAM") == 100
    assert parse({}).progress_delay_for("VRAM") == 0
    assert parse({"nixl_progress_delay_us": 0}).progress_delay_for("DRAM") == 0
    assert parse({"nixl_progress_delay_us": 250}).progress_delay_for("VRAM") == 250
