#!/usr/bin/env bash
# GPU tests and benchmarks in one call on a GPU host with TE 2.20 + MaxText 0.2.5 installed
# (on the project's H200: `source tools-device/env.sh` first). Stages: tests, gemm, quant, layer, small, proxy,
# calibrate (the step model's rates: bench/calibrate.py, into $out/calibration), tokens (the FP8 MLP from
# tokens, mosaic_tokens: its GPU tests and the layer against the buffer path; then run
# `proxy --paths temoe_fp8,temoe_fp8_unfused,stock_best` for the marginal layer), kept (what FP8 weight copies
# kept from step to step would cost against today's weight passes: bench/weight_quant.py's `persistent`, for
# the proxy's wi and wo).
#   bash bench/run_gpu.sh [tests] [gemm] [quant] [layer] [small] [calibrate] [tokens] [kept] [one_rank] [one_rank_sweep] [one_rank_h200] [one_rank_proxy] [variants] [proxy [--paths a,b]]
#   (default: tests gemm quant layer proxy)
# Writes bench/results/*.json|png (or $OUT when set) and the GPU test log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/plugin${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-bench/results}; mkdir -p "$out"
stages=("$@"); [ ${#stages[@]} -gt 0 ] || stages=(tests gemm quant layer proxy)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
rc=0
for i in "${!stages[@]}"; do
  case "${stages[$i]}" in
    tests) python3 -m pytest -q -rs -s tests/gpu --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log" || rc=1 ;;
    gemm) python3 bench/mosaic_gemm.py --out "$out" || rc=1 ;;  # tile sweep of temoe's kernels, with correctness
    quant) python3 bench/fp8_quant.py --out "$out" || rc=1 ;;  # FP8 cast-transpose block sweep, bit-checked vs XLA
    layer) python3 bench/moe_layer.py --out "$out" || rc=1 ;;
    small) python3 bench/small_model.py --out "$out" --data learnable --steps 300 --profile || rc=1 ;;  # 4 paths + 2 profiles
    calibrate) python3 bench/calibrate.py --out "$out/calibration" || rc=1 ;;
    tokens)
      python3 -m pytest -q -rs -s tests/gpu/test_blockwise.py -k "gathered or tokens_mlp" 2>&1 | tee "$out/gpu_tests.tokens.log" || rc=1
      python3 bench/moe_layer.py --out "$out" --iters 5 --no-per-gemm --errors --shapes dsv3,small_dsv3,gpt_oss_like \
        --paths temoe_fp8,temoe_fp8_unfused,temoe_fp8_blockwise,temoe_fp8_blockwise_unfused,tokamax_bf16 || rc=1 ;;
    kept)
      for w in wi:32,7168,4096 wo:32,2048,7168; do
        python3 bench/weight_quant.py --out "$out/weight_quant.kept.${w%%:*}" --shape "${w#*:}" --layers 4 --iters 5 \
          --shipped-only || rc=1
      done ;;
    one_rank)  # the H100 preset (compiling its 1,024-device step took 99-144 s a depth on the H200): one 600-s call
      python3 bench/one_rank.py configs/deepseek3-671b-h100x1024.yml --devices 1024 --slices 128 --layers 4,5 \
        --timeout 230 --out "$out" 2>&1 | grep -v "^\[NO-OP\]" | tee -a "$out/one_rank.log" || rc=1 ;;
    one_rank_sweep)  # the H100 sweep's best layout that starts (EP16 FSDP32 DP2, 4 sequences a GPU)
      python3 bench/one_rank.py configs/deepseek3-671b-h100x1024.yml --devices 1024 --slices 128 --layers 4,5 \
        --timeout 230 --out "$out" dcn_fsdp_parallelism=32 per_device_batch_size=4 2>&1 | grep -v "^\[NO-OP\]" \
        | tee -a "$out/one_rank.log" || rc=1 ;;
    one_rank_h200)  # the H200 x 128 preset, on the GPU it is for
      python3 bench/one_rank.py configs/deepseek3-671b-h200x128.yml --devices 128 --slices 16 --layers 4,5 \
        --timeout 230 --out "$out" 2>&1 | grep -v "^\[NO-OP\]" | tee -a "$out/one_rank.log" || rc=1 ;;
    one_rank_proxy)  # what mocked NCCL runs, and the 8-GPU proxy's rank
      python3 bench/mock_collectives.py --out "$out" --topologies 1x8x1,16x8x1 2>&1 | tee "$out/mock_collectives.log" || rc=1
      python3 bench/one_rank.py configs/deepseek3-proxy-8gpu.yml --devices 8 --timeout 120 --out "$out" 2>&1 \
        | grep -v "^\[NO-OP\]" | tee -a "$out/one_rank.log" || rc=1 ;;
    variants)  # the block-scaled kernels' options (fresh, col_scales, gmem_scales) against today's, with the check
      timeout -s TERM 450 python3 bench/mosaic_gemm.py --shapes dsv3 --scaling blockwise --variants --no-comparators \
        --out "$out" 2>&1 | tee "$out/mosaic_gemm_variants.log" || rc=1 ;;
    proxy) python3 bench/proxy_1gpu.py --out "$out" "${stages[@]:$((i+1))}" || rc=1; break ;;
  esac
done
exit $rc
