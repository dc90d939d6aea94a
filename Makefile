# Two commands on a fresh machine:  `make demo`  and  `make test`.
VENV := .venv
STAMP := $(VENV)/.pd-installed

.PHONY: demo test unit venv clean-venv

$(STAMP): requirements/cpu.txt pyproject.toml scripts/setup_venv.sh scripts/setup_router_venv.sh
	bash scripts/setup_venv.sh
	touch $@

venv: $(STAMP)

# A P/D run on CPU with a tiny hybrid model, checked token by token against aggregated serving.
demo: $(STAMP)
	$(VENV)/bin/pd-connector demo

# Everything: pure core, in-process vLLM Scheduler, real NIXL, end-to-end vLLM CPU servers.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

# The fast part only (no vLLM servers).
unit: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not e2e"

clean-venv:
	rm -rf $(VENV) .venv-router
