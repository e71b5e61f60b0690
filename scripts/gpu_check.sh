#!/usr/bin/env bash
# The one-command GPU proof (docs/gpu-check.md): scripts/gpu_check.sh [--cpu-dry-run] [OUT_DIR]
#
# On a bare GPU machine with CUDA PyTorch (run from the repository root, the wheelhouse .whl/ of
# scripts/gpu_wheels.sh beside it): installs the pinned packages from .whl/ (never torch), then runs each section
# of scripts/gpu_check.py under its own time limit, so that one failure leaves the others running, and prints the
# table of every figure last. Sized for one 9-minute run on one GPU, installs included. --cpu-dry-run: the same
# sections on CPU ranks with tiny shapes and no installs (the test suite runs it: tests/test_gpu_check.py).
#
# OUT_DIR (default gpu_check_out/ in the repository; a relative one is relative to the folder the script is run from;
# it must not exist or be empty: nothing is overwritten) receives at most 8 files:
# log.txt (everything printed), figures.jsonl (one JSON object per figure), summary.md (the table), and the
# self-test's rows: selftest.json, selftest_liger.json, selftest_hybrid.json.
# Exit status: 0 when every section ran (a missed target is a figure in the table, not a failure), 1 when a section
# failed or ran out of time (its row says which), 2 for bad arguments.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

dry=0
out=$repo/gpu_check_out
for arg in "$@"; do
  case "$arg" in
    --cpu-dry-run) dry=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option '$arg' (usage: scripts/gpu_check.sh [--cpu-dry-run] [OUT_DIR])" >&2; exit 2 ;;
    /*) out=$arg ;;
    *) out=$PWD/$arg ;;  # a relative OUT_DIR is the caller's, not the repository's
  esac
done
cd "$repo" || exit 2
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then
  echo "gpu_check.sh: OUT_DIR '$out' exists and is not empty; it is never overwritten, choose another folder" >&2
  exit 2
fi
mkdir -p "$out" || exit 2
exec > >(tee -a "$out/log.txt") 2>&1

py=${PYTHON:-python3}
flags=()
# section -> seconds: the whole run fits 9 minutes on one GPU (540 s of sections after the install; the device
# tool's limit for one command is 600 s)
limits=(selftest:75 precision:50 throughput:110 longest:150 generation:55 hybrid:100)
if [ "$dry" = 1 ]; then
  flags=(--dry-run)
  export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  limits=(selftest:240 precision:300 throughput:300 longest:300 generation:240 hybrid:240)
else
  start=$(date +%s)
  # shellcheck source=scripts/gpu_install.sh
  . scripts/gpu_install.sh .whl || { echo "gpu_check.sh: the install from .whl/ failed (scripts/gpu_wheels.sh builds it)"; exit 1; }
  echo "gpu_check.sh: installed in $(( $(date +%s) - start )) s"
  # DeepSpeed's JIT op builds parse TORCH_CUDA_ARCH_LIST as numbers: an image's "9.0a" stops every build (FusedAdam
  # too), so the card's own capability is given instead
  TORCH_CUDA_ARCH_LIST=$("$py" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null) \
    && export TORCH_CUDA_ARCH_LIST
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

status=0
for entry in "${limits[@]}"; do
  name=${entry%%:*}
  limit=${entry##*:}
  echo "=== gpu_check: $name (at most $limit s)"
  t0=$(date +%s)
  timeout -k 15 "$limit" "$py" scripts/gpu_check.py "$name" --out "$out" --budget $(( limit - 20 )) "${flags[@]}"
  rc=$?
  if [ "$rc" != 0 ]; then
    status=1
    why="exit $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="ran out of its $limit s"
    "$py" scripts/gpu_check.py failed --out "$out" --name "$name" --why "$why" "${flags[@]}"
  fi
  echo "=== gpu_check: $name: $(( $(date +%s) - t0 )) s, exit $rc"
done
"$py" scripts/gpu_check.py table --out "$out" "${flags[@]}"
exit $status
