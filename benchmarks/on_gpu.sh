#!/usr/bin/env bash
# The checks that need a GPU, in one run under 8 minutes on one GPU (issues 19, 53): the
# tests' CUDA cases, then the Trainer's throughput against DistributedDataParallel on NCCL;
# at the end ONE table to paste on the issue (tests, then a row per kvstore and job).
#
#     bash benchmarks/on_gpu.sh            # PYTHON=... to choose the interpreter
#     make gpu                             # the same, with the project's venv
#     DRY=1 bash benchmarks/on_gpu.sh      # no GPU: say the commands, print RESULTS' table
#
# DDP runs on NCCL where each worker has a GPU of its own: one worker on one GPU
# (ring, torch, dist_sync, then dist_sync whose servers only sum); with several GPUs
# also one worker per GPU. Each part has a time limit, so a hang cannot eat the rest.
# The figures go to notebooks/data/gpu_<GPU>.json (RESULTS=... to choose), one row a
# job; the scaling chapter reads the committed one (gpu_h200.json).
set -u
PYTHON=${PYTHON:-python3}
DRY=${DRY:-}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
TESTS_LOG=$(mktemp)
trap 'rm -f "$TESTS_LOG"' EXIT
if [ -n "$DRY" ]; then
    GPUS=1 RESULTS=${RESULTS:-notebooks/data/gpu_h200.json}
    part() { shift; echo "would run: $*"; }
else
    GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) ||
        { echo "on_gpu.sh: $PYTHON cannot import torch (set PYTHON, or run make gpu)" >&2; exit 1; }
    [ "$GPUS" -ge 1 ] || { echo "on_gpu.sh: no GPU here (DRY=1 for a dry run)" >&2; exit 1; }
    nvidia-smi -L 2>/dev/null
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
          "nccl", ".".join(map(str, torch.cuda.nccl.version())))'
    GPU_NAME=$("$PYTHON" -c 'import re, torch
print(re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower().replace("nvidia", "")).strip("_"))')
    RESULTS=${RESULTS:-notebooks/data/gpu_$GPU_NAME.json}
    rm -f "$RESULTS"                      # this run's figures only
    part() { echo; echo "== ${*:2}"; timeout "$@" || { echo "(failed: $?)"; status=1; }; }
fi
status=0

# the tests (4.5 minutes at most); their summary line goes to the table
part 270 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/unit/test_cuda.py \
    tests/unit/test_staging.py tests/jobs/test_cuda_jobs.py > "$TESTS_LOG" 2>&1
cat "$TESTS_LOG"
TT="$PYTHON benchmarks/train_throughput.py --device cuda --batch-size 128 --rounds 2 --steps 10"
TT="$TT --save $RESULTS"                 # each job adds its row
part 80 $TT -n 1 -s 1                    # ring, torch, dist_sync against DDP on NCCL
part 70 $TT -n 1 -s 1 --servers-sum      # the servers only sum; the GPU updates
if [ "$GPUS" -ge 2 ]; then
    part 90 $TT -n "$GPUS" -s 2          # one worker per GPU: DDP on NCCL
fi

echo; echo "== the table (paste it on the issue)"
"$PYTHON" - "$RESULTS" "$(grep -E '(passed|failed|error|skipped)' "$TESTS_LOG" | tail -1)" <<'EOF'
import json, sys
path, tests = sys.argv[1], sys.argv[2] or '(no summary: see above)'
try:
    data = json.load(open(path))
except (OSError, ValueError):
    data = {'device': '?', 'jobs': []}
print(f'| {data["device"]} | tests: {tests} |  |  |  |')
print('| job | kvstore | images/s | vs DDP | DDP on |')
print('|---|---|---:|---:|---|')
for job in data['jobs']:
    ips = job['images_per_s']
    for kind, v in ips.items():
        name = 'servers-sum' if kind == 'dist_sync' and 'servers-sum' in job['options'] else kind
        if kind != 'ddp' and not (name == kind and 'servers-sum' in job['options']):
            print(f'| {job["options"]} | {name} | {v:.1f} | {v / ips["ddp"]:.2f}x '
                  f'| {job["ddp_backend"]} |')
print('targets: ring >= 0.9x DDP on NCCL, parameter server >= 0.5x')
EOF
exit $status
