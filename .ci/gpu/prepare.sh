#!/bin/bash
# Here, before a GPU call without the default model there (its GGUF, 98 MB, is over the 64 MiB a call carries):
# the default model's config and tokenizer go to .gpu/cache (git-ignored; carry ".gpu"), and run.sh's setup
# stage fills in random weights of the same shape there (.ci/gpu/default_model.py).
set -e
cd "$(dirname "$0")/../.."
src=$(python -c "from minivllm.model.default_model import default_model_dir; print(default_model_dir())")
dst=.gpu/cache/$(basename "$src")
mkdir -p "$dst"
for f in DONE config.json generation_config.json chat_template.jinja tokenizer.json tokenizer_config.json; do
  [[ -f $src/$f ]] && cp "$src/$f" "$dst/"
done
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
du -sh .gpu
