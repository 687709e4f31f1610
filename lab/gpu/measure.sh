#!/usr/bin/env bash
# Everything issue 45 asks to see on a GPU, in one device call, as JSON lines in $OUT/measure.jsonl
# (lab/gpu/README.md). Run from anywhere; it works in the repository root.
#
#   bash lab/gpu/measure.sh --wheels       # here, once, online: the packages the GPU machine lacks, into .whl/
#   bash lab/gpu/measure.sh                # there: every stage that fits MEASURE_BUDGET_S (default 530 s)
#   bash lab/gpu/measure.sh qwen3-8b test-cuda   # there: only these stages (what a first call left out)
#   bash lab/gpu/measure.sh --dry          # a CPU: the same plumbing on tiny shapes, no figures
#
# Stages, in this order unless named: qwen35-9b, validate-loops, test-cuda, qwen3-8b, qwen35-loops.
#   qwen35-9b / qwen3-8b  lab/gpu/e2e.py: a random-weight target of the recipe's shape saved to disk, then
#                   `python -m train.bench --e2e RECIPE --compile` and a 60-step `accelerate launch
#                   train/distill.py recipe=RECIPE` (default settings, data.regenerate=none, synthetic chats);
#                   the run's logged MFU against the bench's (within 5%?).
#   validate-loops  tests/test_cuda.py's validate test: inference.validate in fp32 with a trained tiny drafter,
#                   the eager, static and compiled CUDA loops against the CPU eager loop's acceptance lengths.
#   test-cuda       the rest of `pytest tests/test_cuda.py -v` (each test capped by pytest-timeout).
#   qwen35-loops    `python -m inference.bench --random-target qwen35-9b --loop static eager`: the Qwen3.5 graph
#                   loop's speed, what --loop auto waits for (inference/session.py, AUTO_LOOP_ON_CUDA).
# A stage starts only if the time it needs is left, and is stopped (its whole process group) at its cap;
# a stage left out says so in a "skipped" line. Logs: $OUT/<stage>.log (at most 8 files come back).
#
# The GPU machine has torch, transformers, accelerate, safetensors, pyarrow and pytest-timeout but not
# `datasets` (data preparation) nor flash-linear-attention (Qwen3.5's GatedDeltaNet kernels): they travel as
# wheels in .whl/ (`--wheels` fetches them; `echo /.whl/ >> .git/info/exclude` keeps them out of git) and are
# installed first, offline:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   (the same as `pip install --no-index --find-links .whl datasets flash-linear-attention ...` without touching
#   the machine's own packages), then PYTHONPATH=/tmp/site. datasets 5.2 needs pyarrow >= 24: the env line
#   says which pyarrow the machine has; `--wheels pyarrow` adds a 55 MB pyarrow wheel if it is older.
# The device tool's call:  command "bash lab/gpu/measure.sh", carry [".whl"], timeout_s 570.

set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-lab/gpu/out}
mkdir -p "$OUT"
J="$OUT/measure.jsonl"
BUDGET=${MEASURE_BUDGET_S:-530}
START=$(date +%s)
WHEELS=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 flash-linear-attention==0.6.0 fla-core==0.6.0)

if [ "${1:-}" = --wheels ]; then  # here, online (the GPU machine reaches no registry)
  extra=(); [ "${2:-}" = pyarrow ] && extra=(pyarrow==26.0.1)
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}" "${extra[@]}"
fi
DRY=0
STAGES=()
for arg in "$@"; do
  case $arg in
    --dry) DRY=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) STAGES+=("$arg") ;;
  esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=(qwen35-9b validate-loops test-cuda qwen3-8b qwen35-loops)

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
line() { echo "$1" | tee -a "$J"; }

if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  WORK=${MEASURE_WORK:-/tmp/draftsmith-measure}
else
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # /dev/shm when it holds a 9B target, its run's checkpoint and the final drafter (~35 GB): faster than the disk
  shm=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}')
  WORK=${MEASURE_WORK:-$([ "${shm:-0}" -ge 40 ] && echo /dev/shm/draftsmith-measure || echo /tmp/draftsmith-measure)}
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export DRAFTSMITH_MEASURE_JSONL="$PWD/$J"

line "$("$PY" - "$WORK" "$BUDGET" "$DRY" <<'EOF'
import importlib, json, subprocess, sys
row = {"measure": "env", "work": sys.argv[1], "budget_s": int(sys.argv[2]), "dry": sys.argv[3] == "1"}
try:
    row["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    row["commit"] = None
for name in ("torch", "transformers", "accelerate", "datasets", "fla", "pyarrow", "triton", "pytest_timeout"):
    try:
        row[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as e:
        row[name] = f"missing ({type(e).__name__}: {e})"[:120]
import torch
row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
print(json.dumps(row))
EOF
)"

CURRENT=""
trap '[ -n "$CURRENT" ] && kill -KILL -- -"$CURRENT" 2>/dev/null' EXIT INT TERM

# capped SECONDS LOG CMD...: CMD in a process group of its own, stopped whole (TERM, then KILL) at SECONDS
capped() {
  local cap=$1 log=$2; shift 2
  setsid "$@" >>"$log" 2>&1 &
  CURRENT=$!
  ( sleep "$cap"; kill -TERM -- -"$CURRENT" 2>/dev/null; sleep 15; kill -KILL -- -"$CURRENT" 2>/dev/null ) &
  local watch=$! rc
  wait "$CURRENT"; rc=$?
  kill "$watch" 2>/dev/null; wait "$watch" 2>/dev/null
  CURRENT=""
  return $rc
}

# stage NAME NEEDS_S CAP_S CMD...: run CMD if NEEDS_S seconds are left, for at most CAP_S (or what is left)
stage() {
  local name=$1 needs=$2 cap=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt "$needs" ]; then
    line "{\"measure\": \"skipped\", \"stage\": \"$name\", \"left_s\": $l, \"needs_s\": $needs}"
    return 1
  fi
  [ "$cap" -gt "$l" ] && cap=$l
  local t0 rc; t0=$(date +%s)
  capped "$cap" "$OUT/$name.log" "$@"; rc=$?
  local took=$(( $(date +%s) - t0 ))
  line "{\"measure\": \"stage\", \"stage\": \"$name\", \"rc\": $rc, \"seconds\": $took, \"cap_s\": $cap, \"stopped_at_cap\": $([ "$took" -ge "$cap" ] && echo true || echo false)}"
  # what comes back is at most 16 MiB a file: keep a log's end
  [ -f "$OUT/$name.log" ] && [ "$(stat -c %s "$OUT/$name.log")" -gt 15000000 ] \
    && tail -c 15000000 "$OUT/$name.log" > "$OUT/$name.log.tmp" && mv "$OUT/$name.log.tmp" "$OUT/$name.log"
  return 0
}

pytest_summary() {  # the pytest log's closing line as JSON
  local name=$1
  line "$("$PY" - "$OUT/$name.log" "$name" <<'EOF'
import json, re, sys
text = open(sys.argv[1], errors="replace").read() if __import__("os").path.exists(sys.argv[1]) else ""
tests = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", text, re.M)
last = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", l)]
print(json.dumps({"measure": "pytest", "stage": sys.argv[2], "summary": last[-1].strip("= ") if last else None,
                  "tests": {t: r for t, r in tests},
                  "timeouts": len(re.findall(r"Timeout \(>[\d.]+s\)", text))}))
EOF
)"
}

json_from_log() {  # a bench's JSON lines, from its stage log into measure.jsonl
  "$PY" - "$OUT/$1.log" "$1" <<'EOF' | tee -a "$J"
import json, sys
for text in open(sys.argv[1], errors="replace"):
    if text.startswith("{"):
        try:
            print(json.dumps({"measure": "inference_bench", "stage": sys.argv[2], "row": json.loads(text)}))
        except ValueError:
            pass
EOF
}

E2E=("$PY" lab/gpu/e2e.py --work "$WORK" --jsonl "$J")
[ "$DRY" = 1 ] && E2E+=(--dry)
PYTEST=("$PY" -m pytest tests/test_cuda.py -v -p no:cacheprovider -o console_output_style=classic)

for s in "${STAGES[@]}"; do
  case $s in
    qwen35-9b) stage qwen35-9b 150 300 "${E2E[@]}" qwen35-9b --log "$OUT/qwen35-9b.log" ;;
    qwen3-8b) stage qwen3-8b 150 280 "${E2E[@]}" qwen3-8b --log "$OUT/qwen3-8b.log" ;;
    validate-loops) stage validate-loops 120 240 "${PYTEST[@]}" -k validate_gives && pytest_summary validate-loops ;;
    test-cuda) stage test-cuda 90 480 "${PYTEST[@]}" -k "not validate_gives" && pytest_summary test-cuda ;;
    qwen35-loops)
      if [ "$DRY" = 1 ]; then loops=(--random-target tiny --device cpu); else loops=(--random-target qwen35-9b); fi
      stage qwen35-loops 100 200 "$PY" -m inference.bench "${loops[@]}" --loop static eager --prompts a b \
        --max-new-tokens 128 && json_from_log qwen35-loops ;;
    *) line "{\"measure\": \"unknown_stage\", \"stage\": \"$s\"}" ;;
  esac
done
rm -rf "$WORK"
line "{\"measure\": \"done\", \"seconds\": $(( $(date +%s) - START ))}"
