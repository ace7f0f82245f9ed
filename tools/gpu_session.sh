#!/usr/bin/env bash
# The GPU check as one command on an offline GPU machine (docs/gpu.md), inside 8 minutes:
# the wheels of tools/device_wheels.sh installed with --target (when WHEELS holds any), the
# environment, tools/gpu_check.py (budget 330 s), then `lctrain train +recipe=debug-gpu` for 30
# steps through the CLI. Every result lands in OUT as it is made.
#
#   bash tools/gpu_session.sh OUT [WHEELS]            # WHEELS: default .whl
#   bash tools/gpu_session.sh OUT WHEELS --dry-run    # CPU: the check's --dry-run, and the
#                                                     # debug-gpu recipe planned, not trained
set -uo pipefail
out=${1:?usage: tools/gpu_session.sh OUT [WHEELS] [--dry-run]}
wheels=${2:-.whl}
dry=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G "$wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/lctrain-site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/lctrain-site:$PYTHONPATH
fi
{ date -u; python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda)"; nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader; } > "$out/env.txt" 2>&1
timeout 360 python3 tools/gpu_check.py --budget 330 --out "$out/gpu_check.json" $dry \
  --run-dir "${TMPDIR:-/tmp}/lctrain-gpu-check" > "$out/gpu_check.log" 2>&1
check=$?
grep -E '^(PASS|FAIL|SKIP|summary)' "$out/gpu_check.log"
command=(train train.steps=30 eval.every=0 checkpoint.every=0)
[ -n "$dry" ] && command=(plan)
timeout 80 python3 -m lctrain.cli "${command[@]}" +recipe=debug-gpu \
  hydra.run.dir="${TMPDIR:-/tmp}/lctrain-debug-gpu" > "$out/debug_gpu.log" 2>&1
echo "debug-gpu ${command[0]}: exit $?"; tail -5 "$out/debug_gpu.log"
cp "${TMPDIR:-/tmp}/lctrain-debug-gpu/metrics.jsonl" "$out/debug_gpu_metrics.jsonl" 2>/dev/null
exit $check
