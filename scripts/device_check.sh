#!/usr/bin/env bash
# GPU check, for when a CUDA machine is available (one H100/H200 is plenty): the decoder tests (CPU + the `gpu`
# marked CUDA/bf16 tests), the model-family tests and --family benchmarks (bf16), and the decoder benchmark on the
# reference target + a draft, in under 8 minutes (not yet run on a GPU: no device was lent when this was written).
#   bash scripts/device_check.sh [DRAFT_DIR]        (DRAFT_DIR defaults to the newest distill_med draft)
# Writes logs to ${OUT:-device_check_out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device_check_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
python - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0))
print("transformers", transformers.__version__)
PY
timeout 300 python -m pytest -q tests/decode -m gpu 2>&1 | tee "$out/pytest_gpu.txt"
gpu_rc=${PIPESTATUS[0]}
# the model families (sliding windows, lean forward per family): CPU tests, a few minutes
timeout 240 python -m pytest -q tests/decode/test_decode_sliding_window.py tests/decode/test_decode_fast_path.py \
  2>&1 | tee "$out/pytest_families.txt"
fam_rc=${PIPESTATUS[0]}
for fam in mistral qwen3 gemma2; do  # --family on the GPU in bf16: lean forward and Hugging Face path
  timeout 60 python scripts/bench_decode.py --family "$fam" --device cuda --dtype bfloat16 --num-prompts 2 \
    --prompt-len 24 --max-new-tokens 48 --repeats 1 --json-out "$out/bench_family_$fam.json" 2>&1 \
    | tee "$out/bench_family_$fam.txt" || fam_rc=1
done
draft=${1:-$(ls -d outputs/distill_med/*/drafts/distilled 2>/dev/null | tail -n 1)}
bench_rc=0
if [ -n "$draft" ]; then
  for dtype in float32 bfloat16; do
    timeout 120 python scripts/bench_decode.py --target distill/reference_target --draft "$draft" \
      --device cuda --dtype "$dtype" --num-draft-tokens 4 --max-new-tokens 64 --repeats 3 \
      --json-out "$out/bench_$dtype.json" 2>&1 | tee "$out/bench_$dtype.txt" || bench_rc=1
  done
else
  echo "no draft found: pass a draft directory (e.g. outputs/distill_med/<run>/drafts/distilled)" | tee "$out/bench.txt"
  bench_rc=1
fi
echo "gpu tests rc=$gpu_rc family tests/bench rc=$fam_rc bench rc=$bench_rc"
[ "$gpu_rc" -eq 0 ] && [ "$fam_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
