#!/usr/bin/env bash
# The prepared GPU check: one script, one GPU, under 8 minutes.
#
#   bash benchmarks/gpu_check.sh            # on a machine with one CUDA GPU
#   bash benchmarks/gpu_check.sh --dry-run  # the same steps at tiny sizes on the CPU (what the tests run)
#
# 1. The speed benchmark at 196 tokens (224 px, patch 16, deit_tiny_patch16_224 with random weights):
#    sparse vs dense synthesis, and the ensemble batched (vmap) vs looped at K = 10 and 50
#    -> $OUT/gpu_check_speed.json (benchmarks/bench_speed.py).
# 2. One small full-CIFAR-10 FedMITR cell (10 clients, Dirichlet 0.1, 32 px, bf16 autocast on the GPU)
#    through the CLI -> $OUT/gpu_check_cell.json (its summary.json). CIFAR-10 comes from $CIFAR10_NPZ,
#    or is built from ../shared/data/cifar10_jpeg.npz (or shared/data/...) with build_cifar10.py; with
#    neither, the cell is skipped and says so. --dry-run runs the cell on digits instead.
#
# OUT: $GPU_CHECK_OUT, default benchmarks/results; --dry-run names its files gpu_check_dryrun_*.json.
# PYTHON: the interpreter (default python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${GPU_CHECK_OUT:-benchmarks/results}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if [ "${1:-}" = "--dry-run" ]; then
  MODE=dry-run; DEVICE=cpu; MODEL=fedmitr_vit_micro; IMG=16; PATCH=4; ITERS=6; BATCH=8; KS="2 3"; REPEATS=1
  NAME=gpu_check_dryrun
  export FEDMITR_TORCH_THREADS="${FEDMITR_TORCH_THREADS:-1}"
elif [ -n "${1:-}" ]; then
  echo "gpu_check: unknown option ${1} (expected --dry-run or nothing)" >&2; exit 2
else
  MODE=gpu; DEVICE=cuda; MODEL=deit_tiny_patch16_224; IMG=224; PATCH=16; ITERS=200; BATCH=64; KS="10 50"; REPEATS=2
  NAME=gpu_check
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device here; run with --dry-run on a CPU" >&2; exit 2
  fi
fi
echo "gpu_check ($MODE): speed benchmark"
# shellcheck disable=SC2086
"$PY" benchmarks/bench_speed.py --device "$DEVICE" --model "$MODEL" --img "$IMG" --patch "$PATCH" \
  --iters "$ITERS" --batch "$BATCH" --ensemble-k $KS --ensemble-batch "$BATCH" --repeats "$REPEATS" \
  --out "$OUT/${NAME}_speed.json"

DATA=""
if [ "$MODE" = gpu ]; then
  if [ -n "${CIFAR10_NPZ:-}" ] && [ -f "$CIFAR10_NPZ" ]; then
    DATA="$CIFAR10_NPZ"
  else
    for src in ../shared/data shared/data; do
      if [ -f "$src/cifar10_jpeg.npz" ] && [ -f "$src/build_cifar10.py" ]; then
        "$PY" "$src/build_cifar10.py" "$WORK/cifar10.npz" && DATA="$WORK/cifar10.npz" && break
      fi
    done
  fi
  if [ -z "$DATA" ]; then
    echo "gpu_check: no CIFAR-10 (set CIFAR10_NPZ, or put ../shared/data/cifar10_jpeg.npz here): cell skipped"
    exit 0
  fi
fi
echo "gpu_check ($MODE): FedMITR cell"
"$PY" - "$MODE" "$DATA" "$WORK" <<'PYEOF'
import sys

import yaml

mode, data, work = sys.argv[1:4]
gpu = mode == "gpu"
cfg = {
    "common_args": {"training_type": "simulation", "random_seed": 0, "using_mlops": False},
    "data_args": ({"dataset": "npz", "npz_path": data, "partition_method": "hetero", "partition_alpha": 0.1}
                  if gpu else {"dataset": "digits", "partition_method": "homo"}),
    "model_args": {"model": "fedmitr_vit_tiny" if gpu else "fedmitr_vit_micro", "img_size": 32 if gpu else 16,
                   "patch_size": 4},
    "train_args": {"federated_optimizer": "FedMITR", "client_num_in_total": 10 if gpu else 2,
                   "client_num_per_round": 10 if gpu else 2, "comm_round": 1, "epochs": 10 if gpu else 1,
                   "batch_size": 128 if gpu else 32, "client_optimizer": "adamw", "learning_rate": 0.001,
                   "weight_decay": 0.05},
    "validation_args": {"frequency_of_the_test": 1},
    "device_args": {"using_gpu": gpu, "gpu_id": 0},
    "comm_args": {"backend": "sp"},
    "tracking_args": {"enable_wandb": False},
    "fedmitr_args": {"output_dir": f"{work}/cell", "num_synthetic": 2560 if gpu else 16,
                     "synthesis_batch_size": 256 if gpu else 8, "inversion_iters": 200 if gpu else 6,
                     "distill_epochs": 30 if gpu else 1, "distill_batch_size": 256 if gpu else 8,
                     "progress": False, "save_images": False},
}
with open(f"{work}/cell.yaml", "w") as fh:
    yaml.safe_dump(cfg, fh, sort_keys=False)
PYEOF
"$PY" -m fedml_fedmitr --cf "$WORK/cell.yaml"
cp "$WORK/cell/summary.json" "$OUT/${NAME}_cell.json"
echo "gpu_check ($MODE): wrote $OUT/${NAME}_speed.json and $OUT/${NAME}_cell.json"
