"""The rig: what the tests, the benchmarks (benchmarks/), the demo (examples/) and scripts/ run
P/D on. It lives in the checkout beside them and is never installed (the wheel is the connector,
the proxy and ``pd-connector check``: tests/unit/test_house.py). Imported as ``rig`` from the
checkout's root (tests/conftest.py, ``python -m benchmarks``, ``python -m examples.demo``). The
submodules are:

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
- ``scheduler_harness``: vLLM's in-process Scheduler with PDConnector (``benchmarks scheduler``,
  tests/vllm).
- ``tp_layouts``: synthetic tensor-parallel ranks registered with NIXL (``benchmarks transfer_tp``,
  tests/nixl), their buffers on ``devices`` (``PD_TEST_DEVICE``: DRAM or VRAM).
- ``netns``: two "hosts" on one machine (network, UTS and mount namespaces, a boot id each),
  for P and D that UCX must reach over TCP; ``ucx_logs`` reads UCX's ``UCX_PROTO_INFO`` tables
  (``benchmarks transfer``'s tcp section, tests/e2e/test_two_hosts.py).
- ``handoff_table``: the demo's table (aggregated vs P/D, replay and zero replay).
- What only tests use: ``fake_upstreams`` (the proxy and check tests' upstreams),
  ``vllm_pages``/``vllm_states``/``attention_pages`` (pages vLLM builds, for the layout tests),
  ``tp_matrix``/``dp_matrix``/``block_size_pairs`` (the e2e matrices), ``router`` (vllm-router
  in front of test servers), ``kv_events`` (a KV-event collector), ``openai_client``,
  ``dashboard``, ``kv_cache`` and ``handoff_strategies`` (hypothesis strategies).
- ``fault_connector``: ``FaultInjectingConnector``, PDConnector plus the negative controls'
  faults, which a D loads instead (``kv_connector_module_path: rig.fault_connector``); the keys
  a request asks for them by, and the connector's kv_transfer_config fields, in ``faults``
  (pure); its worker half in ``fault_receiver`` (no vLLM: tests/nixl).
- ``correctness_matrix``: the declared cells of docs/correctness-matrix.md, the pytest plugin
  that records each test's outcome, and the page's generator (``make matrix``).
- ``dashboard_render``: dashboards/pd_connector.json drawn from a real run's scrapes
  (docs/img/dashboard.png).

Submodules are imported lazily by the caller so that ``import rig`` stays cheap
(``tiny_models`` pulls in torch and transformers).
"""
