"""Speculative-decoding configurations on one hybrid target, and the P x D skew matrix.

Each configuration runs as one vLLM CPU instance with ``kv_role: kv_both``, so the same instance
is P for requests with ``do_remote_decode``, D for requests carrying P's ``kv_transfer_params``,
and the aggregated reference for plain requests. A cell (P config, D config) is then a handoff from
one instance to another; the diagonal is an instance handing a request to itself (NIXL loopback),
which exercises the same side channel, claim, READ and slot pairing as two instances.

Shared by ``tests/e2e/test_speculative.py`` (PDConnector) and
``scripts/spec_skew_matrix.py`` (which also runs vLLM's NixlConnector on the same matrix:
docs/benchmarks.md, "Speculative skew with vLLM's NixlConnector").
The expected outcome of a cell is computed with the connector's own pure rule (``core/handoff.py``)
from what each configuration demands, so the test checks the running system against the rule and
the output against aggregated serving.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pd_connector.core.handoff import plan_handoff
from pd_connector.core.recompute_profile import RecomputeProfile, min_recompute_tokens
from pd_connector.core.params import KEY_MIN_RECOMPUTE, PREFILL_REQUEST_PARAMS
from rig.oracle import Completion, Verdict, compare, complete
from rig.placement import cpu_binds
from rig.ports import free_port
from rig.servers import VllmServer, source_checkout_env, start_many
from rig.speculative_models import MTP_MODULES

# Connector settings of the many-instance test modules. NIXL's progress thread stays on (its
# default): without it a peer's UCX wire-up waits for the other engine to step, and two kv_both
# instances connecting to each other stall for tens of seconds. Generous timeouts: with four
# instances on two cores a first handshake can go unanswered for 5 s and a 30 s lease can expire
# before D's claim arrives; such a handoff is recomputed correctly but counted as a load
# failure, not as the outcome the skew matrix expects.
SPEC_EXTRA_CONFIG = {"handshake_timeout_seconds": 20, "lease_seconds": 120}

# bf16 oracle thresholds (GDN runs only in bf16 on CPU). Measured on the tiny Qwen3-Next with
# agreeing configurations: chosen-token logprobs of P/D and aggregated serving differ by at most
# ~4e-3 where tokens match (about one bf16 step at these logit sizes: the P/D split changes the
# accumulation order of GDN's chunked kernel). A wrong state moved them by 1e-2 and more and
# flipped tokens with margins up to 5e-2; a 2e-2 tie margin would hide the conv-state mis-pairing
# that tests/unit/test_state_regions.py pins. The negative control
# in tests/e2e/test_speculative.py must fail nearly every prompt at these thresholds.
BF16_TIE_MARGIN = 8e-3
BF16_LOGPROB_TOL = 1e-2


def check_bf16(reference: Completion, candidate: Completion) -> Verdict:
    return compare(reference, candidate, tie_margin=BF16_TIE_MARGIN, logprob_tol=BF16_LOGPROB_TOL)


HONOURED = "honoured"
REFUSED_OFFSET = "refused:offset_above_requirement"
# Different drafter KV = different KV-cache layouts: D's scheduler refuses a different group count
# before anything moves; equal counts with other layers fail at the handshake.
REFUSED_LAYOUT = "refused:layout"
LAYOUT_EVENTS = ("refused:group_mismatch", "load_failed:handshake")


@dataclass(frozen=True)
class SpecSetup:
    name: str
    speculative_config: dict[str, Any] | None
    # vLLM's VllmConfig.num_prefill_lookahead_tokens for this config on the tiny Qwen3-Next
    # (3 MTP modules: k > 1 is multi-module MTP, lookahead k; EAGLE-family k = 1: 1; ngram: 0).
    lookahead: int
    # The drafter's own KV in the cache ("none" for ngram): P and D must agree on it.
    drafter_kv: str

    @property
    def profile(self) -> RecomputeProfile:
        return RecomputeProfile(has_recurrent_state=True, prefill_lookahead=self.lookahead)

    def server_args(self) -> list[str]:
        if self.speculative_config is None:
            return []
        return ["--speculative-config", json.dumps(self.speculative_config)]


def _mtp(k: int) -> SpecSetup:
    return SpecSetup(
        f"mtp{k}",
        {"method": "mtp", "num_speculative_tokens": k},
        lookahead=k if min(k, MTP_MODULES) > 1 else 1,
        drafter_kv="mtp",
    )


NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SETUPS: dict[str, SpecSetup] = {
    s.name: s
    for s in (
        SpecSetup("off", None, 0, "none"),
        SpecSetup("ngram", NGRAM_CONFIG, 0, "none"),
        SpecSetup("ngram_b", NGRAM_CONFIG, 0, "none"),
        _mtp(1),
        _mtp(2),
        _mtp(3),
    )
}
# The P x D matrix of tests/e2e/test_speculative.py: one kv_both instance each, for the session.
MATRIX_SETUPS = ("off", "mtp1", "mtp2", "mtp3")


def expected_outcome(
    p: SpecSetup, d: SpecSetup, num_prompt_tokens: int, hint: bool = False, p_floor: int = 0
) -> tuple[str, int]:
    """(outcome, replay offset P offers) for one handoff, by the connector's own rule.

    A different drafter KV means different KV-cache layouts: the handshake refuses the pair and D
    recomputes. Otherwise D honours P's offset iff it leaves D's own minimum tail; with the
    router's hint (``pd_min_recompute_tokens``), or P's ``min_recompute_tokens`` setting
    (``p_floor``) at D's minimum, P backs off far enough for D.
    """
    requested = min_recompute_tokens(d.profile) if hint else 0
    offset = plan_handoff(num_prompt_tokens, p.profile, requested, p_floor).replay_offset
    if offset == 0:
        return HONOURED, 0  # nothing to hand over: D prefills, nothing to refuse
    if p.drafter_kv != d.drafter_kv:
        return REFUSED_LAYOUT, offset
    if num_prompt_tokens - offset < min_recompute_tokens(d.profile):
        return REFUSED_OFFSET, offset
    return HONOURED, offset


@dataclass
class SpecInstance:
    """One kv_both vLLM instance with a speculative setup."""

    setup: SpecSetup
    server: VllmServer
    served_model_name: str = "tiny"

    def reference(self, prompt: Sequence[int], max_tokens: int) -> Completion:
        return complete(self.server.base_url, self.served_model_name, prompt, max_tokens)

    def prefill(self, prompt: Sequence[int], **extra: Any) -> dict[str, Any]:
        out = complete(
            self.server.base_url,
            self.served_model_name,
            prompt,
            1,
            logprobs=None,
            kv_transfer_params={**PREFILL_REQUEST_PARAMS, **extra},
        )
        return out.kv_transfer_params or {}

    def decode(self, prompt: Sequence[int], params: dict[str, Any], max_tokens: int) -> Completion:
        return complete(self.server.base_url, self.served_model_name, prompt, max_tokens, kv_transfer_params=params)

    def events(self) -> dict[str, float]:
        from rig.prometheus import read_metric_labels

        out: dict[str, float] = {}
        for labels in read_metric_labels(self.server.base_url, "vllm:pd_events_total"):
            event = labels.get("event")
            if event and event not in out:
                out[event] = self.server.metric("vllm:pd_events_total", {"event": event}) or 0.0
        return out


def caught_desyncs(
    p: SpecInstance, d: SpecInstance, prompts: Sequence[Sequence[int]], max_tokens: int, reference, same=None
) -> list[bool]:
    """Negative control: per prompt, whether the oracle (``same(reference, candidate)``, the bf16
    rule by default) catches D resuming one token early on the state P computed for its offset
    (what a P/D pair backing off differently does). ``reference(prompt)`` is D's aggregated
    output. Needs D to run the rig's FaultInjectingConnector (``InstanceSpec.faults``)."""
    from rig.faults import RESUME_SHIFT

    from rig.oracle import CompletionError

    same = same or (lambda ref, got: check_bf16(ref, got).ok)
    caught = []
    for prompt in prompts:
        params = {**p.prefill(prompt), RESUME_SHIFT: -1}
        try:
            got = d.decode(prompt, params, max_tokens)
        except CompletionError as exc:
            # A state that far off can make D's logprobs non-finite, which vLLM's API server
            # cannot serialize ("Out of range float values are not JSON compliant"): caught too.
            assert "Out of range float" in str(exc), exc
            caught.append(True)
            continue
        caught.append(not same(reference(prompt), got))
    return caught


def handoff(p: SpecInstance, d: SpecInstance, prompt: Sequence[int], max_tokens: int, hint: bool = False):
    extra = {KEY_MIN_RECOMPUTE: min_recompute_tokens(d.setup.profile)} if hint else {}
    params = p.prefill(prompt, **extra)
    return params, d.decode(prompt, params, max_tokens)


@dataclass
class InstanceSpec:
    """How to start the instances: the model, flags and connector settings."""

    model: str
    log_dir: Path
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    server_args: Sequence[str] = ("--no-enable-prefix-caching", "--block-size", "32")
    extra_config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    kv_connector: str = "PDConnector"
    # PDConnector's instances load the rig's FaultInjectingConnector (rig/faults.py) instead.
    faults: bool = False


def kv_both_config(spec: InstanceSpec) -> str:
    if spec.kv_connector == "PDConnector":
        from rig.stack import kv_transfer_config

        return kv_transfer_config("kv_both", free_port(), "cpu", faults=spec.faults, **spec.extra_config)
    return json.dumps(
        {"kv_connector": spec.kv_connector, "kv_role": "kv_both", "kv_buffer_device": "cpu", **spec.extra_config}
    )


def make_instances(
    spec: InstanceSpec, setups: Sequence[SpecSetup | str], first_core: int = 0
) -> dict[str, SpecInstance]:
    """Unstarted instances, one per setup (``servers.start_many`` starts them in parallel).
    ``first_core``: for groups made separately but run together (see ``placement.cpu_binds``)."""
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    binds = cpu_binds(len(setups), first_core)
    for (bind, bind_env), setup in zip(binds, setups):
        setup = SETUPS[setup] if isinstance(setup, str) else setup
        env = {**source_checkout_env(), **bind_env, **spec.env}
        if spec.kv_connector != "PDConnector":
            # NixlConnector's side channel port comes from the environment (default 5600).
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        server = VllmServer(
            spec.model,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            extra_args=[*spec.server_args, *setup.server_args(), "--kv-transfer-config", kv_both_config(spec)],
            env=env,
            omp_threads_bind=bind,
            log_path=spec.log_dir / f"{setup.name}.log",
        )
        out[setup.name] = SpecInstance(setup, server)
    return out


@contextmanager
def running(*groups: dict[str, SpecInstance], timeout: float = 900.0):
    """Start every instance of ``groups`` in parallel; stop them all (by PID) on exit."""
    servers = [inst.server for group in groups for inst in group.values()]
    try:
        start_many(servers, timeout=timeout)
        yield groups[0] if len(groups) == 1 else groups
    finally:
        for server in servers:
            server.stop()
