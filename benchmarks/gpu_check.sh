#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (a lent GPU machine's time is short):
#   benchmarks/gpu_check.sh [OUT_DIR]
# 1. the GPU tests (map_location=cuda, load_into a CUDA model, the trainer on NCCL);
# 2. run.py --only load-gpu (fresh processes, against safetensors' load_file);
# 3. load_gpu_inprocess.py (one warm process: the loaders, the ceilings, staging variants).
# Logs go to OUT_DIR (default gpu-check/); the summary ends the output.
set -u
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
work=${BENCH_WORKDIR:-/tmp/ckpttool-bench}

{
    nvidia-smi -L
    "$py" -c 'import sys, torch, safetensors, typer; print(sys.version.split()[0], "torch",
torch.__version__, "safetensors", safetensors.__version__, "typer", typer.__version__,
torch.cuda.get_device_name(0), torch.cuda.device_count(), "GPU(s)")'
    echo "$(nproc) CPUs, $(free -g | awk '/Mem:/ {print $2}') GiB RAM"
} 2>&1 | tee "$out/env.txt"

# shellcheck disable=SC2086 (TESTS is a list of files)
timeout "${TEST_TIMEOUT:-300}" "$py" -m pytest -q -p no:cacheprovider -m gpu -rs \
    ${TESTS:-tests/test_gpu.py tests/test_load_into.py tests/test_trainer.py} 2>&1 |
    tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout "${BENCH_TIMEOUT:-240}" "$py" benchmarks/run.py --only load-gpu --repeat "${REPEAT:-5}" \
    --interleave \
    --workdir "$work" --markdown 2>&1 | tee "$out/run-load-gpu.txt"
bench_rc=${PIPESTATUS[0]}

scale="$work/scale-1"
timeout "${INPROCESS_TIMEOUT:-120}" "$py" benchmarks/load_gpu_inprocess.py \
    "$scale/model-1g.pt" "$scale/model-1g.safetensors" 2>&1 | tee "$out/inprocess.txt"
inprocess_rc=${PIPESTATUS[0]}

echo "== summary: tests rc=$tests_rc, run.py rc=$bench_rc, in-process rc=$inprocess_rc"
tail -n 3 "$out/tests.txt"
grep '^|' "$out/run-load-gpu.txt"
tail -n 20 "$out/inprocess.txt"
