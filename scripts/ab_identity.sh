#!/usr/bin/env bash
# A/B identity of two trees: a refactor must not change behaviour.
#   scripts/ab_identity.sh <ref-before> [<ref-after>|WORKTREE] [out-dir]
# Each side is exported (git archive, or the working tree), laid out as the installed package `cope` (src/cope
# with callbacks/ and envs/ inside, as pyproject's package-dir maps them) and run from its own conf/ and train.py
# with this checkout's .venv: grpo, cope and empg on the tiny maze (debug=fast, 3 epochs, micro-batches, adapter
# export every epoch, its own model cache). Then scripts/ab_compare.py: every metrics row (timing columns
# excepted) and every exported adapter tensor must be equal.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
before=$1; after=${2:-WORKTREE}; out=${3:-$(mktemp -d /tmp/ab-XXXX)}
py=$root/.venv/bin/python
export_side() {  # <ref> <dir>
  mkdir -p "$2/tree" "$2/pkg"
  if [ "$1" = WORKTREE ]; then (cd "$root" && tar cf - --exclude=.venv* --exclude=outputs --exclude=.cache .) | tar xf - -C "$2/tree"
  else git -C "$root" archive "$1" | tar xf - -C "$2/tree"; fi
  cp -r "$2/tree/src/cope" "$2/pkg/cope" && cp -r "$2/tree/callbacks" "$2/pkg/cope/callbacks" && cp -r "$2/tree/envs" "$2/pkg/cope/envs"
}
run_side() {  # <dir>
  for algo in grpo cope empg; do
    (cd "$1/tree" && OMP_NUM_THREADS=1 PYTHONHASHSEED=0 COPE_CACHE=$1/cache PYTHONPATH=$1/pkg "$py" train.py algo=$algo debug=fast \
      trainer.max_epochs=3 callbacks.adapter_export.every_n_epochs=1 module.max_tokens_per_microbatch=600 \
      hydra.run.dir="$1/$algo" > "$1/$algo.log" 2>&1) || { echo "$algo failed on $1: see $1/$algo.log"; exit 1; }
  done
}
for side in before after; do
  ref=$before; [ $side = after ] && ref=$after
  export_side "$ref" "$out/$side"; run_side "$out/$side"
done
"$py" "$root/scripts/ab_compare.py" "$out/before" "$out/after"
