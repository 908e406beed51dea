#!/usr/bin/env bash
# Execute the solutions on a GPU machine and collect what a reference run keeps:
# the executed notebooks, the recorded results, and the environment report.
#   scripts/reference_run.sh OUT_DIR [LAB ...]      (default labs: 00 01 01b)
# Works without installing the course: it runs lab_utils from this checkout (python3 -m nvlab).
set -euo pipefail
out=${1:?usage: scripts/reference_run.sh OUT_DIR [LAB ...]}
shift
labs=("${@:-00}")
[ $# -gt 0 ] || labs=(00 01 01b)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Never let NCCL or torch use NVLink multicast on shared machines; a lab only reads GPU state.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -m nvlab doctor --json > "$out/doctor.json"
python3 -m nvlab doctor | tee "$out/doctor.txt"
python3 -m nvlab run "${labs[@]}" --solutions --out "$out"
# Executed notebooks are committed: no ANSI codes, no paths of this machine (checkout, output folder, temp folders).
python3 - "$out" <<'PY'
import sys
from pathlib import Path

from nvlab.ops.notebooks import scrub

out, root = Path(sys.argv[1]).resolve(), Path.cwd().resolve()
paths = {str(out): "OUT", str(root): ".", str(Path.home()): "~"}
for nb in sorted(out.glob("*.ipynb")):
    print(nb.name, scrub(nb, paths), "outputs scrubbed")
PY
