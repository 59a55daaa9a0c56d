#!/usr/bin/env bash
# Real SGLang and the trainer on a CUDA GPU: the checks CI cannot make.
#
# Runs the trainer's device tests (tests/test_placement.py: a step in bfloat16 on the GPU, its
# snapshot and checkpoint read back on the CPU), then starts one SGLang server on a tiny HF model
# made by tandem's model factory and runs tandem's engine contract suite (tests/test_engine_contract.py) against it: logprobs against a reference
# forward pass at temperatures 1 and 0.7, update_weights_from_disk with a new snapshot and
# weight_version, a weight load while requests run (pause in mode retract, which lets SGLang flush
# its KV cache), pause/continue (not the abort of a request held by a pause: SGLang holds it where
# an abort does not reach), the context-length check, malformed requests and the API
# key. Prints `gpu_check: PASS` or every failure. Needs a CUDA GPU and
# `pip install -e '.[sglang,test]'` (PYTHON picks the interpreter). The first SGLang start
# compiles kernels and captures CUDA graphs for minutes: pytest's per-test timeout is raised for
# it, and an engine whose start is interrupted is stopped (EngineProcess.wait_healthy).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
LOG=${GPU_CHECK_LOG:-$(mktemp -t gpu_check.XXXXXX.log)}

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: FAIL no CUDA GPU visible to $PYTHON"
  exit 1
fi
if ! "$PYTHON" -c "import sglang" 2>/dev/null; then
  echo "gpu_check: FAIL sglang is not installed: pip install -e '.[sglang,test]'"
  exit 1
fi
"$PYTHON" -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__, torch.cuda.get_device_name())"

TANDEM_ENGINE_BACKEND=sglang "$PYTHON" -m pytest tests/test_placement.py tests/test_engine_contract.py -q -p no:cacheprovider -o timeout=1200 2>&1 | tee "$LOG"
code=${PIPESTATUS[0]}
if [ "$code" -eq 0 ]; then
  echo "gpu_check: PASS"
else
  failed=$(grep -E '^(FAILED|ERROR) ' "$LOG" || tail -n 1 "$LOG")
  echo "gpu_check: FAIL (full log: $LOG)"
  echo "$failed"
fi
exit "$code"
