#!/bin/bash
# Every check that needs an NVIDIA GPU, as one run (a lent machine: the device tool).
#
#   bash bench/gpu_checks.sh [SECTION ...]     (default: facts nccl groups elastic gpu bench ipc)
#
# Sections: facts (GPU, cupy, NCCL), nccl (tests/test_nccl.py), groups
# (tests/test_nccl_groups.py), elastic (tests/test_elastic.py -k gpu: a shrink aborts and
# re-makes the NCCL communicator), c10d (tests/test_c10d_gpu.py: the torch backend "meshcomm"
# with CUDA tensors), gpu (tests/test_gpu.py; GPU_K=expr narrows it), bench
# (bench/nccl_overhead.py), staging (bench/gpu_staging.py), mbench (meshcomm-bench --backend
# nccl), meshrun (meshrun --backend nccl --nproc-per-node gpu), ipc (tests/test_gpu_ipc.py:
# ranks sharing one GPU over CUDA IPC, then bench/gpu_ipc.py: that path against staging at
# 8 B, 1 MiB, 64 MiB, world 2; IPC_WORLD=4 for world 4), overlap (bench/overlap.py:
# needs no GPU, but such a machine has a core per rank). Logs go to $OUT (default
# ./gpu-checks); the meshcomm checkout is put first on PYTHONPATH, no install needed.
set -u
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
S=" ${*:-facts nccl groups elastic gpu bench ipc} "
TEST=(-m pytest -o addopts=-ra -p no:cacheprovider -q)
has() { [[ $S == *" $1 "* ]]; }
if has facts; then
    { nvidia-smi -L; $PY -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'NCCL', nccl.get_version())"; } 2>&1 | tee "$OUT/facts.log"
fi
if has nccl; then timeout 200 $PY "${TEST[@]}" --timeout 60 tests/test_nccl.py tests/test_nccl_native.py 2>&1 | tee "$OUT/nccl.log"; fi
if has c10d; then timeout 240 $PY "${TEST[@]}" --timeout 220 tests/test_c10d_gpu.py 2>&1 | tee "$OUT/c10d.log"; fi
if has elastic; then timeout 120 $PY "${TEST[@]}" --timeout 90 tests/test_elastic.py -k gpu 2>&1 | tee "$OUT/elastic.log"; fi
if has groups; then timeout 180 $PY "${TEST[@]}" --timeout 150 tests/test_nccl_groups.py 2>&1 | tee "$OUT/groups.log"; fi
if has gpu; then timeout 300 $PY "${TEST[@]}" --timeout 240 tests/test_gpu.py ${GPU_K:+-k "$GPU_K"} 2>&1 | tee "$OUT/gpu.log"; fi
if has bench; then timeout 120 $PY bench/nccl_overhead.py --rounds 5 --json "$OUT/nccl_overhead.json" 2>&1 | tee "$OUT/bench.log"; fi
if has staging; then timeout 180 $PY bench/gpu_staging.py --rounds 2 2>&1 | tee "$OUT/staging.log"; fi
if has mbench; then timeout 120 $PY -m meshcomm.bench --backend nccl -b 8 -e 64M -f 8 2>&1 | tee "$OUT/mbench.log"; fi
if has meshrun; then timeout 90 $PY -m meshcomm.run --backend nccl --nproc-per-node gpu tests/scripts/nccl_psum.py 2>&1 | tee "$OUT/meshrun.log"; fi
if has ipc; then
    timeout 300 $PY "${TEST[@]}" --timeout 240 tests/test_gpu_ipc.py 2>&1 | tee "$OUT/ipc.log"
    timeout 150 $PY bench/gpu_ipc.py --world "${IPC_WORLD:-2}" --rounds 1 --json "$OUT/gpu_ipc.json" 2>&1 | tee "$OUT/ipc_bench.log"
fi
if has overlap; then timeout 300 $PY bench/overlap.py --repeats 15 2>&1 | tee "$OUT/overlap.log"; fi
true
