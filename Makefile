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
# What every target that runs DeepSpeed gives it: the venv's bin first on PATH (torch's JIT build of
# DeepSpeed's CPU ops runs a bare `ninja`, the venv's when the venv is not activated) and the build
# folder inside the venv.
RUN_ENV := PATH=$(CURDIR)/$(VENV)/bin:$$PATH TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions

# What `make test` runs; e.g. `make test TESTS="tests tests/slow"` or PYTEST_FLAGS="-q -x".
TESTS ?= tests
PYTEST_FLAGS ?= -q

OUT ?= out
# The schedule demo: 4 stages, 8 micro-batches, 2 data-parallel replicas whose gradient all-reduce
# crosses a 1 Gbit/s link (125 MB/s); per stage 20 ms forward, 40 ms backward, 27.4 MB of parameters.
DEMO_SHAPE ?= --stages 4 --micro-batches 8
DEMO_COSTS ?= --forward 20ms --backward 40ms --activation-bytes 4MB --saved-bytes 30MB --param-bytes 27.4MB \
	--data-parallel 2 --allreduce-bandwidth 125MB/s

.PHONY: venv test test-unit demo schedule-demo bench bench-scaling clean distclean

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[test]'
	touch $@

# Lint first (seconds; pyproject.toml's [tool.ruff] says which rules), then the tests.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(RUN_ENV) $(PY) -m pytest $(PYTEST_FLAGS) $(TESTS)

# The fast half: single-process tests only (no `deepspeed` launcher); about a minute.
test-unit: $(STAMP)
	$(RUN_ENV) $(PY) -m pytest $(PYTEST_FLAGS) -m "not distributed" $(TESTS)

# The demo trains the GPT example with the hippie schedule on 4 local ranks (2 stages x 2
# data-parallel replicas) and draws the executed schedule to $(OUT)/demo/timeline.png.
DEMO_RANKS ?= 4
DEMO_ARGS ?= --deepspeed_config configs/hippie.json --stages 2 --steps 40
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(RUN_ENV) $(VENV)/bin/deepspeed \
		--num_gpus $(DEMO_RANKS) tools/examples/train_gpt.py $(DEMO_ARGS) --out $(OUT)/demo

schedule-demo: $(STAMP)
	mkdir -p $(OUT)
	$(HIPPIE) schedule list
	for s in 1f1b gpipe hippie hippie-1f1b; do $(HIPPIE) schedule validate $$s $(DEMO_SHAPE) || exit 1; done
	$(HIPPIE) schedule simulate 1f1b gpipe hippie hippie-1f1b $(DEMO_SHAPE) $(DEMO_COSTS)
	$(HIPPIE) schedule trace hippie $(DEMO_SHAPE) $(DEMO_COSTS) --out $(OUT)/hippie.json
	$(HIPPIE) schedule trace 1f1b $(DEMO_SHAPE) $(DEMO_COSTS) --out $(OUT)/1f1b.json
	@echo "Chrome traces (open in chrome://tracing or ui.perfetto.dev) and timelines: $(OUT)/{hippie,1f1b}.{json,png}"

# The benchmark report (needs root: network namespaces + tc): DP, GPipe+DP, stock 1F1B, hippie
# (deferred_layers 1, configs/hippie.json), hippie@auto (deferred_layers "auto", chosen from the stock
# 1F1B run's measured costs), hippie-1f1b, 2bw and pipedream on an emulated two-node cluster (1 Gbit/s
# link); the hippie family in the layout the planner chooses from a profile taken first (--auto-plan);
# one-node runs (scaling 1->2 nodes) and a one-device reference run, simulator predictions and a
# projection to 16/64/1,024 V100s. Writes $(OUT)/bench/ (results.json, report.md, *.png) and the
# committed copy in docs/bench/. Two-node and one-node runs repeat in 3 interleaved rounds (each
# round every schedule on two nodes, then on one; order rotated; ratios and scaling as median and
# min-max over rounds): about 45 minutes.
# e.g. `sudo make bench BENCH_ARGS="--schedules 1f1b,hippie --steps 4"`.
BENCH_SCHEDULES ?= dp,gpipe,1f1b,hippie,hippie@auto,hippie@all,hippie-1f1b,2bw,pipedream
BENCH_ARGS ?=
bench: $(STAMP)
	$(RUN_ENV) $(PY) -m tools.bench --out $(OUT)/bench \
		--publish docs/bench --auto-plan --schedules $(BENCH_SCHEDULES) $(BENCH_ARGS)

# The paper's scaling table on an emulated accelerator (needs root): VGG-16 at 10 Gbit/s and GNMT-16
# at 100 Gbit/s (PipeDream's V100 profiles, compute a CPU-free wait, model and link scaled by 1e-3)
# on 1, 2 and 4 emulated nodes of 4 ranks, DP / stock 1F1B / GPipe+DP / hippie / hippie-1f1b in 3
# interleaved rounds, beside the paper's figures; docs/bench/scaling/{vgg16,gnmt16}/. About 20 minutes.
bench-scaling: $(STAMP)
	$(RUN_ENV) $(PY) -m tools.bench scaling --model emulated:vgg16 \
		--rate 10mbit --out $(OUT)/bench/scaling-vgg16 --publish docs/bench/scaling/vgg16
	$(RUN_ENV) $(PY) -m tools.bench scaling --model emulated:gnmt16 \
		--rate 100mbit --out $(OUT)/bench/scaling-gnmt16 --publish docs/bench/scaling/gnmt16

# Multi-node with DeepSpeed's own launcher (needs root): two emulated nodes (network namespaces joined
# by a veth pair shaped to 1 Gbit/s), a hostfile, and `deepspeed --hostfile H --no_ssh --node_rank N`
# once per node; a tiny PipelineModule trained with hippie_ds.initialize on 2 nodes x 2 ranks. Checks
# that both nodes finish and all ranks agree on the loss; writes $(OUT)/multinode/. About 20 s.
# e.g. `sudo make multinode MULTINODE_ARGS="--schedule gpipe --steps 5"`.
MULTINODE_ARGS ?=
.PHONY: multinode
multinode: $(STAMP)
	$(RUN_ENV) $(PY) -m tools.bench multinode --out $(OUT)/multinode \
		$(MULTINODE_ARGS)

# Soak: 1,000 steps of hippie on 4 local ranks with timelines on; resident memory must grow less
# than 1% after the warm-up, file descriptors, threads and /dev/shm entries not at all, and the
# timeline keeps only its window (hippie.timeline_steps). Writes $(OUT)/soak/report.json. About 3 min.
SOAK_ARGS ?=
.PHONY: soak
soak: $(STAMP)
	$(RUN_ENV) $(PY) -m tools.bench soak --out $(OUT)/soak $(SOAK_ARGS)

# Convergence and time to accuracy: both examples (GPT on Python's docs, VGG on scikit-learn's
# digits) trained to a fixed budget with data parallelism (4 replicas) and with 1f1b (synchronous,
# stock DeepSpeed's update: the time-to-target reference), hippie (configs/hippie.json: partial
# deferral of stage 0's first layer, default staleness correction), hippie@auto (the layers chosen
# from the example's costs at 1 Gbit/s: GPT's measured by `make bench-gpt`, VGG's from a profile,
# python -m tools.bench example-costs), hippie@all (all of stage 0 delayed: the paper's rule), hippie@all:none
# (no correction), 2bw, 2bw:adam (Adam's predicted update, hippie.staleness.method "adam") and 2bw:none
# (2 stages x 2 replicas), seeds 0,1,2, one 4-rank job after another; same global batch, weights and
# data order.
# Time to accuracy uses each example's step times at 1 Gbit/s and 250 Mbit/s in
# docs/convergence/bench_{gpt,vgg}/ (re-measure: `sudo make bench-gpt bench-vgg`). Writes
# $(OUT)/convergence/ and copies the pictures and results to docs/convergence/. About 120 minutes on 2 cores; e.g. `make
# convergence CONVERGENCE_ARGS="--examples vgg --seeds 0"`.
CONVERGENCE_SCHEDULES ?= dp,1f1b,hippie,hippie@auto,hippie@all,hippie@all:none,2bw,2bw:adam,2bw:none
STEP_TIMES_OF = $(1)=docs/convergence/bench_$(1)/1gbit.json+docs/convergence/bench_$(1)/250mbit.json
CONVERGENCE_STEP_TIMES ?= $(call STEP_TIMES_OF,gpt),$(call STEP_TIMES_OF,vgg)
CONVERGENCE_COSTS ?= gpt=docs/convergence/bench_gpt/1gbit.costs.json,vgg=docs/convergence/costs/vgg-1gbit.json
CONVERGENCE_ARGS ?=
.PHONY: convergence bench-gpt
convergence: $(STAMP)
	$(RUN_ENV) $(PY) -m tools.bench convergence --out $(OUT)/convergence \
		--schedules $(CONVERGENCE_SCHEDULES) --seeds 0,1,2 --step-times $(CONVERGENCE_STEP_TIMES) \
		--costs $(CONVERGENCE_COSTS) --publish docs/convergence $(CONVERGENCE_ARGS)

# Step times at a convergence example's shape on the emulated two-node cluster (needs root), at
# 1 Gbit/s and 250 Mbit/s: 7 interleaved rounds each (schedule order rotated per round), into
# docs/convergence/bench_EXAMPLE/LINK.json, and the stock 1F1B run's measured costs into
# docs/convergence/bench_EXAMPLE/LINK.costs.json. $(call bench_example,EXAMPLE,SHAPE,RATES).
define bench_example
	mkdir -p docs/convergence/bench_$(1)
	for rate in $(3); do \
		$(RUN_ENV) $(PY) -m tools.bench --out $(OUT)/bench-$(1)/$$rate \
			--rate $$rate $(2) && cp $(OUT)/bench-$(1)/$$rate/results.json \
			docs/convergence/bench_$(1)/$$rate.json && cp $(OUT)/bench-$(1)/$$rate/runs/two_nodes/costs.json \
			docs/convergence/bench_$(1)/$$rate.costs.json || exit 1; \
	done
endef
BENCH_EXAMPLE_RUNS := --no-scaling --no-single --no-projection --rounds 7
# The GPT example (the 1 Gbit/s costs are what `make convergence` gives its GPT hippie@auto runs).
# About 20 minutes.
BENCH_GPT_SHAPE := --d-model 128 --layers 4 --heads 4 --vocab 103 --seq 64 --micro-batch-size 4 \
	--micro-batches 4 --steps 12 --warmup 2 $(BENCH_EXAMPLE_RUNS) --schedules dp,1f1b,hippie,hippie@all,2bw
BENCH_GPT_RATES ?= 1gbit 250mbit
# The VGG example (--model vgg-example: tools/examples/vgg.py's network, loss and digits), its
# convergence runs' batch: micro-batches of 4, 4 per replica, 2 stages x 2 replicas (global batch 32;
# dp: 4 replicas x 2). Schedules: 2bw as its default (extrapolate-made) and with error feedback 0.5.
BENCH_VGG_SHAPE := --model vgg-example --micro-batch-size 4 --micro-batches 4 --steps 12 --warmup 2 \
	$(BENCH_EXAMPLE_RUNS) --schedules dp,1f1b,hippie,2bw,2bw:extrapolate-made+ef=0.5
BENCH_VGG_RATES ?= 1gbit 250mbit
.PHONY: bench-vgg
bench-gpt: $(STAMP)
	$(call bench_example,gpt,$(BENCH_GPT_SHAPE),$(BENCH_GPT_RATES))
bench-vgg: $(STAMP)
	$(call bench_example,vgg,$(BENCH_VGG_SHAPE),$(BENCH_VGG_RATES))

clean:
	rm -rf $(OUT) build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
