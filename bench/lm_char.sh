#!/usr/bin/env bash
# The character-level GPT of configs/austen_char_gpt.toml (nanoGPT's shakespeare_char CPU recipe on
# Jane Austen's novels: 4 layers x 4 heads x 128 wide, context 64, batch 12, 2,000 steps), trained
# side by side in one run by
#   - Ember: `engine configs/austen_char_gpt.toml` (gpt + text_lm, its default csv logger and
#     checkpoints),
#   - the same model and loop in plain PyTorch (bench/lm_char.py, written for this bench after
#     nanoGPT's recipe), and in PyTorch Lightning 2.6 (the same module in a Trainer),
# on the same LibTorch wheel and the same number of threads, each with `seeds` seeds (0, 1, ...; the
# variants take turns, seed by seed, so that a slow spell of the machine hits all three). Reported,
# averaged over the seeds: wall time (evaluations included), training tokens per second, the final
# validation loss (and its range over the seeds: one seed's final loss moves by ~0.01, more than the
# variants differ), the validation loss curve, and the ratios to plain PyTorch; "to PyTorch's final
# loss" is the time each variant's seed-averaged curve takes to first reach the seed-averaged loss
# plain PyTorch ends with (at the evaluation points, every 250 steps).
#   bash bench/lm_char.sh [steps=2000] [threads=2] [seeds=3]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
steps=${1:-2000}; threads=${2:-2}; seeds=${3:-3}
build=${EMBER_BUILD_DIR:-build}
torch_prefix=${EMBER_TORCH_PREFIX:-$(bash scripts/setup.sh | tail -n 1)}
cmake --build "$build" --target engine ember_plugin_gpt ember_plugin_text_lm ember_plugin_cosine ember_plugin_single_device \
  ember_plugin_fp32 ember_plugin_csv ember_plugin_checkpoint >/dev/null
python=$(cd "$torch_prefix/../../../../../.." && pwd)/bin/python
[ -x "$python" ] || python=python3
"$python" -c "import lightning" 2>/dev/null || "$python" -m pip install -q "lightning==2.6.*" >/dev/null
corpus=${EMBER_CACHE:-$HOME/.cache/ember}/austen
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=$threads

for seed in $(seq 0 $((seeds - 1))); do
  start=$(date +%s.%N)
  (cd "$work" && "$root/$build/engine/engine" "$root/configs/austen_char_gpt.toml" --set trainer.max_steps="$steps" \
    --set trainer.seed="$seed" --set trainer.num_threads="$threads" --set trainer.enable_progress_bar=false \
    --set trainer.enable_model_summary=false --set trainer.default_root_dir=\""$work/runs-$seed"\" 2>"$work/ember.log") ||
    { cat "$work/ember.log"; exit 1; }
  end=$(date +%s.%N)
  "$python" - "$work" "$start" "$end" "$steps" "$seed" <<'PY'
import csv, glob, json, sys
work, start, end, steps, seed = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
(metrics,) = glob.glob(f"{work}/runs-{seed}/austen_char_gpt/version_0/metrics.csv")
wall = end - start
evals = [[int(r["step"]), float(r["val_loss"]), wall * (int(r["step"]) + 1) / steps] for r in csv.DictReader(open(metrics)) if r.get("val_loss")]
json.dump({"variant": "ember", "seed": seed, "wall_s": wall, "train_tokens": steps * 12 * 64, "evals": evals}, open(f"{work}/ember-{seed}.json", "w"))
PY
  for variant in pytorch lightning; do
    "$python" -W ignore bench/lm_char.py "$variant" "$corpus" "$steps" "$threads" "$work/$variant-$seed.json" "$seed" >"$work/$variant.log" 2>&1 ||
      { cat "$work/$variant.log"; exit 1; }
  done
done
"$python" - "$work" "$seeds" <<'PY'
import glob, json, statistics, sys
work, seeds = sys.argv[1], int(sys.argv[2])
def mean_run(variant):
    rs = [json.load(open(f"{work}/{variant}-{s}.json")) for s in range(seeds)]
    curves = [r["evals"] for r in rs]
    n = min(len(c) for c in curves)
    evals = [[curves[0][i][0], statistics.mean(c[i][1] for c in curves), statistics.mean(c[i][2] for c in curves)] for i in range(n)]
    finals = [c[-1][1] for c in curves]
    return {"wall_s": statistics.mean(r["wall_s"] for r in rs), "train_tokens": rs[0]["train_tokens"], "evals": evals,
            "final_min": min(finals), "final_max": max(finals), "seed_curves": curves}
runs = {v: mean_run(v) for v in ("ember", "pytorch", "lightning")}
target = runs["pytorch"]["evals"][-1][1]
def to_target(r):
    hit = [e for e in r["evals"] if e[1] <= target]
    return hit[0][2] if hit else float("nan")
base = runs["pytorch"]
names = {"ember": "Ember (engine, gpt + text_lm)", "pytorch": "plain PyTorch loop", "lightning": "PyTorch Lightning 2.6"}
print(f"{seeds} seed(s), means over them")
print()
print(f"| variant | wall s | tokens/s | vs PyTorch (tokens/s) | final val loss (range over seeds) | s to PyTorch's final loss ({target:.4f}) | vs PyTorch |")
print("|---|---|---|---|---|---|---|")
for v, r in runs.items():
    tps = r["train_tokens"] / r["wall_s"]
    t = to_target(r)
    print(f"| {names[v]} | {r['wall_s']:.1f} | {tps:,.0f} | {tps / (base['train_tokens'] / base['wall_s']):.2f}x | "
          f"{r['evals'][-1][1]:.4f} ({r['final_min']:.4f}-{r['final_max']:.4f}) | {t:.1f} | {to_target(base) / t:.2f}x |")
print()
print("validation loss at steps " + ", ".join(str(e[0] + 1) for e in base["evals"]) + " (seed means, then each seed)")
for v, r in runs.items():
    print(f"  {v:10s} " + " ".join(f"{e[1]:.4f}" for e in r["evals"]))
for v, r in runs.items():
    for s, c in enumerate(r["seed_curves"]):
        print(f"  {v + ' ' + str(s):12s} " + " ".join(f"{e[1]:.4f}" for e in c))
PY
