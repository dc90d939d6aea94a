"""``kv_connector_extra_config`` keys: parsing, defaults and validation (pure).

Every key is documented in docs/configuration.md. Unknown keys and wrong types are refused at
start-up with a message naming the key, instead of being silently ignored.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

import msgspec

from pd_connector.core import trust

DEFAULT_SIDE_CHANNEL_PORT = 5660


# Values of nixl_ucx_error_handling ("peer" is NIXL's own default).
UCX_ERROR_HANDLING_MODES = ("peer", "none")


class UnsupportedConfig(ValueError):
    """A configuration pd_connector refuses at start-up, with what to change."""


class ConnectorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Address P's side channel binds to and advertises to D in kv_transfer_params. Must be
    # reachable from D; loopback by default so nothing is exposed unless configured.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    # P's floor on the prompt tokens it leaves D to recompute (0: P's own minimum only), for
    # routers that cannot pass D's requirement per request (pd_min_recompute_tokens): a D that
    # runs multi-module MTP with more speculative tokens than P refuses a shorter tail.
    min_recompute_tokens: int = 0
    # How long P keeps a finished request's blocks for D before freeing them, once D has
    # claimed or extended the handoff.
    lease_seconds: float = 120.0
    # How long P keeps them before that: the time D needs to receive the request, queue it and
    # claim (D extends handoffs it queues). A handoff no D claims (an unreachable P address in
    # the params, a client gone between P and D) is freed after this, not after lease_seconds.
    claim_deadline_seconds: float = 30.0
    # The longest P keeps a handoff's blocks after its prefill, however often D claims or extends
    # it: P frees them then even under a READ in flight, and D fails such a READ and recomputes
    # (D trusts a READ only inside the hold P confirmed, core/read_hold.py).
    max_hold_seconds: float = 600.0
    # D gives up on a P that does not answer the handshake within this time (recompute).
    handshake_timeout_seconds: float = 10.0
    # What D does when a load fails: "recompute" the prompt locally (no request is lost) or
    # "fail" the request with an error. Sets vLLM's kv_load_failure_policy accordingly.
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    nixl_backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    # NIXL's UCX worker threads, each with its own UCX worker: D's READ is split evenly over
    # them and posted asynchronously (transport/nixl.py, backend_params), off D's engine thread.
    # Opt-in: D's first READ from a new P through them can stall on one host under
    # nixl_ucx_error_handling "peer" (docs/operations.md, "Worker threads"). 0: no worker
    # threads (over DRAM the post copies, so D slices each READ, see nixl_read_chunk_mib).
    nixl_num_threads: int = 0
    # UCX endpoints' error handling ("peer", NIXL's default, or "none"). It also picks UCX's
    # lanes: under "peer" only transports that detect peer failure qualify, so on one host
    # active messages and connection set-up go over tcp; "none" lets shared memory carry them.
    # On one host "none" avoids the first-READ stalls of nixl_num_threads (docs/operations.md,
    # "Worker threads"). Keep "peer" across hosts: UCX promises no failure report under "none",
    # so a dead remote peer may hang or abort a READ.
    nixl_ucx_error_handling: str = "peer"
    # How often NIXL's progress thread polls, in µs. NIXL 1.5.1's Python API fixes 0 (it spins:
    # a core per connected agent). Unset: 100 over DRAM (CPU hosts, where that core is the
    # model's: docs/benchmarks.md, "NIXL progress thread"), 0 over VRAM (NIXL's and vLLM
    # NixlConnector's behaviour on GPU hosts).
    nixl_progress_delay_us: int | None = None
    # vLLM keeps stepping, with nothing scheduled, as long as P holds a lease or D waits for a
    # load (Scheduler.has_requests): a busy loop of the engine core and the worker. In such an
    # empty step the worker waits up to this long for the side channel to bring news (woken at
    # once by a claim, release or handshake reply), and, with a READ whose slices are all posted,
    # a fraction of its time in flight (core/idle_wait.py). 0: never wait (vLLM's own behaviour).
    idle_step_wait_ms: float = 2.0
    # With nixl_num_threads 0 over DRAM, D posts a READ in slices of at most this many MiB, one
    # per engine-step hook, because UCX then copies inside the post call (it would block D's
    # engine thread for the whole copy). 0: one post per request. Ignored with worker threads
    # or over VRAM (posts there are asynchronous).
    nixl_read_chunk_mib: int = 32
    # Shared secret authenticating side-channel peers (HMAC-SHA256 over every message), read from
    # this file or from the PD_CONNECTOR_SHARED_SECRET environment variable; never from the
    # config itself, because vLLM logs kv_connector_extra_config verbatim at start-up.
    # Unset: no authentication (bind the side channel to a private address then).
    shared_secret_file: str = ""
    # D (docs/security.md): the prefill hosts D may contact for a handoff, as written in the
    # params: addresses, networks ("10.0.0.0/16"), host names (never resolved to be checked),
    # "local" (this host's loopback, names and addresses) or "*". Unset: "local" without a
    # shared secret (a client of D cannot aim it at another host), "*" with one (the seal
    # already proves P issued the address). Set with a secret, both must pass.
    allowed_prefill_hosts: list[str] | None = None
    # P sends a SHA-256 of the recurrent-state pages with each claim grant; D recomputes it
    # after the READ and recomputes the prompt on a mismatch. Costs a read of the state pages.
    verify_state_digest: bool = False
    # How long D keeps re-asking P for a lease that is still on its way from P's scheduler to
    # its worker (D's claim can overtake it by an engine step).
    claim_wait_seconds: float = 5.0
    # D warns (once per request, event `read_slow`) when a READ has been in flight this long.
    # A warning, not a timeout: NIXL 1.5.1 cannot cancel a posted READ safely (a late copy could
    # land in blocks D has reused), so D keeps waiting. A healthy READ takes well under a second;
    # one past this points at the transport (docs/operations.md, "Slow READs").
    read_warn_seconds: float = 5.0
    # P (replay, prefix caching on a hybrid): how many tokens beyond its minimum D may recompute
    # so that P prefills the whole prompt as aggregated serving does and the handoff resumes at
    # vLLM's prompt checkpoint (which both sides then keep). None: no bound, so neither side
    # reuses less than aggregated serving. Past the bound P truncates its prefill and loses
    # part of that reuse. handoff.plan_handoff.
    max_checkpoint_recompute: int | None = None
    # D forgets a P engine no load has used for this long (its NIXL agent, descriptor lists and
    # side-channel sockets): vLLM gives every P start a fresh engine id, so a P restarted or
    # scaled away is never used again. A forgotten P that comes back costs one handshake.
    prefill_engine_idle_seconds: float = 600.0

    # Filled by parse_settings from the file or the environment; excluded from repr.
    secret: bytes = msgspec.field(default=b"", name="_secret")

    def prefill_hosts(self) -> list[str]:
        """``allowed_prefill_hosts`` with its default filled in (see the setting)."""
        if self.allowed_prefill_hosts is not None:
            return list(self.allowed_prefill_hosts)
        return [trust.ANY_HOST] if self.secret else [trust.LOCAL_HOST]

    def progress_delay_for(self, mem_type: str) -> int:
        """NIXL progress-thread poll delay (µs) for KV pages in ``mem_type`` memory."""
        if self.nixl_progress_delay_us is not None:
            return self.nixl_progress_delay_us
        return 100 if mem_type == "DRAM" else 0

    def __repr__(self) -> str:
        fields = {f: getattr(self, f) for f in self.__struct_fields__ if f != "secret"}
        return "ConnectorSettings(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    def __post_init__(self) -> None:
        if not 0 < self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port={self.side_channel_port} is not a TCP port")
        for name in (
            "lease_seconds",
            "claim_deadline_seconds",
            "max_hold_seconds",
            "handshake_timeout_seconds",
            "claim_wait_seconds",
            "read_warn_seconds",
            "prefill_engine_idle_seconds",
        ):
            value = getattr(self, name)
            # `not value > 0` also refuses NaN, which would make every deadline comparison false.
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {value}")
        # Equal is allowed: the first lease (at most the claim deadline) then ends at or before the
        # cap, so every claim P accepts gets a positive hold. Below, a claim inside the deadline
        # but past the cap could only be confirmed a 0 s hold (P refuses it as expired).
        if self.max_hold_seconds < self.claim_deadline_seconds:
            raise ValueError(
                f"max_hold_seconds={self.max_hold_seconds:g} is below claim_deadline_seconds="
                f"{self.claim_deadline_seconds:g}: P would free a handoff's blocks before D's time to "
                "claim it ends, and refuse claims that arrive in between. Raise max_hold_seconds to at "
                "least claim_deadline_seconds, or lower claim_deadline_seconds"
            )
        if not (0 <= self.idle_step_wait_ms <= 1000):
            raise ValueError(f"idle_step_wait_ms must be between 0 and 1000, got {self.idle_step_wait_ms}")
        if self.nixl_progress_delay_us is not None and not 0 <= self.nixl_progress_delay_us <= 1_000_000:
            raise ValueError(f"nixl_progress_delay_us must be between 0 and 1000000, got {self.nixl_progress_delay_us}")
        if self.nixl_read_chunk_mib < 0:
            raise ValueError(f"nixl_read_chunk_mib must be >= 0, got {self.nixl_read_chunk_mib}")
        if self.nixl_ucx_error_handling not in UCX_ERROR_HANDLING_MODES:
            raise ValueError(f"nixl_ucx_error_handling must be 'peer' or 'none', got {self.nixl_ucx_error_handling!r}")
        if self.min_recompute_tokens < 0:
            raise ValueError(f"min_recompute_tokens must be >= 0, got {self.min_recompute_tokens}")
        if self.max_checkpoint_recompute is not None and self.max_checkpoint_recompute < 0:
            raise ValueError(f"max_checkpoint_recompute must be >= 0, got {self.max_checkpoint_recompute}")
        if self.nixl_num_threads < 0:
            raise ValueError(f"nixl_num_threads must be >= 0, got {self.nixl_num_threads}")
        if self.allowed_prefill_hosts is not None:
            trust.parse_allow_list(self.allowed_prefill_hosts)  # ValueError naming a bad entry
        if not self.nixl_backends or not all(b.strip() for b in self.nixl_backends):
            raise ValueError(f"nixl_backends must name NIXL backends, got {self.nixl_backends}")


ENV_PREFIX = "PD_CONNECTOR_"


SECRET_ENV = ENV_PREFIX + "SHARED_SECRET"


def parse_settings(extra_config: dict[str, Any] | None, environ=os.environ) -> ConnectorSettings:
    """Settings from ``kv_connector_extra_config`` (typed JSON: strict types), then
    ``PD_CONNECTOR_<KEY>`` environment variables (strings, converted) for keys the config leaves
    out, then defaults."""
    raw = dict(extra_config or {})
    if "shared_secret" in raw or "_secret" in raw:
        raise ValueError(
            "pd_connector: do not put the shared secret in kv_connector_extra_config (vLLM logs "
            f"it at start-up); set {SECRET_ENV} or shared_secret_file instead"
        )
    known = [f for f in ConnectorSettings.__struct_fields__ if f != "secret"]
    unknown = sorted(set(raw) - set(known), key=repr)
    if unknown:
        raise ValueError(
            f"pd_connector: unknown kv_connector_extra_config key(s) {unknown}. Known keys: {', '.join(known)}"
        )
    types = {f.name: f.type for f in msgspec.structs.fields(ConnectorSettings)}
    for field in known:
        env = environ.get(ENV_PREFIX + field.upper())
        if field in raw or env is None:
            continue
        value: Any = [b.strip() for b in env.split(",")] if field == "nixl_backends" else env
        try:
            raw[field] = msgspec.convert(value, types[field], strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"pd_connector: invalid {ENV_PREFIX}{field.upper()}={env!r}: {exc}") from None
    if not isinstance(raw.get("shared_secret_file", ""), str):
        raise ValueError("pd_connector: invalid kv_connector_extra_config: shared_secret_file must be a path string")
    raw["_secret"] = _read_secret(raw.get("shared_secret_file", ""), environ)
    try:
        return msgspec.convert(raw, ConnectorSettings, strict=True)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(
            f"pd_connector: invalid kv_connector_extra_config: {exc}. Known keys: {', '.join(known)}"
        ) from None


def _read_secret(path: str, environ) -> bytes:
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"pd_connector: cannot read shared_secret_file {path!r}: {exc.strerror}") from None
        if not secret:
            raise ValueError(f"pd_connector: shared_secret_file {path!r} is empty")
        return secret
    return environ.get(SECRET_ENV, "").encode()
