#!/usr/bin/env bash
# The lookahead scheduling study (benchmarks/lookahead.py --concurrency) on a CUDA GPU: adaptive (both
# objectives) vs lookahead off vs fixed (15,5,15) and (4,3,4), the default model, bfloat16, greedy.
#
# Written for a machine with torch and CUDA but no package registry (the device machine). What it lacks
# comes beside the checkout, in paths git ignores:
#   .whl/*.whl          wheels installed into /tmp/site (transformers 5.24.0, gguf, regex)
#   .gpu/*.part-*       the default model's GGUF in parts (with model.sha256), joined with any parts an
#                       earlier call left in $MODEL_PARTS (default /tmp/model-parts): the file is larger
#                       than one transfer
#   .gpu/mt_bench_questions.jsonl, .gpu/humaneval.jsonl.gz   the prompt sets (else ../shared/data)
# With none of these, it runs on what is installed, with the embedded model and ../shared/data.
#
#   bash benchmarks/gpu_lookahead.sh [more benchmarks/lookahead.py flags]
#
# How it ran on the device machine (64 MiB travel per call, the GGUF is 98 MB): `split -b 49181216 -d -a 2
# <gguf> .gpu/model.part-` here; a first call with .gpu holding model.part-00 copies it to /tmp/model-parts;
# a second call, at once (the machine stays warm 30 s), with .gpu holding model.part-01, model.sha256 and
# the prompt sets, and .whl, runs this script.
#
# Results: $OUT (or benchmarks/out)/gpu_lookahead.md, the log beside it (each finished cell is in the log
# as soon as it is done) and gpu_tests.log (the gpu-marked tests). DEVICE=cpu runs it all on the CPU and
# PYTHON=... with another interpreter, to try the script here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/out}
parts=${MODEL_PARTS:-/tmp/model-parts}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
mkdir -p "$out"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

data=()  # ../shared does not travel to the device machine: the prompt sets can come in .gpu/
if [ -f .gpu/mt_bench_questions.jsonl ] && [ -f .gpu/humaneval.jsonl.gz ]; then
    data=(--mt-bench .gpu/mt_bench_questions.jsonl --humaneval .gpu/humaneval.jsonl.gz)
fi
model=()
if compgen -G ".gpu/*.part-*" > /dev/null; then
    mkdir -p "$parts"
    cp .gpu/*.part-* "$parts"/
    cat $(ls "$parts"/*.part-* | sort) > /tmp/model.gguf
    if [ -f .gpu/model.sha256 ]; then
        echo "$(cat .gpu/model.sha256)  /tmp/model.gguf" | sha256sum -c -
    fi
    model=(--model /tmp/model.gguf)
fi

if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
fi
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# The gpu-marked tests first (CUDA greedy = Hugging Face, with and without lookahead); the study runs either way.
"$python" -m pytest -q -p no:cacheprovider -m gpu tests/model/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" || true
"$python" benchmarks/lookahead.py --device "$device" "${model[@]}" "${data[@]}" --dtype bfloat16 --concurrency 1,4,16,32 \
    --rounds 2 --objectives makespan,throughput --max-fixed-step-tokens 4096 --results "$out/gpu_lookahead.md" \
    "$@" 2>&1 | tee "$out/gpu_lookahead.log"
