# Two commands on a fresh machine:  `make demo`  and  `make test`.
VENV := .venv
STAMP := $(VENV)/.pd-installed
# vLLM 0.33 (CUDA wheel, no CPU build): its in-process scheduler only, next to CPU torch.
VENV033 := .venv-vllm033
STAMP033 := $(VENV033)/.pd-installed
# What runs against vLLM 0.33: tests/vllm, every test that imports vLLM and starts no server
# (tests/unit imports no vLLM: tests/unit/test_house.py).
TESTS033 := tests/vllm

.PHONY: demo test unit test-vllm033 matrix venv venv033 clean-venv

$(STAMP): requirements/cpu.txt pyproject.toml scripts/setup_venv.sh scripts/setup_router_venv.sh
	bash scripts/setup_venv.sh
	touch $@

$(STAMP033): requirements/vllm033.txt scripts/setup_venv_vllm033.sh
	bash scripts/setup_venv_vllm033.sh
	touch $@

venv: $(STAMP)

venv033: $(STAMP033)

# A P/D run on CPU with a tiny hybrid model, checked token by token against aggregated serving.
demo: $(STAMP)
	$(VENV)/bin/python -m examples.demo

# Everything on vLLM CPU 0.32 (pure core, in-process vLLM Scheduler, real NIXL, end-to-end vLLM
# CPU servers), then the in-process Scheduler suite on vLLM 0.33. Each run ends with its wall
# time per test module and records its outcomes (tests/conftest.py); docs/correctness-matrix.md
# is regenerated from them whatever the result, and the exit status stays pytest's.
# (No $(MAKE) in this recipe: make -n would run it.)
test: $(STAMP) $(STAMP033)
	status=0; \
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=25 || status=$$?; \
	if [ $$status -eq 0 ]; then $(RUN_TESTS033) || status=$$?; fi; \
	$(RUN_MATRIX) || echo "matrix: docs/correctness-matrix.md not regenerated"; \
	exit $$status

# -rs: a test that cannot apply on 0.33 (NIXL, servers) says why it was skipped. vLLM's cache of
# model inspections is keyed by module name, not version: one per environment.
RUN_TESTS033 = VLLM_CACHE_ROOT=$(VENV033)/vllm-cache $(VENV033)/bin/python -m pytest -q -p no:cacheprovider -rs $(TESTS033)
test-vllm033: $(STAMP033)
	$(RUN_TESTS033)

# docs/correctness-matrix.md from the outcomes the last test runs recorded (.artifacts/test-outcomes.json,
# merged over runs; PD_TEST_OUTCOMES names another file). Standard library only.
RUN_MATRIX = $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3) -m rig.correctness_matrix
matrix:
	$(RUN_MATRIX)

# The fast part only (no vLLM servers).
unit: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not e2e"

clean-venv:
	rm -rf $(VENV) $(VENV033) .venv-router
