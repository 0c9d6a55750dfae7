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
# each stage's training time goes to OUT_DIR/<stage>_s; a stage reused from an earlier OUT_DIR (ablations of the
# later stages) takes that run's file with its model
reuse() { cp "$1/$2_s" "$out/$2_s"; }
t=$(now)
if [ -n "${VAE_FROM:-}" ]; then
    vae=$VAE_FROM/runs/vae/vae.safetensors
    reuse "$VAE_FROM" vae
else
    vae=$runs/vae/vae.safetensors
    # shellcheck disable=SC2086  # the *_FLAGS are word lists
    "$py" "$here/train_vae.py" --config "$recipe/vae.yaml" --image_folder "$data/train" "${common[@]}" ${VAE_FLAGS:-}
    took "$t" vae
fi
t=$(now)
if [ -n "${DALLE_FROM:-}" ]; then
    dalle=$DALLE_FROM/runs/dalle/dalle.safetensors
    reuse "$DALLE_FROM" dalle
else
    dalle=$runs/dalle/dalle.safetensors
    # shellcheck disable=SC2086
    "$py" "$here/train_dalle.py" --config "$recipe/dalle.yaml" --vae_path "$vae" \
        --image_text_folder "$data/train" "${common[@]}" ${DALLE_FLAGS:-}
    took "$t" dalle
fi
t=$(now)
rerank=()
echo 0 > "$out/clip_s"
if [ -n "${CLIP_FROM:-}" ]; then
    rerank=(--clip_path "$CLIP_FROM/runs/clip/clip.safetensors")
    reuse "$CLIP_FROM" clip
elif [ -f "$recipe/clip.yaml" ]; then
    # shellcheck disable=SC2086
    "$py" "$here/train_clip.py" --config "$recipe/clip.yaml" --dalle_path "$dalle" \
        --image_text_folder "$data/train" "${common[@]}" ${CLIP_FLAGS:-}
    rerank=(--clip_path "$runs/clip/clip.safetensors")
    took "$t" clip
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
