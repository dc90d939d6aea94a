"""The core's restatement of vLLM's prompt checkpoint, and the handoff plan built on it, against
vLLM's own function (``get_mamba_prefill_checkpoint_position``, vllm/v1/kv_cache_interface.py)
and vLLM's Scheduler: block-sized and finer prefix match units, every speculative method, with
and without the EAGLE drop (vllm#51295, #53945)."""

import os
from pathlib import Path

import pytest
from rig.scheduler_harness import connector_half, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import MambaSpec, get_mamba_prefill_checkpoint_position

from pd_connector.core.handoff import plan_handoff
from pd_connector.core.recompute_profile import RecomputeProfile, mamba_checkpoint_position, min_recompute_tokens

units = st.sampled_from([8, 16, 32, 64, 384, 640])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 20_000), units, st.booleans())
def test_checkpoint_position_is_vllms(n, unit, drop):
    assert mamba_checkpoint_position(n, unit, drop) == get_mamba_prefill_checkpoint_position(n, unit, drop)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 20_000), units, st.sampled_from([0, 1, 3]), st.booleans(), st.integers(0, 2000))
def test_plan_lands_on_vllms_checkpoint_only_within_budget(n, unit, lookahead, drop, budget):
    """The offset is vLLM's checkpoint when that costs D at most ``budget`` extra tokens
    (``max_checkpoint_recompute``), else N - tail: D recomputes only its minimum by default."""
    profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=lookahead, checkpoint_unit=unit, eagle_drop=drop)
    tail = max(1, lookahead - 1)
    plan = plan_handoff(n, profile, max_checkpoint_recompute=budget)
    checkpoint = get_mamba_prefill_checkpoint_position(n, unit, drop)
    assert plan.checkpoint == checkpoint
    if 0 < checkpoint and n - tail - budget <= checkpoint <= n - tail:
        assert plan.replay_offset == checkpoint
    else:
        assert plan.replay_offset == max(0, n - tail)


# --- the drop decision is vLLM's own, per speculative method ------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from rig.tiny_models import build_model

    root = Path(os.environ.get("PD_TEST_MODEL_ROOT") or tmp_path_factory.mktemp("models"))
    return {kind: str(build_model(kind, root)) for kind in ("llama", "eagle_llama", "qwen3_next_mtp")}


# (target, --speculative-config without disable_eagle_block_drop). mtp-3 is multi-module MTP:
# the drafter reads 3 tokens ahead (VllmConfig.num_prefill_lookahead_tokens).
SPECULATIVE = {
    "ngram": ("llama", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
    "draft_model": ("llama", {"method": "draft_model", "model": "llama", "num_speculative_tokens": 2}),
    "eagle": ("llama", {"method": "eagle", "model": "eagle_llama", "num_speculative_tokens": 2}),
    "eagle3": ("llama", {"method": "eagle3", "model": "eagle_llama", "num_speculative_tokens": 2}),
    "mtp-1": ("qwen3_next_mtp", {"method": "mtp", "num_speculative_tokens": 1}),
    "mtp-3": ("qwen3_next_mtp", {"method": "mtp", "num_speculative_tokens": 3}),
}


def _mamba_manager(scheduler):
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    return next(m for m in managers if isinstance(m.kv_cache_spec, MambaSpec))


@pytest.mark.parametrize("pmu", [None, 4], ids=["unit-block", "pmu-4"])
@pytest.mark.parametrize("disable_drop", [False, True], ids=["drop-default", "drop-disabled"])
@pytest.mark.parametrize("name", list(SPECULATIVE))
def test_eagle_drop_and_offset_follow_vllms_scheduler(models, name, disable_drop, pmu):
    """P's profile drops the last unit exactly when vLLM's Scheduler does
    (``Scheduler.use_eagle_block_drop``, from ``SpeculativeConfig.use_eagle_block_drop()``), its
    unit is the Mamba manager's ``cache_hit_alignment_tokens`` (a ``prefix_match_unit`` below the
    block included), the plan's checkpoint is vLLM's for that prompt length, and the offset is
    N - tail, or that checkpoint when ``max_checkpoint_recompute`` covers the distance."""
    target, spec = SPECULATIVE[name]
    spec = {**spec, "disable_eagle_block_drop": disable_drop}
    if "model" in spec:
        spec["model"] = models[spec["model"]]
    scheduler = make_scheduler(
        models[target], "kv_producer", groups=("attention", "mamba"), prefix_caching=True,
        mamba_mode="align", speculative=spec, prefix_match_unit=pmu,
    )  # fmt: skip
    spec_config = scheduler.vllm_config.speculative_config
    assert spec_config.method == spec["method"]
    profile = connector_half(scheduler).profile
    assert profile.eagle_drop == scheduler.use_eagle_block_drop == spec_config.use_eagle_block_drop()
    if name.startswith(("eagle", "mtp")):
        assert profile.eagle_drop != disable_drop  # negative control: the flag reaches the profile
    lookahead = {}
    if hasattr(scheduler, "num_hash_lookahead_tokens"):  # vLLM 0.33; 0 with a KV connector
        lookahead["num_hash_lookahead_tokens"] = scheduler.num_hash_lookahead_tokens
    manager = _mamba_manager(scheduler)
    unit = manager.cache_hit_alignment_tokens
    assert unit == (pmu or 16) == profile.checkpoint_unit
    assert manager.drop_eagle_checkpoint_block == profile.eagle_drop
    tail = min_recompute_tokens(profile)
    for n in range(1, 4 * 16 + 3):
        checkpoint = get_mamba_prefill_checkpoint_position(n, unit, manager.drop_eagle_checkpoint_block, **lookahead)
        assert plan_handoff(n, profile).replay_offset == max(0, n - tail), n
        traded = plan_handoff(n, profile, max_checkpoint_recompute=10**6)
        assert traded.checkpoint == checkpoint, n
        # The checkpoint when there is one D can resume from (below N - tail), else N - tail.
        assert traded.replay_offset == (checkpoint if 0 < checkpoint <= n - tail else max(0, n - tail)), n


@pytest.mark.parametrize("disable_drop", [False, True], ids=["drop-default", "drop-disabled"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "dflash", "dspark", "ngram", "draft_model"])
def test_eagle_drop_is_vllms_predicate_for_every_method(method, disable_drop):
    """Methods whose drafters cannot be built here (dflash, dspark) included: the profile takes
    vLLM's ``use_eagle_block_drop()``, so 0.33 leaving dflash/dspark out (their draft KV does not
    depend on the next token, ``needs_eagle_block_drop``) reaches P's offset."""
    from types import SimpleNamespace

    from vllm.config import SpeculativeConfig

    from pd_connector.engine.from_vllm.vllm_config import eagle_block_drop

    spec_config = SpeculativeConfig.__new__(SpeculativeConfig)  # the predicates read two fields
    object.__setattr__(spec_config, "method", method)
    object.__setattr__(spec_config, "disable_eagle_block_drop", disable_drop)
    drop = eagle_block_drop(SimpleNamespace(speculative_config=spec_config))
    assert drop == spec_config.use_eagle_block_drop()
    if disable_drop or method in ("ngram", "draft_model"):
        assert not drop
    elif method in ("dflash", "dspark"):
        # 0.32 drops for every EAGLE-family method; 0.33 only where the drafter needs it.
        assert drop == (not hasattr(spec_config, "needs_eagle_block_drop"))
    else:
        assert drop
