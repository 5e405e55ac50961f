#!/usr/bin/env bash
# The prepared check for a lent GPU machine (one H100 or H200, 16 cores, maybe no network): about
# 7 minutes, every step under its own timeout, everything it needs inside this repository (plus
# torch with CUDA, pytest, and DeepSpeed where its wheel came along: its row is skipped otherwise).
#
#   bench/gpu_check.sh --dry-run          # what it would run; checks that everything it needs exists
#   bench/gpu_check.sh [--out DIR]        # run it (default DIR: $OUT if set, else /tmp/zt_gpu_check)
#
# Steps: (1) the GPU and torch; (2) NCCL on a single rank (every collective zerotrain uses);
# (3) csrc/*.cu built by the ops builder and their kernel tests; (4) tests/gpu: the ZeRO stages,
# offload and the Trainer on CUDA, and compiled blocks (zero2/zero3, inductor) against eager PyTorch;
# (5) the demo GPT at 124M in bf16: plain PyTorch, zerotrain single and zero2 + CPU offload, DeepSpeed
# ZeRO-2 offload (tokens/s, MFU, peak memory); (6) the largest GPT plain PyTorch and zerotrain's CPU
# offload train (85 s of budget). Each step's log and the summary go to DIR.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
OUTDIR="${OUT:-/tmp/zt_gpu_check}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) shift; OUTDIR="${1:?--out needs a directory}" ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1'; valid: --dry-run, --out DIR" >&2; exit 2 ;;
    esac
    shift
done

# the repository as the package 'zerotrain' (setup.py maps the root onto it), without installing
PKG="$(mktemp -d /tmp/zt_gpu_pkg.XXXXXX)"
ln -s "$ROOT" "$PKG/zerotrain"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
PYTEST="$PY -m pytest -c zerotrain/setup.cfg --rootdir $PKG -q -rs -p no:cacheprovider"

# name | timeout (s) | command (run in $PKG)
STEPS=(
    "env|30|nvidia-smi -L && $PY -c 'import torch; assert torch.cuda.is_available(), \"no CUDA device\"; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'"
    "nccl|40|$PY -m zerotrain.bench.gpu_bench nccl"
    "kernels|90|$PYTEST zerotrain/tests/kernels/test_fused_adam_cuda.py zerotrain/tests/kernels/test_quantize_cuda.py"
    "cuda_tests|100|$PYTEST zerotrain/tests/gpu"
    "gpt124m|110|$PY -m zerotrain.bench.gpu_bench measure --steps 8 --warmup 3 --timeout 60 --out $OUTDIR/gpu_bench.md"
    "offload_ladder|100|$PY -m zerotrain.bench.gpu_bench ladder --budget-s 85 --timeout 60 --out $OUTDIR/gpu_bench.md"
)
NEEDED=(
    csrc/adam/fused_adam.cu csrc/quantize/quantize.cu ops/builder.py setup.cfg
    tests/kernels/test_fused_adam_cuda.py tests/kernels/test_quantize_cuda.py
    tests/gpu/test_cuda_strategies.py tests/gpu/test_cuda_compile.py tests/tolerance.py tests/conftest.py
    bench/gpu_bench.py callbacks/measure/flops.py examples/gpt.py
)

total=0
for s in "${STEPS[@]}"; do total=$((total + $(cut -d'|' -f2 <<<"$s"))); done

if [ "$DRY" = 1 ]; then
    missing=()
    for f in "${NEEDED[@]}"; do [ -e "$ROOT/$f" ] || missing+=("$f"); done
    command -v "$PY" >/dev/null || missing+=("$PY (the interpreter)")
    (cd "$PKG" && $PY -m zerotrain.bench.gpu_bench measure --help >/dev/null 2>&1) \
        || missing+=("a working 'python -m zerotrain.bench.gpu_bench' (torch importable?)")
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name limit cmd <<<"$s"
        echo "would run [$name] (timeout ${limit} s): $cmd"
    done
    echo "total of the step timeouts: ${total} s (budget 480 s); logs and summary in $OUTDIR"
    rm -rf "$PKG"
    if [ "$total" -gt 480 ]; then echo "gpu_check.sh: the steps' timeouts add up to ${total} s > 480 s" >&2; exit 1; fi
    if [ ${#missing[@]} -gt 0 ]; then
        printf 'gpu_check.sh: missing: %s\n' "${missing[@]}" >&2
        exit 1
    fi
    echo "dry run ok: every file and tool the check needs is here"
    exit 0
fi

mkdir -p "$OUTDIR"
summary="$OUTDIR/summary.md"
{ echo "# gpu_check $(date -u +%FT%TZ) on $(hostname)"; echo; echo "| step | rc | seconds |"; echo "|---|---|---|"; } > "$summary"
failed=0
for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    echo "=== [$name] (timeout ${limit} s): $cmd"
    start=$(date +%s)
    (cd "$PKG" && timeout --kill-after=10 "$limit" bash -c "$cmd") >"$OUTDIR/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    tail -n 25 "$OUTDIR/$name.log"
    echo "| $name | $rc | $secs |" >> "$summary"
    [ "$rc" = 0 ] || failed=$((failed + 1))
    if [ "$name" = env ] && [ "$rc" != 0 ]; then echo "no usable GPU: stopping" | tee -a "$summary"; break; fi
done
[ -f "$OUTDIR/gpu_bench.md" ] && cat "$OUTDIR/gpu_bench.md" >> "$summary"
echo; cat "$summary"
rm -rf "$PKG"
exit $(( failed > 0 ))
