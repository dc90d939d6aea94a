"""The replay offset lands where vLLM's own cache manager checkpoints Mamba state in align mode,
with and without EAGLE's last-unit drop (vllm#51295, #53945)."""

import os
from pathlib import Path

import pytest
from harness import connector_half, make_scheduler
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from pd_connector.core.handoff import RecomputeProfile, choose_replay_offset, min_recompute_tokens


@pytest.mark.parametrize("unit", [8, 16, 32, 384])
@pytest.mark.parametrize("eagle", [False, True])
def test_offset_on_vllm_mamba_checkpoint_grid(unit, eagle):
    profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=int(eagle), replay_grid=unit, eagle_drop=eagle)
    for n in range(1, 4 * unit + 3):
        expected = get_mamba_prefill_checkpoint_position(n, unit, eagle)
        assert choose_replay_offset(n, profile) == max(0, expected), (n, unit, eagle)


# --- the drop decision is vLLM's own, per speculative method ------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from pd_connector.dev.testing.tiny_models import build_model

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


@pytest.mark.parametrize("disable_drop", [False, True], ids=["drop-default", "drop-disabled"])
@pytest.mark.parametrize("name", list(SPECULATIVE))
def test_eagle_drop_and_offset_follow_vllms_scheduler(models, name, disable_drop):
    """P's profile drops the last grid unit exactly when vLLM's Scheduler does
    (``Scheduler.use_eagle_block_drop``, from ``SpeculativeConfig.use_eagle_block_drop()``), and
    the offset is vLLM's Mamba checkpoint position for that prompt length."""
    target, spec = SPECULATIVE[name]
    spec = {**spec, "disable_eagle_block_drop": disable_drop}
    if "model" in spec:
        spec["model"] = models[spec["model"]]
    scheduler = make_scheduler(
        models[target], "kv_producer", groups=("attention", "mamba"), prefix_caching=True,
        mamba_mode="align", speculative=spec,
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
    grid = profile.replay_grid
    assert grid == 16
    for n in range(1, 4 * grid + 3):
        checkpoint = get_mamba_prefill_checkpoint_position(n, grid, scheduler.use_eagle_block_drop, **lookahead)
        offset = choose_replay_offset(n, profile)
        if profile.eagle_drop or min_recompute_tokens(profile) == 1:
            assert offset == checkpoint, (n, offset, checkpoint)
        else:
            # Multi-module MTP without the drop: vLLM accepts a drafter KV for the last
            # lookahead - 1 positions computed without their next tokens; P recomputes them on D
            # instead, so its offset may sit one grid unit below vLLM's checkpoint.
            assert offset % grid == 0 and checkpoint - grid <= offset <= checkpoint, (n, offset, checkpoint)


@pytest.mark.parametrize("disable_drop", [False, True], ids=["drop-default", "drop-disabled"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "dflash", "dspark", "ngram", "draft_model"])
def test_eagle_drop_is_vllms_predicate_for_every_method(method, disable_drop):
    """Methods whose drafters cannot be built here (dflash, dspark) included: the profile takes
    vLLM's ``use_eagle_block_drop()``, so 0.33 leaving dflash/dspark out (their draft KV does not
    depend on the next token, ``needs_eagle_block_drop``) reaches P's offset."""
    from types import SimpleNamespace

    from vllm.config import SpeculativeConfig

    from pd_connector.engine.compat import eagle_block_drop

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
