#!/usr/bin/env bash
# The binding recipe (recipes/binding/) end to end on ../shared/bench/binding.py's coloured handwritten digits:
# train the tokenizer and DALLE at one thread, generate 4 images per prompt of the held-out and seen splits, score.
#
#   python ../shared/bench/binding.py make DATA_DIR        # once: DATA_DIR/train, 3000 images with captions
#   bench/binding.sh DATA_DIR OUT_DIR
#
# OUT_DIR/runs (the runs), OUT_DIR/images/{heldout,seen}/<prompt>/ (what is scored), OUT_DIR/score.txt, and a last
# line "binding: heldout H seen S train T s". Environment: SEED (0), PYTHON (.venv/bin/python), BINDING (the
# check's script), VAE_FROM, DALLE_FROM (tokenizer and DALLE), CLIP_FROM: an earlier OUT_DIR whose models to reuse,
# with their training times; and for ablations VAE_FLAGS, DALLE_FLAGS, CLIP_FLAGS, GENERATE_FLAGS: flags after the recipe's
# (the command line overrides a --config file). With recipes/binding/clip.yaml a CLIP trains too and reranks.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -ne 2 ]; then
    echo "usage: bench/binding.sh DATA_DIR OUT_DIR (DATA_DIR written by: python binding.py make DATA_DIR)" >&2
    exit 2
fi
data=$1 out=$2
py=${PYTHON:-$here/.venv/bin/python}
binding=${BINDING:-$here/../shared/bench/binding.py}
recipe=${RECIPE:-$here/recipes/binding}
seed=${SEED:-0}
[ -d "$data/train" ] || { echo "bench/binding.sh: no $data/train: write it with: python $binding make $data" >&2; exit 2; }
[ -f "$binding" ] || { echo "bench/binding.sh: no check script at $binding: set BINDING=path/to/binding.py" >&2; exit 2; }
mkdir -p "$out"
runs=$out/runs
common=(--output_dir "$runs" --seed "$seed" --threads 1 --num_workers 0 --quiet)
VAE_FROM=${VAE_FROM:-${DALLE_FROM:-}}
now() { date +%s.%N; }
took() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)" > "$out/$2_s"; }
# stage NAME FROM SCRIPT FLAG...: train NAME with SCRIPT and the recipe's NAME.yaml, its training time in
# OUT_DIR/NAME_s; or with FROM (an earlier OUT_DIR: ablations of the later stages) take that run's model and time.
# Prints the model's path (the script's own output goes to stderr).
stage() {
    local name=$1 from=$2 script=$3 t
    shift 3
    if [ -n "$from" ]; then
        cp "$from/${name}_s" "$out/${name}_s"
        echo "$from/runs/$name/$name.safetensors"
        return
    fi
    t=$(now)
    "$py" "$here/$script" --config "$recipe/$name.yaml" "${common[@]}" "$@" >&2
    took "$t" "$name"
    echo "$runs/$name/$name.safetensors"
}
# shellcheck disable=SC2086  # the *_FLAGS are word lists
vae=$(stage vae "${VAE_FROM:-}" train_vae.py --image_folder "$data/train" ${VAE_FLAGS:-})
# shellcheck disable=SC2086
dalle=$(stage dalle "${DALLE_FROM:-}" train_dalle.py --vae_path "$vae" --image_text_folder "$data/train" ${DALLE_FLAGS:-})
rerank=()
echo 0 > "$out/clip_s"
if [ -n "${CLIP_FROM:-}" ] || [ -f "$recipe/clip.yaml" ]; then
    # shellcheck disable=SC2086
    clip=$(stage clip "${CLIP_FROM:-}" train_clip.py --dalle_path "$dalle" --image_text_folder "$data/train" ${CLIP_FLAGS:-})
    rerank=(--clip_path "$clip")
fi
t=$(now)
for split in heldout seen; do
    # shellcheck disable=SC2086
    "$py" "$here/generate.py" --config "$recipe/generate.yaml" --dalle_path "$dalle" \
        --text "$("$py" "$binding" prompts $split)" --outputs_dir "$out/images/$split" --seed "$seed" --quiet \
        "${rerank[@]}" ${GENERATE_FLAGS:-}
done
took "$t" generate
"$py" "$binding" score "$out/images" | tee "$out/score.txt"
python3 - "$out" <<'PY'
import json, re, sys
out = sys.argv[1]
text = open(f"{out}/score.txt").read()
rate = {s: float(re.search(rf"{s}: \d+/\d+ = ([\d.]+)%", text).group(1)) for s in ("heldout", "seen")}
row = {**rate, **{f"{k}_s": float(open(f"{out}/{k}_s").read()) for k in ("vae", "dalle", "clip", "generate")}}
row["train_s"] = row["vae_s"] + row["dalle_s"] + row["clip_s"]
json.dump(row, open(f"{out}/binding.json", "w"))
print(f"binding: heldout {rate['heldout']:.1f}% seen {rate['seen']:.1f}% train {row['train_s']:.0f} s "
      f"(tokenizer {row['vae_s']:.0f}, dalle {row['dalle_s']:.0f}, clip {row['clip_s']:.0f}), generate {row['generate_s']:.0f} s")
PY
