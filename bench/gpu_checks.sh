#!/bin/bash
# Every check that needs an NVIDIA GPU, as one run (a lent machine: the device tool).
#
#   bash bench/gpu_checks.sh [SECTION ...]     (default: facts nccl groups elastic gpu bench ipc ipcbench)
#
# Sections: facts (GPU, cupy, NCCL), nccl (tests/test_nccl.py), groups
# (tests/test_nccl_groups.py), elastic (tests/test_elastic.py -k gpu: a shrink aborts and
# re-makes the NCCL communicator), c10d (tests/test_c10d_gpu.py: the torch backend "meshcomm"
# with CUDA tensors), gpu (tests/test_gpu.py; GPU_K=expr narrows it), bench
# (bench/nccl_overhead.py; PROFILE=N adds profiles of N group calls), staging
# (bench/gpu_staging.py), mbench (meshcomm-bench --backend nccl), meshrun (meshrun
# --backend nccl --nproc-per-node gpu), ipc (tests/test_gpu_ipc.py: ranks sharing one GPU
# over CUDA IPC), ipcbench (bench/gpu_ipc.py: that path against staging
# at 8 B, 1 MiB, 64 MiB, at each world of IPC_WORLDS, default "2"), overlap (bench/overlap.py:
# needs no GPU, but such a machine has a core per rank). Logs go to $OUT (default
# ./gpu-checks); the meshcomm checkout is put first on PYTHONPATH, no install needed. BUDGET
# (seconds, default 540) bounds the whole run.
set -u
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
S=" ${*:-facts nccl groups elastic gpu bench ipc ipcbench} "
TEST=(-m pytest -o addopts=-ra -p no:cacheprovider -q)
# The whole run stays within BUDGET seconds (default 540: one call of the device tool is 600):
# each section's timeout is cut to what is left, and a section with under 20 s left is
# skipped, named in $OUT/skipped.log, so that the logs of the others always come back.
BUDGET=${BUDGET:-540}
has() { [[ $S == *" $1 "* ]]; }
run() {  # run SECTION SECONDS COMMAND...: the command's output into $OUT/SECTION.log
    local name=$1 limit=$2 left=$((BUDGET - SECONDS))
    shift 2
    if ((left < 20)); then
        echo "$name: skipped, ${left} s of the ${BUDGET} s budget left" | tee -a "$OUT/skipped.log"
        return
    fi
    timeout $((limit < left ? limit : left)) "$@" 2>&1 | tee "$OUT/$name.log"
}
if has facts; then
    { nvidia-smi -L; $PY -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'NCCL', nccl.get_version())"; } 2>&1 | tee "$OUT/facts.log"
fi
# PARALLEL=1: the test sections run side by side (one GPU, a core each), then the benches
# alone; each test section's log ends with pytest's summary line.
check() {  # check SECTION SECONDS COMMAND...: a test section
    if [[ ${PARALLEL:-0} == 1 ]]; then run "$@" >/dev/null & else run "$@"; fi
}
if has nccl; then check nccl 200 $PY "${TEST[@]}" --timeout 60 tests/test_nccl.py tests/test_nccl_native.py; fi
if has c10d; then check c10d 240 $PY "${TEST[@]}" --timeout 220 tests/test_c10d_gpu.py; fi
if has elastic; then check elastic 120 $PY "${TEST[@]}" --timeout 90 tests/test_elastic.py -k gpu; fi
if has groups; then check groups 180 $PY "${TEST[@]}" --timeout 150 tests/test_nccl_groups.py; fi
if has gpu; then check gpu 300 $PY "${TEST[@]}" --timeout 240 tests/test_gpu.py ${GPU_K:+-k "$GPU_K"}; fi
if has ipc; then check ipc 300 $PY "${TEST[@]}" --timeout 240 tests/test_gpu_ipc.py; fi
wait
if [[ ${PARALLEL:-0} == 1 ]]; then
    for log in "$OUT"/*.log; do echo "$(basename "$log" .log): $(tail -n 1 "$log")"; done
fi
if has bench; then run bench 120 $PY bench/nccl_overhead.py --rounds 5 --json "$OUT/nccl_overhead.json" ${PROFILE:+--profile "$PROFILE"}; fi
if has staging; then run staging 180 $PY bench/gpu_staging.py --rounds 2; fi
if has mbench; then run mbench 120 $PY -m meshcomm.bench --backend nccl -b 8 -e 64M -f 8; fi
if has meshrun; then run meshrun 90 $PY -m meshcomm.run --backend nccl --nproc-per-node gpu tests/scripts/nccl_psum.py; fi
if has ipcbench; then
    for world in ${IPC_WORLDS:-2}; do
        run "ipcbench$world" 150 $PY bench/gpu_ipc.py --world "$world" --rounds 1 --json "$OUT/gpu_ipc_$world.json"
    done
fi
if has overlap; then run overlap 300 $PY bench/overlap.py --repeats 15; fi
true
