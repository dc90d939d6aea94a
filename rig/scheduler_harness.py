"""In-process vLLM ``Scheduler`` with PDConnector: no engine, no worker, no GPU.

Mirrors upstream ``tests/v1/kv_connector/unit/utils.py`` (not shipped in the wheel); signatures
from vLLM 0.32.0, unchanged in 0.33. The worker is simulated by feeding
``KVConnectorOutput`` back through ``update_from_output``. Used by
``benchmarks.scheduler``, hence inside the package, and by tests/vllm.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from rig.faults import FAULT_CONNECTOR

EOS = 2
BLOCK = 16
_ids = itertools.count()
init_none_hash(sha256)


def make_scheduler(
    model_dir: str,
    role: str,
    *,
    groups: tuple[str, ...] = ("attention",),
    prefix_caching: bool = False,
    num_speculative_blocks: int = 0,
    mamba_mode: str = "none",
    extra_config: dict[str, Any] | None = None,
    max_num_batched_tokens: int = 1024,
    num_blocks: int = 1000,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    block_size: int = BLOCK,
    mamba_block_size: int | None = None,
    prefix_match_unit: int | None = None,
    retention_interval: int | None = 0,
    speculative: dict[str, Any] | None = None,
    dp_index: int | None = None,
    dp_lockstep: bool = False,
    tp_size: int = 1,
    mamba_exports_checkpoints: bool = False,
    cache_block_size: int | None = None,
    faults: bool = False,
    kv_events: bool = False,
) -> Scheduler:
    """``block_size``: every group's (the attention groups' and, unless ``mamba_block_size``
    is given, the Mamba groups'). vLLM itself gives a real hybrid an attention block size of
    hundreds of tokens (``Platform._align_hybrid_block_size``: attention page >= Mamba page) and
    Mamba groups ``max_model_len`` when prefix caching is off (one block per request,
    ``HybridAttentionMambaModelConfig`` in model_executor/models/config.py); the tests use
    16 everywhere to exercise many blocks per group. ``speculative``: ``--speculative-config``'s
    fields (vLLM builds the config, drafter model included, as the engine would).

    ``mamba_mode="align"`` is set on the cache config as well as on the spec (the Scheduler reads
    ``cache_config.mamba_cache_mode`` for its block-aligned chunking). ``prefix_match_unit`` and
    ``retention_interval`` are vLLM's cache-config fields (``retention_interval`` defaults to
    vLLM's own default, 0; None = dense retention). ``dp_index``: the engine is that DP rank of
    a DP group (``dp_lockstep``: a MoE model's, whose ranks step together); ``tp_size``: the
    engine's TP size as its scheduler sees it. ``mamba_exports_checkpoints``: the Mamba groups'
    backend writes prefill checkpoints inside a chunk, as vLLM's Mamba2 mixer declares
    (``num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1``). ``cache_block_size``:
    ``cache_config.block_size`` when it differs from the groups' (vLLM CPU's API server keeps
    128 there under a hybrid's 640-token blocks; the scheduler ends prefill chunks on it).
    ``faults``: the connector is the rig's FaultInjectingConnector (rig/faults.py's keys)."""
    mamba_block_size = mamba_block_size or block_size
    model_config = ModelConfig(model=model_dir, dtype="float16", seed=42, max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=cache_block_size or block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=prefix_caching,
        mamba_cache_mode=mamba_mode,
        prefix_match_unit=prefix_match_unit,
        prefix_cache_retention_interval=retention_interval,
    )
    cache_config.kv_cache_layout = "LBHNC"
    connector = {"kv_connector": "PDConnector", "kv_connector_module_path": "pd_connector.connector"}
    kv_transfer_config = KVTransferConfig(
        **(FAULT_CONNECTOR if faults else connector),
        kv_role=role,
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra_config or {},
    )
    speculative_config = None
    if speculative is not None:
        # As EngineArgs.create_speculative_config does (vllm/engine/arg_utils.py).
        speculative_config = SpeculativeConfig(
            **speculative, target_model_config=model_config, target_parallel_config=ParallelConfig()
        )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        speculative_config=speculative_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        attention_config=AttentionConfig(backend=None),
        # kv_events: the block pool queues KV events and each step hands them to the publisher
        # ("null" here: a test swaps in a collector, tests/vllm/test_kv_events_mtp.py).
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )
    specs = []
    for i, kind in enumerate(groups):
        if kind == "attention":
            spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        elif kind == "sliding_window":
            spec = SlidingWindowSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=40
            )
        else:
            spec = MambaSpec(
                block_size=mamba_block_size,
                shapes=((4, 4), (4, 4)),
                dtypes=(torch.float32, torch.float32),
                mamba_cache_mode=mamba_mode,
                num_speculative_blocks=num_speculative_blocks,
                num_prefill_checkpoint_blocks=int(mamba_exports_checkpoints),
                prefill_checkpoint_alignment=1 if mamba_exports_checkpoints else None,
            )
        specs.append(KVCacheGroupSpec([f"layer{i}"], spec))
    # As get_kv_cache_config_from_groups does (vllm/v1/core/kv_cache_utils.py): the retention
    # interval lives on the KVCacheConfig too, where it defaults to None (dense) and not 0.
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=specs,
        prefix_cache_retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    vllm_config.parallel_config.tensor_parallel_size = tp_size
    if dp_index is not None:
        # As run_engine_core does for each DP engine (vllm/v1/engine/core.py): the engine id
        # gets the rank, and a dense model's rank runs alone (data_parallel_index kept).
        vllm_config.kv_transfer_config.engine_id = f"{vllm_config.kv_transfer_config.engine_id}_dp{dp_index}"
        parallel = vllm_config.parallel_config
        parallel.data_parallel_size = 2 if dp_lockstep else 1
        parallel.data_parallel_rank = dp_index if dp_lockstep else 0
        parallel.data_parallel_index = dp_index
    # As EngineCore does (vllm/v1/engine/core.py): the scheduler's block size is the LCM of the
    # groups' and requests are hashed at hash_block_size (make_request's block_size).
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    # EngineCore sets it on the scheduler's copy before building the Scheduler (and its connector).
    kv_cache_config.hash_block_size = hash_block_size
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )


def make_request(
    prompt: list[int],
    params: dict[str, Any] | None,
    max_tokens: int = 8,
    block_size: int = BLOCK,
    request_id: str | None = None,
    **request_kw: Any,
) -> Request:
    """``block_size``: the scheduler's ``hash_block_size`` (16 unless make_scheduler was given
    other block sizes); ``request_kw``: more ``Request`` arguments (cache_salt, lora_request,
    mm_features)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sp.update_from_generation_config({}, EOS)
    req = Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        pooling_params=None,
        mm_features=request_kw.pop("mm_features", None),
        block_hasher=get_request_block_hasher(block_size, sha256),
        **request_kw,
    )
    req.kv_transfer_params = params
    return req


def run_step(scheduler: Scheduler, *, token: int = 7, kv_output: KVConnectorOutput | None = None):
    """One engine step: schedule, then report one sampled token per scheduled request whose
    prefill completed (vLLM discards samples of partial prefills)."""
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        # schedule() has already advanced num_computed_tokens by the scheduled chunk.
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([token] if done else [])
    mro = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_output,
    )
    engine_outputs = scheduler.update_from_output(out, mro)
    return out, engine_outputs


def finished_params(engine_outputs) -> dict[str, dict]:
    """request id -> kv_transfer_params of requests that finished in this step."""
    found = {}
    for eco in engine_outputs.values():
        for o in eco.outputs:
            if o.finish_reason is not None:
                found[o.request_id] = o.kv_transfer_params
    return found


def connector_half(scheduler: Scheduler):
    return scheduler.connector._scheduler
