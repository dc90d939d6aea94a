"""Test and demo tooling for pd_connector.

Nothing in here is imported by the connector itself. The submodules are:

- ``tiny_models``: offline, seeded tiny random-weight HF models (+ a byte-level BPE tokenizer)
  that vLLM CPU can serve in float32.
- ``servers``: start/stop vLLM OpenAI api_server processes safely (log files, readiness
  polling), with ``process_groups`` (signal a server's whole group, read from /proc) and
  ``prometheus`` (parse and read ``/metrics``).
- ``placement``: ``VLLM_CPU_OMP_THREADS_BIND`` for instances that run at once (never two on one
  pinned core).
- ``oracle``: greedy token-id completions with logprobs, and a margin-aware comparison of a
  candidate (e.g. P/D) output against a reference (aggregated) output.
- ``stack``: baseline + P + D + proxy, started together (tests/e2e, demo, integration script).
- ``speculative_models``: the tiny Qwen3-Next with MTP modules and an EAGLE-1 drafter.
- ``spec_matrix``: kv_both instances per speculative config, the P x D skew matrix, bf16 oracle.
- ``scheduler_harness``: vLLM's in-process Scheduler with PDConnector (tests/vllm, benchmarks).
- ``netns``: two "hosts" on one machine (network, UTS and mount namespaces, a boot id each),
  for P and D that UCX must reach over TCP; ``ucx_logs`` reads UCX's ``UCX_PROTO_INFO`` tables.
- ``router``: vllm-router (its own venv, ``.venv-router``) in P/D mode in front of test servers.

Submodules are imported lazily by the caller so that ``import pd_connector.dev.testing`` stays cheap
(``tiny_models`` pulls in torch and transformers).
"""
