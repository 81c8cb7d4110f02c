#!/usr/bin/env bash
# Ready for the first GPU: on a bare GPU machine, build ckpt's compiled core in place, run the GPU
# tests, run them again under compute-sanitizer's memcheck, and run benchmarks/gpu_snapshot.py.
#
#   bash benchmarks/gpu_ready.sh                   # every phase, in order: build test sanitize bench
#   bash benchmarks/gpu_ready.sh build test        # the phases named, in the order given
#   bash benchmarks/gpu_ready.sh --help
#
# Phases: build (setup.py build_ext --inplace, CKPT_BUILD_STRICT=1, then the library's probe of GPU 0),
# test (tests/test_gpu.py, test_cuda_core.py, test_fence.py, and test_host_memory_save.py's CUDA test),
# sanitize (memcheck over the GPU tests that launch ckpt's kernel; skipped with a message where
# compute-sanitizer is absent), bench (benchmarks/gpu_snapshot.py; extra arguments in BENCH_ARGS).
# A phase other than build builds first if the CUDA library is missing. Each phase is cut off after
# PHASE_LIMIT_S seconds (default 540). Logs and the benchmark's tables go to $OUT if set, else
# benchmarks/results/gpu_ready; a summary line per phase ends the output. The whole of it ran in
# 4 minutes on an H200 (benchmarks/readings/gpu_snapshot.md, "Running it": how, on a lent machine).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu_ready}
LIMIT=${PHASE_LIMIT_S:-540}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY=()

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

# ckpt's own imports. A machine that cannot reach a package index gets the missing ones as wheels
# in .whl/ (carried with the working tree; benchmarks/readings/gpu_snapshot.md, "Running it", says how to
# fetch them).
deps() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ckpt-site \
            .whl/*.whl || return 1
        export PYTHONPATH="$PYTHONPATH:/tmp/ckpt-site"
    fi
    local missing
    missing=$("$PY" -c 'import importlib.util as u
print(" ".join(m for m in ("torch", "numpy", "fsspec", "zstandard", "xxhash", "rich", "safetensors", "pytest")
               if u.find_spec(m) is None))')
    if [ -n "$missing" ]; then
        echo "missing Python packages: $missing. Where there is no index, put their wheels in .whl/ (benchmarks/readings/gpu_snapshot.md," \
             "'Running it') and run again."
        return 1
    fi
}

build() {
    CKPT_BUILD_STRICT=1 timeout "$LIMIT" "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1
    local rc=$?
    tail -n 3 "$OUT/build.log"
    [ $rc -eq 0 ] || { echo "build failed (rc $rc): $OUT/build.log"; return $rc; }
    # the library's own verdict on GPU 0: driver new enough, a kernel image for this GPU
    "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/build.log"
import sys
import torch
import ckpt._ext as e
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| GPU", torch.cuda.get_device_name(0),
      torch.cuda.get_device_capability(0))
print("core:", e.info())
core = e.cuda()
if core is None:
    sys.exit("the CUDA library did not load (see the warning above)")
with torch.cuda.device(0):
    p = core.probe(0)
why = e.cuda_verdict(p, core.error_string(p.kernel_error))
print(p, "->", why or "usable")
sys.exit(1 if why else 0)
EOF
}

built() { compgen -G "ckpt/_cuda_copy*.so" >/dev/null && compgen -G "ckpt/_copyhash*.so" >/dev/null; }

run_tests() {
    timeout "$LIMIT" "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_cuda_core.py \
        tests/test_fence.py tests/test_host_memory_save.py::test_cuda_state_larger_than_the_budget_goes_through_pinned_slabs \
        2>&1 | tee "$OUT/test.log" | tail -n 40
}

sanitizer() {
    local c
    for c in "$(command -v compute-sanitizer 2>/dev/null)" "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
             /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer \
             /opt/nvidia/*/compute-sanitizer; do
        [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
    done
    return 1
}

sanitize() {
    local cs
    if ! cs=$(sanitizer); then
        echo "compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*): memcheck skipped" | tee "$OUT/sanitize.log"
        return 0
    fi
    # Without torch's caching allocator each tensor is its own cudaMalloc, so memcheck sees its
    # bounds. The tests that launch ckpt's kernel or copy through the side stream; not the 3 GiB one
    # (instrumented, it would take the whole phase) nor the Lightning fit. Nor the unfenced negative
    # control: memcheck runs one kernel at a time, so the unordered step it counts on cannot overtake
    # the copy there (seen on the first H200 run: the control "failed" by being correct). Nor the
    # conjugated views, which go through torch's own copies: with the caching allocator off, that test
    # ended in an abort inside torch (2.11) with 0 memcheck errors reported before it.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$LIMIT" "$cs" --tool memcheck --error-exitcode 99 \
        --target-processes all --print-limit 50 \
        "$PY" -m pytest -q -p no:cacheprovider -x tests/test_gpu.py \
        -k "(batched_copy or unrolled or work_queued or nan_in_the_last or guarded_copy or state_dicts or ckpts_own) and not unfenced" \
        >"$OUT/sanitize.log" 2>&1
    local rc=$?
    grep -E "ERROR SUMMARY|passed|failed|error" "$OUT/sanitize.log" | tail -n 20
    return $rc
}

bench() {
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
    timeout "$LIMIT" "$PY" benchmarks/gpu_snapshot.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 40
}

phase() {
    local name=$1 started rc
    started=$(date +%s)
    echo "== $name"
    case $name in
        build) build ;;
        test) run_tests ;;
        sanitize) sanitize ;;
        bench) bench ;;
    esac
    rc=$?
    local how="ok"
    [ $rc -eq 124 ] && how="cut off after ${LIMIT}s"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && how="FAILED (rc $rc)"
    SUMMARY+=("$name: $how in $(( $(date +%s) - started ))s")
    return $rc
}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(build test sanitize bench)
for p in "${phases[@]}"; do
    case $p in
        -h|--help) usage; exit 0 ;;
        build|test|sanitize|bench) ;;
        *) echo "unknown phase '$p' (build, test, sanitize, bench)" >&2; usage >&2; exit 2 ;;
    esac
done

deps || exit 3
failed=0
for p in "${phases[@]}"; do
    if [ "$p" != build ] && ! built; then
        phase build || { failed=1; break; }
    fi
    phase "$p" || failed=1
done
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
exit $failed
