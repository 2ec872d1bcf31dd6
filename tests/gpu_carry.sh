#!/bin/bash
# Makes what tests/gpu_check.py needs on a lent GPU machine and cannot fetch there, in two folders that git ignores
# and the device call carries: .whl/ (DeepSpeed and the packages it needs that the machine's image lacks, for its
# Python 3.12, and py-spy for part C's host profiles) and .gpu/input.txt (tiny Shakespeare). Run it here, in the
# repo, with the package registry at hand:
#   bash tests/gpu_carry.sh [path to tiny Shakespeare's input.txt]
set -euo pipefail
cd "$(dirname "$0")/.."
input=${1:-../shared/data/tinyshakespeare/input.txt}
mkdir -p .git/info .whl .gpu
for d in /.whl/ /.gpu/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
cp "$input" .gpu/input.txt
# DeepSpeed is published as source only: its wheel is built here, with no ops compiled in (they are compiled on the
# GPU machine when first used, against its torch and CUDA)
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl/src deepspeed==0.19.8
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl .whl/src/deepspeed-0.19.8.tar.gz
rm -rf .whl/src
# the image has DeepSpeed's other needs (ninja, numpy, psutil, py-cpuinfo, msgpack, einops, tqdm, nvidia-ml-py)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
# py-spy: one binary, for any Python (a py2.py3 wheel)
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d .whl py-spy==0.4.2
du -sh .whl .gpu
