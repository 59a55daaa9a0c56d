#!/usr/bin/env bash
# Real SGLang on a CUDA GPU: the one engine check CI cannot make.
#
# Starts one SGLang server on a tiny HF model made by tandem's model factory and runs tandem's
# engine contract suite (tests/test_engine_contract.py) against it: logprobs against a reference
# forward pass, seeded sampling, update_weights_from_disk with a new snapshot and weight_version,
# pause/continue/abort, malformed requests and the API key. Prints `gpu_check: PASS` or the first
# failure. Needs a CUDA GPU and `pip install -e '.[sglang,test]'` (PYTHON picks the interpreter).
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

TANDEM_ENGINE_BACKEND=sglang "$PYTHON" -m pytest tests/test_engine_contract.py -x -q -p no:cacheprovider 2>&1 | tee "$LOG"
code=${PIPESTATUS[0]}
if [ "$code" -eq 0 ]; then
  echo "gpu_check: PASS"
else
  first=$(grep -m1 -E '^(FAILED|ERROR) ' "$LOG" || tail -n 1 "$LOG")
  echo "gpu_check: FAIL $first (full log: $LOG)"
fi
exit "$code"
