#!/usr/bin/env bash
# One GPU call: install sparta (no deps, no TVM), run the GPU suite on fixtures built from this commit, then the
# benchmarks named in $1 ("suite", "gemv", "bert", "rmsnorm", "generate"; default all but generate). Logs and results JSON go to $OUT (or
# results/). The artifacts travel as one archive (artifacts/cuda.tar.xz of artifacts/cuda and the benchmarks' folders).
#   python tests/fixtures/build_cuda.py; python benchmarks/bench_cuda_any_rows_gemv.py --build     # build machine
#   bash benchmarks/gpu_checks.sh "suite gemv"                                                       # GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
WHAT=${1:-suite gemv bert rmsnorm}
[ -f artifacts/cuda.tar.xz ] && rm -rf artifacts/cuda && tar -C artifacts -xJf artifacts/cuda.tar.xz
if ! python -c "import sparta.passes" 2>/dev/null; then    # the package-dir mapping without installing: links
    for d in passes codegen templates; do [ -e "sparta/$d" ] || ln -s "../$d" "sparta/$d"; done
fi
python -c "import sparta, torch; print('sparta', sparta.__file__, 'torch', torch.__version__, torch.cuda.get_device_name())"
export SPARTA_CUDA_ARTIFACTS=$PWD/artifacts/cuda SPARTA_RESULTS=$OUT PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [[ $WHAT == *suite* ]]; then
    python -m pytest -q -p no:cacheprovider -rfEs tests/runtime tests/passes/test_scramble.py \
        tests/codegen/test_select_cuda.py > "$OUT/gpu_suite.log" 2>&1
    echo "GPU suite exit $?"; tail -25 "$OUT/gpu_suite.log"
fi
if [[ $WHAT == *gemv* ]]; then
    python benchmarks/bench_cuda_any_rows_gemv.py > "$OUT/any_rows_gemv.log" 2>&1; tail -28 "$OUT/any_rows_gemv.log"
fi
if [[ $WHAT == *bert* ]]; then
    python benchmarks/bench_dynamic_bert.py --padded artifacts/bert_padded --saved artifacts/bert_dynamic \
        > "$OUT/padded_bert.log" 2>&1; tail -20 "$OUT/padded_bert.log"
fi
if [[ $WHAT == *rmsnorm* ]]; then
    python benchmarks/bench_cuda_rmsnorm.py > "$OUT/rmsnorm.log" 2>&1; tail -6 "$OUT/rmsnorm.log"
fi
if [[ $WHAT == *generate* ]]; then      # folders of bench_generate.py --build: gen*/ (kernels only)
    for d in artifacts/gen*/; do
        n=$(basename "$d"); for b in ${GEN_BATCHES:-1}; do
            python benchmarks/bench_generate.py --dir "$d" --batch "$b" --out "$OUT/generate-$n-b$b.json" \
                > "$OUT/generate-$n-b$b.log" 2>&1; tail -22 "$OUT/generate-$n-b$b.log"
        done
    done
fi
ls "$OUT"      # the benchmarks write their JSON there ($SPARTA_RESULTS)
