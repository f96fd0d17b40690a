#!/usr/bin/env bash
# The checks that need a GPU, in one run (issue 19): the tests' CUDA cases, then the
# Trainer's seven steps on the GPU against DistributedDataParallel.
#
#     bash benchmarks/on_gpu.sh            # PYTHON=... to choose the interpreter
#     make gpu                             # the same, with the project's venv
#
# With one GPU the workers share it: DDP then runs on gloo (NCCL refuses two processes
# on one GPU), and a single worker shows the NCCL path. With several GPUs, one worker per
# GPU runs DDP on NCCL. Each part has a time limit, so a hang cannot eat the rest.
# The throughput figures go to notebooks/data/gpu_<GPU>.json (beside the chapters, which show it) (RESULTS=... to choose),
# one row a job; the scaling chapter reads the committed one (gpu_h200.json).
set -u
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) ||
    { echo "on_gpu.sh: $PYTHON cannot import torch (set PYTHON, or run make gpu)" >&2; exit 1; }
[ "$GPUS" -ge 1 ] || { echo "on_gpu.sh: no GPU here" >&2; exit 1; }
nvidia-smi -L 2>/dev/null
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())))'
GPU_NAME=$("$PYTHON" -c 'import re, torch
print(re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower().replace("nvidia", "")).strip("_"))')
RESULTS=${RESULTS:-notebooks/data/gpu_$GPU_NAME.json}
rm -f "$RESULTS"                          # this run's figures only
status=0
part() { echo; echo "== $*"; timeout "$@" || { echo "(failed: $?)"; status=1; }; }

part 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/unit/test_cuda.py \
    tests/unit/test_models_devices.py tests/unit/test_trainer.py tests/unit/test_staging.py \
    tests/jobs/test_cuda_jobs.py "tests/jobs/test_collectives.py::test_torch_backend_matches_gloo"
TT="$PYTHON benchmarks/train_throughput.py --device cuda --batch-size 128 --rounds 3 --steps 10"
TT="$TT --save $RESULTS"                 # each job adds its row
part 120 $TT -n 1 -s 1                   # one worker: DDP on NCCL
part 120 $TT -n 1 -s 1 --replicas 2      # two replicas of the Trainer on one GPU
if [ "$GPUS" -ge 2 ]; then
    part 150 $TT -n "$GPUS" -s 2         # one worker per GPU: DDP on NCCL
else
    part 150 $TT -n 2 -s 2               # two workers share the GPU: DDP on gloo
fi
part 150 $TT -n 2 -s 2 --servers-sum     # the servers only sum; the GPUs update
echo; echo "figures: $RESULTS"
exit $status
