#!/usr/bin/env bash
# What only a GPU machine can show, in one run (a few minutes): the CUDA path's tests, the real backend's
# tests on the machine's own torch, an NCCL launch beside the virtual ranks, and the virtual cluster's step
# time on the machine's cores (bench_step, with `compare` at N = 256), what bounds it there (bench_bound),
# how many rank threads should run at once on them (bench_slots), and the same N = 32 as processes (gloo), one
# interpreter lock each: what bench_bound's part 5 says rank threads cannot reach on many cores.
# Run from the repository root with the machine's Python:
#     bash benchmarks/gpu_check.sh [python]
# The course's code runs from the checkout (PYTHONPATH=.); nothing is installed.
set -uo pipefail
PY=${1:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
section() { printf '\n===== %s\n' "$*"; }

section "machine"
nproc
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.cuda.is_available())'
# What the tests and benches import besides torch: a machine with no network needs them brought along.
"$PY" -c '
import importlib.util
missing = [m for m in ("numpy", "tqdm", "psutil", "pytest", "pytest_timeout") if importlib.util.find_spec(m) is None]
import shutil, sys
from pathlib import Path
if not Path(sys.executable).with_name("py-spy").exists() and shutil.which("py-spy") is None:
    missing.append("py-spy (bench_bound part 5 only)")
print("missing, install before running this:", " ".join(missing) if missing else "nothing")'

section "the CUDA path (tests/test_cuda_path.py)"
"$PY" -m pytest -q -p no:cacheprovider -s tests/test_cuda_path.py

section "the real backend on this torch (backend, launch and dist tests)"
"$PY" -m pytest -q -p no:cacheprovider tests/test_torch_backend.py tests/test_launch.py tests/test_dist.py

section "NCCL launch, tiny preset, one GPU"
"$PY" -m torch.distributed.run --standalone --nproc-per-node=1 -m zero_core.launch --backend nccl \
    --preset tiny --stages 0,1,2,3 --steps 3 --no-progress --check-virtual

section "step time of the virtual cluster on $(nproc) cores (N = 32, tiny), and compare at N = 256"
"$PY" benchmarks/bench_step.py --world-size 32 --steps 5 --repeats 1 --compare-world-size 256

section "what bounds a stage on $(nproc) cores (N = 32, tiny)"
"$PY" benchmarks/bench_bound.py --world-size 32

section "how many rank threads should run at once on $(nproc) cores (N = 32, tiny)"
"$PY" benchmarks/bench_slots.py --world-size 32 --stages 0,3 --slots 1,2,3,4,5,9,17

section "the same N = 32 as processes on $(nproc) cores: gloo, one interpreter lock per rank (tiny, 5 steps)"
timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node=32 -m zero_core.launch \
    --preset tiny --stages 0,1,2,3 --steps 5 --no-progress
