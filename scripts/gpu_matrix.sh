#!/usr/bin/env bash
# Execute generated labs (blank answers) and solutions on this machine, one notebook at a time, within a time
# budget, and keep what a run keeps: executed notebooks, recorded results, the environment report, a table of
# wall times. The classroom check of a one-GPU machine, and how the course's one-GPU runs are made.
#   scripts/gpu_matrix.sh OUT_DIR BUDGET_S ENTRY ...
#   ENTRY: labs/NN:quick | labs/NN:full | solutions/NN:quick | solutions/NN:full  (NN: 00, 01, 01b, 02, ..., 09)
# An entry that would start after BUDGET_S seconds is listed as not run; each notebook gets what is left.
# Works without installing the course (python3 -m nvlab from this checkout).
set -uo pipefail
out=${1:?usage: scripts/gpu_matrix.sh OUT_DIR BUDGET_S ENTRY ...}
budget=${2:?usage: scripts/gpu_matrix.sh OUT_DIR BUDGET_S ENTRY ...}
shift 2
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A lab only reads GPU state: never let NCCL or torch use NVLink multicast on shared machines.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
mkdir -p "$out"
python3 -m nvlab doctor --json > "$out/doctor.json" 2>/dev/null
python3 -m nvlab doctor > "$out/doctor.txt" 2>&1
start=$SECONDS
printf 'notebook\tmode\tseconds\tresult\n' > "$out/matrix.tsv"
for entry in "$@"; do
  kind=${entry%%/*} rest=${entry#*/}
  lab=${rest%%:*} mode=${rest#*:}
  left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then
    printf '%s/%s\t%s\t-\tnot run (budget spent)\n' "$kind" "$lab" "$mode" >> "$out/matrix.tsv"
    continue
  fi
  dir="$out/$kind-$lab-$mode"
  args=("$lab" --out "$dir")
  [ "$kind" = solutions ] && args+=(--solutions)
  [ "$mode" = quick ] && args+=(-p quick True)
  t0=$SECONDS
  timeout --kill-after=10 "$left" python3 -m nvlab run "${args[@]}" > "$dir.log" 2>&1
  rc=$?
  case $rc in
    0) result=ok ;;
    # a stopped run's kernel dies with it: what it left (a python-backend stub holding GPU memory) goes before the next
    124|137) result="stopped at the budget ($left s)"; python3 -m nvlab doctor > /dev/null 2>&1 ;;
    *) result="failed: $(grep -m1 -o 'failed in cell.*' "$dir.log" | cut -c1-160)" ;;
  esac
  printf '%s/%s\t%s\t%s\t%s\n' "$kind" "$lab" "$mode" "$((SECONDS - t0))" "$result" >> "$out/matrix.tsv"
done
cat "$out/matrix.tsv"
# Executed notebooks are committed: no ANSI codes, no paths of this machine.
python3 - "$out" <<'PY'
import sys
from pathlib import Path

from nvlab.ops.notebooks import scrub

out, root = Path(sys.argv[1]).resolve(), Path.cwd().resolve()
paths = {str(out): "OUT", str(root): ".", str(Path.home()): "~"}
for nb in sorted(out.glob("*/*.ipynb")):
    scrub(nb, paths)
PY
