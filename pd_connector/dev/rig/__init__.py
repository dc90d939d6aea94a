"""The rig the demo, ``pd-connector bench`` and scripts/ run P/D on: tiny models, local vLLM
servers and stacks, the oracle, vLLM's in-process Scheduler, synthetic TP ranks.

Why a package of its own, named after what it is: every module here is needed at run time by a
shipped tool (``pd-connector demo``, a benchmark) or by scripts/integration.py and
scripts/spec_skew_matrix.py, and that is why it ships. What only tests use lives in
tests/support. tests/unit/test_house.py checks both (every module of the package is reached
from an entry point that is not a test; nothing in the package imports tests/support). Nothing
in here is imported by the connector itself. The submodules are:

- ``tiny_models``: offline, seeded tiny random-weight HF models (+ a byte-level BPE tokenizer)
  that vLLM CPU can serve in float32; ``speculative_models``: the tiny Qwen3-Next with MTP
  modules and an EAGLE-1 drafter; ``cpu_matrix``: the CPU model matrix and its prompts.
- ``servers``: start/stop vLLM OpenAI api_server processes safely (log files, readiness
  polling), with ``process_groups`` (signal a server's whole group, read from /proc),
  ``prometheus`` (parse and read ``/metrics``), ``ports`` and ``proxy_process``.
- ``placement``: ``VLLM_CPU_OMP_THREADS_BIND`` for instances that run at once (never two on one
  pinned core).
- ``oracle``: greedy token-id completions with logprobs, and a margin-aware comparison of a
  candidate (e.g. P/D) output against a reference (aggregated) output.
- ``stack``: baseline + P + D + proxy, started together (demo, scripts/integration.py,
  benchmarks, tests/e2e).
- ``spec_matrix``: kv_both instances per speculative config, the P x D skew matrix, bf16 oracle
  (scripts/spec_skew_matrix.py, tests/e2e).
- ``scheduler_harness``: vLLM's in-process Scheduler with PDConnector (``bench scheduler``,
  tests/vllm).
- ``tp_layouts``: synthetic tensor-parallel ranks registered with NIXL (``bench transfer_tp``,
  tests/nixl), their buffers on ``devices`` (``PD_TEST_DEVICE``: DRAM or VRAM).
- ``netns``: two "hosts" on one machine (network, UTS and mount namespaces, a boot id each),
  for P and D that UCX must reach over TCP; ``ucx_logs`` reads UCX's ``UCX_PROTO_INFO`` tables
  (``bench transfer``'s tcp section, tests/e2e/test_two_hosts.py).

Submodules are imported lazily by the caller so that ``import pd_connector.dev.rig`` stays cheap
(``tiny_models`` pulls in torch and transformers).
"""
