# hippie-ds. On a fresh machine `make test` and `make demo` are the only commands needed:
# every target sets up what it uses (the virtual environment in .venv) by itself.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HIPPIE := $(VENV)/bin/hippie-ds
# Installed before the package, pinned: an unpinned torch resolves to the CUDA build (gigabytes);
# torch==2.13.0 is the CPU wheel on these machines.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

# What `make test` runs; e.g. `make test TESTS="tests tests/slow"` or PYTEST_FLAGS="-q -x".
TESTS ?= tests
PYTEST_FLAGS ?= -q

OUT ?= out
# The schedule demo: 4 stages, 8 micro-batches, 2 data-parallel replicas whose gradient all-reduce
# crosses a 1 Gbit/s link (125 MB/s); per stage 20 ms forward, 40 ms backward, 27.4 MB of parameters.
DEMO_SHAPE ?= --stages 4 --micro-batches 8
DEMO_COSTS ?= --forward 20ms --backward 40ms --activation-bytes 4MB --saved-bytes 30MB --param-bytes 27.4MB \
	--data-parallel 2 --allreduce-bandwidth 125MB/s

.PHONY: venv test demo schedule-demo clean distclean

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[test]'
	touch $@

test: $(STAMP)
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions $(PY) -m pytest $(PYTEST_FLAGS) $(TESTS)

# The demo trains the GPT example with the hippie schedule on 4 local ranks (2 stages x 2
# data-parallel replicas) and draws the executed schedule to $(OUT)/demo/timeline.png.
DEMO_RANKS ?= 4
DEMO_ARGS ?= --deepspeed_config configs/hippie.json --stages 2 --steps 40
demo: $(STAMP)
	OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions $(VENV)/bin/deepspeed \
		--num_gpus $(DEMO_RANKS) tools/train_gpt.py $(DEMO_ARGS) --out $(OUT)/demo

schedule-demo: $(STAMP)
	mkdir -p $(OUT)
	$(HIPPIE) schedule list
	for s in 1f1b gpipe hippie hippie-1f1b; do $(HIPPIE) schedule validate $$s $(DEMO_SHAPE) || exit 1; done
	$(HIPPIE) schedule simulate 1f1b gpipe hippie hippie-1f1b $(DEMO_SHAPE) $(DEMO_COSTS)
	$(HIPPIE) schedule trace hippie $(DEMO_SHAPE) $(DEMO_COSTS) --out $(OUT)/hippie.json
	$(HIPPIE) schedule trace 1f1b $(DEMO_SHAPE) $(DEMO_COSTS) --out $(OUT)/1f1b.json
	@echo "Chrome traces (open in chrome://tracing or ui.perfetto.dev) and timelines: $(OUT)/{hippie,1f1b}.{json,png}"

clean:
	rm -rf $(OUT) build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
