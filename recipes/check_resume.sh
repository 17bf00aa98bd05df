#!/usr/bin/env bash
# The main job killed at step 30 resumes from its own directory to the end (issue 41).
#
# Usage: bash recipes/check_resume.sh [DIR] [EXPECTED]
#   DIR: the job's directory (default: outputs/check_resume/<time>); EXPECTED: the final val_loss
#   of the uninterrupted default job (default: 1.2542, recipes/README.md#results).
#
# Runs `python recipes/train.py` (the default job, 600 steps) with checkpoint.every_n_steps=30,
# kills every process of the job with SIGKILL (a node failure, the OOM killer) once its step-30
# checkpoints/last.ckpt exists, resumes it with `hydra.run.dir=DIR ckpt_path=last`, and checks that
# the resumed run starts from step 30, ends at step 600 and prints EXPECTED as its final val_loss.
# Exit status 0 when all hold. About twice the default job's time: the first run is killed early,
# the resumed run trains the other 570 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-outputs/check_resume/$(date +%Y-%m-%d_%H-%M-%S)}
EXPECTED=${2:-1.2542}
PY=${PY:-python}
ARGS=("hydra.run.dir=$DIR" "checkpoint.every_n_steps=30" "trainer.enable_progress_bar=false")
LAST="$DIR/checkpoints/last.ckpt"
mkdir -p "$(dirname "$DIR")"
step_of() { "$PY" -c 'import sys, torch; print(torch.load(sys.argv[1], map_location="cpu", weights_only=False)["global_step"])' "$1"; }

start=$(date +%s)
echo "[check_resume] run 1: python recipes/train.py ${ARGS[*]} (killed at step 30)"
setsid "$PY" recipes/train.py "${ARGS[@]}" >"$DIR.run1.log" 2>&1 &
job=$!  # setsid runs in place here (a background job leads no group): the job's process group is $job
until [ -f "$LAST" ]; do
    if ! kill -0 "$job" 2>/dev/null; then
        echo "[check_resume] run 1 ended before writing $LAST:"; tail -30 "$DIR.run1.log"; exit 1
    fi
    sleep 0.5
done
kill -KILL -- "-$job"  # the whole job: the launching rank and the rank it started (same process group)
wait "$job" || true
killed=$(date +%s)
saved=$(step_of "$LAST")
echo "[check_resume] run 1 killed (SIGKILL) after $((killed - start)) s; checkpoints/last.ckpt at step $saved"
[ "$saved" = 30 ] || { echo "[check_resume] FAIL: last.ckpt is at step $saved, not 30"; exit 1; }

echo "[check_resume] run 2: python recipes/train.py ${ARGS[*]} ckpt_path=last"
"$PY" recipes/train.py "${ARGS[@]}" ckpt_path=last 2>&1 | tee "$DIR.run2.log" | grep '^\[train\]\|Restoring states' || true
end=$(date +%s)
final=$(step_of "$LAST")
got=$(sed -n 's/.*\[train\] val_loss \([0-9.]*\) vs\. unigram entropy.*/\1/p' "$DIR.run2.log" | tail -1)
restored=$(grep -c "Restoring states from the checkpoint path at .*last.ckpt" "$DIR.run2.log" || true)
echo "[check_resume] run 2 took $((end - killed)) s: resumed from last.ckpt ($restored), ended at step $final, val_loss $got (expected $EXPECTED)"
if [ "$restored" -ge 1 ] && [ "$final" = 600 ] && [ "$got" = "$EXPECTED" ]; then
    echo "[check_resume] OK: $DIR resumed from step 30 to step 600, val_loss $got"
else
    echo "[check_resume] FAIL: see $DIR.run2.log"; exit 1
fi
