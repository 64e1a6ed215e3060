#!/usr/bin/env bash
# A/B identity of two trees: a refactor must not change behaviour.
#   scripts/ab_identity.sh <ref-before> [<ref-after>|WORKTREE] [out-dir]
# Each side is exported (git archive, or the working tree), laid out as the installed package `cope` (src/cope
# with callbacks/ and envs/ inside, as pyproject's package-dir maps them) and run from its own conf/ and train.py
# with this checkout's .venv on the tiny maze (debug=fast, 3 epochs, micro-batches, adapter export every epoch, its
# own model cache), once per run of RUNS: the default run (GRPO), algo=cope, algo=empg, data.max_lag=1 (overlapped
# rollouts), trainer=fsdp (two gloo processes) and data.share_prefix=true. Then scripts/ab_compare.py: every metrics
# row (timing columns excepted) and every exported adapter tensor must be equal.
# A side whose runs all finished (<out>/<side>/.done) is not run again: the "before" side can run ahead while the
# "after" side is still being written.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
before=$1; after=${2:-WORKTREE}; out=${3:-$(mktemp -d /tmp/ab-XXXX)}
py=$root/.venv/bin/python
# name:overrides (space-separated) of each compared run
RUNS=("default:" "cope:algo=cope" "empg:algo=empg" "lag1:data.max_lag=1" "fsdp:trainer=fsdp" "share:data.share_prefix=true")
export_side() {  # <ref> <dir>
  rm -rf "$2/tree" "$2/pkg"; mkdir -p "$2/tree" "$2/pkg"
  if [ "$1" = WORKTREE ]; then (cd "$root" && tar cf - --exclude=.venv* --exclude=outputs --exclude=.cache --exclude=.git .) | tar xf - -C "$2/tree"
  else git -C "$root" archive "$1" | tar xf - -C "$2/tree"; fi
  cp -r "$2/tree/src/cope" "$2/pkg/cope" && cp -r "$2/tree/callbacks" "$2/pkg/cope/callbacks" && cp -r "$2/tree/envs" "$2/pkg/cope/envs"
}
run_side() {  # <dir>
  for run in "${RUNS[@]}"; do
    name=${run%%:*}; overrides=${run#*:}
    # shellcheck disable=SC2086  # the overrides are separate words
    (cd "$1/tree" && OMP_NUM_THREADS=1 PYTHONHASHSEED=0 COPE_CACHE=$1/cache PYTHONPATH=$1/pkg "$py" train.py debug=fast $overrides \
      trainer.max_epochs=3 callbacks.adapter_export.every_n_epochs=1 module.max_tokens_per_microbatch=600 \
      hydra.run.dir="$1/$name" > "$1/$name.log" 2>&1) || { echo "$name failed on $1: see $1/$name.log"; exit 1; }
  done
  touch "$1/.done"
}
for side in before after; do
  ref=$before; [ $side = after ] && ref=$after
  if [ -f "$out/$side/.done" ]; then echo "$side: already run ($out/$side)"; continue; fi
  export_side "$ref" "$out/$side"; run_side "$out/$side"
done
"$py" "$root/scripts/ab_compare.py" "$out/before" "$out/after" "${RUNS[@]%%:*}"
