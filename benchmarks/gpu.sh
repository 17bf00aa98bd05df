#!/usr/bin/env bash
# One prepared GPU run (one CUDA device, under 9 minutes), four measurements:
#   1. capacity at K = 1, GPipe Table 1 style: the largest Transformer (d_model 2048, d_ff 8192,
#      16 heads, vocab 32000, 8 x 512 tokens, fp32, Adam) whose training fits 8 GiB of
#      torch.cuda.max_memory_allocated, Naive-1 (plain Lightning Trainer) vs Pipeline-1
#      (gpipe, one stage, M = 8 micro-batches, recompute);
#   2. recompute's time overhead: one stage, M = 8, 8 blocks, checkpoint never vs always;
#   3. one bf16-mixed training run of the main job's model (recipes/train.py trainer=gpu, one stage);
#   4. the mesh rows of benchmarks/mesh.py (a Llama-style model, 542 M parameters, 16 x 512 tokens,
#      fp32, Adam): ours PP2 x DP2, PP2 x FSDP2, PP2 x TP2 against ModelParallelStrategy FSDP2 x 4 and
#      TP x 4, samples/s and max_memory_allocated per rank. Those are 4 ranks each, and NCCL needs one
#      GPU per rank: with 4 or more GPUs visible every row runs (adding up to 8 minutes); with fewer,
#      only the one-process reference row (`single`) runs here, and the 4-rank rows are skipped with
#      a message (their CPU figures: python -m benchmarks.mesh --device cpu).
# Results (CSV and markdown; the training run's metrics.csv and log) go under $OUT when it is set,
# else benchmarks/results/gpu (not versioned); a summary is printed at the end (summary.md), which
# is what the GPU section of docs/benchmarks.md takes.
#
#   bash benchmarks/gpu.sh                  # on a machine with one CUDA device
#   bash benchmarks/gpu.sh --small --cpu    # tiny sizes on the CPU: checks the code paths only
#
# Several stages on CUDA need one GPU per rank (NCCL refuses two ranks on one device), so on one GPU
# this script measures K = 1 only; K = 2 runs on CPU (python -m benchmarks.capacity table --device cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

SMALL=""
DEVICE=cuda
for arg in "$@"; do
  case "$arg" in
    --small) SMALL="--small" ;;
    --cpu) DEVICE=cpu ;;
    *) echo "gpu.sh: unknown argument '$arg' (use --small and/or --cpu)" >&2; exit 2 ;;
  esac
done
if [[ "$DEVICE" == cpu && -z "$SMALL" ]]; then
  echo "gpu.sh: --cpu only with --small (a check of the code paths; the figures need a GPU)" >&2
  exit 2
fi
if [[ "$DEVICE" == cuda ]] && ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu.sh: no CUDA device is visible (torch.cuda.is_available() is False); this script measures on one GPU." >&2
  echo "        On CPU: bash benchmarks/gpu.sh --small --cpu (code paths only), or" >&2
  echo "        python -m benchmarks.capacity table --device cpu (the CPU capacity table)." >&2
  exit 2
fi

RESULTS="${OUT:-benchmarks/results/gpu}"
mkdir -p "$RESULTS"
START=$(date +%s)
if [[ -n "$SMALL" ]]; then  # a loaded CPU starts a process in tens of seconds
  BUDGET=200; LAYERS=4; STEPS=4; VAL=2; CAP_T=1200; CAP_TRIAL=150; OVH_T=400; OVH_TRIAL=150; TRAIN_T=600
  MESH_T=1200; MESH_ROW=240
  TRAIN_EXTRA="trainer.limit_val_batches=2 data.max_bytes=100000"
else  # 545 s at most on one GPU
  BUDGET=8192; LAYERS=8; STEPS=600; VAL=100; CAP_T=240; CAP_TRIAL=100; OVH_T=95; OVH_TRIAL=45; TRAIN_T=120
  MESH_T=90; MESH_ROW=80  # one GPU: the one-process row; raised below when 4 GPUs run every row
  TRAIN_EXTRA=""
fi
if [[ "$DEVICE" == cuda ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RESULTS/device.csv" 2>/dev/null || true
fi
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" > "$RESULTS/versions.txt"

echo "== 1/4 capacity, K = 1: Naive-1 vs Pipeline-1 (recompute), budget $BUDGET MiB"
timeout "$CAP_T" python -m benchmarks.capacity table --device "$DEVICE" $SMALL --rows naive 1:always \
  --budget-mib "$BUDGET" --chunks 8 --max-layers 64 --timeout "$CAP_TRIAL" --out "$RESULTS" \
  || echo "capacity: did not finish within $CAP_T s (partial output above)"

echo "== 2/4 recompute time overhead: one stage, M = 8, $LAYERS blocks"
timeout "$OVH_T" python -m benchmarks.capacity overhead --device "$DEVICE" $SMALL --chunks 8 --layers "$LAYERS" \
  --warmup 3 --timed 10 --timeout "$OVH_TRIAL" --out "$RESULTS" \
  || echo "overhead: did not finish within $OVH_T s"

echo "== 3/4 bf16-mixed training of the main job's model, one stage"
TRAINER=gpu
[[ "$DEVICE" == cpu ]] && TRAINER="cpu trainer.precision=bf16-mixed"
# shellcheck disable=SC2086
if timeout "$TRAIN_T" python recipes/train.py trainer=$TRAINER pipeline.pipeline_parallel_size=1 trainer.max_steps="$STEPS" \
  trainer.val_check_interval="$VAL" trainer.enable_progress_bar=false hydra.run.dir="$RESULTS/train" $TRAIN_EXTRA \
  > "$RESULTS/train.log" 2>&1; then
  grep -E "^\[train\]" "$RESULTS/train.log"
else
  echo "train: failed or did not finish within $TRAIN_T s; the end of train.log:"
  tail -20 "$RESULTS/train.log"
fi

MESH_ROWS="single"
if [[ "$DEVICE" == cpu ]]; then
  MESH_ROWS="single pp2_dp2 pp2_fsdp2 pp2_tp2 mps_fsdp4 mps_tp4"  # Gloo: 4 ranks share the CPU
elif [[ $(python -c "import torch; print(torch.cuda.device_count())") -ge 4 ]]; then
  MESH_ROWS="single pp2_dp2 pp2_fsdp2 pp2_tp2 mps_fsdp4 mps_tp4"; MESH_T=480; MESH_ROW=75
else
  echo "mesh: fewer than 4 GPUs visible; the 4-rank rows (NCCL, one GPU per rank) are skipped, the one-process row runs"
fi
echo "== 4/4 mesh rows: $MESH_ROWS"
# shellcheck disable=SC2086
timeout "$MESH_T" python -m benchmarks.mesh --device "$DEVICE" $SMALL --rows $MESH_ROWS --timeout "$MESH_ROW" \
  --out "$RESULTS/mesh" || echo "mesh: failed or did not finish within $MESH_T s (rows done: $RESULTS/mesh/mesh.md)"

{
  echo "# gpu.sh results ($DEVICE${SMALL:+, small sizes}), $(($(date +%s) - START)) s"
  echo
  cat "$RESULTS/versions.txt"
  [[ -f "$RESULTS/device.csv" ]] && cat "$RESULTS/device.csv"
  for f in table overhead mesh/mesh; do [[ -f "$RESULTS/$f.md" ]] && { echo; cat "$RESULTS/$f.md"; }; done
  echo
  grep -E "^\[train\]" "$RESULTS/train.log" || echo "train: no summary line (see train.log)"
} > "$RESULTS/summary.md"
cat "$RESULTS/summary.md"
