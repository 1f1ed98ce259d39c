#!/usr/bin/env bash
# Stages FlashQLA's and FlashInfer's software stacks for the GPU machine, which has no network: run here (with
# network, from the repository root), then carry the part folders to the GPU machine one call each, back to back
# while it is warm (a call carries at most 64 MiB); benchmarks/gpu.sh's "peers" step gathers the parts and unpacks
# them once all have arrived, and its "qla" / "fi" steps time the two peers in processes of their own.
#
# usage: bash benchmarks/stage_peers.sh [PART_MB]        (default 56: three parts of the two stacks, ~160 MB)
# writes: .peers/ (the downloads and the pruned trees, git-ignored), .peers1/ .. .peersN/ (one part each, with the
#   manifest: the parts' count and the archive's sha256)
#
# The stacks (Python 3.12, manylinux x86_64, the versions the bench's figures were taken with):
#   qla/  flash-qla 0.1.3, tilelang 0.1.15, apache-tvm-ffi 0.1.12, torch-c-dlpack-ext 0.1.5, z3-solver 4.15.4.0
#         (wheels; gpu.sh installs them with pip --target)
#   fi/   flashinfer-python 0.7.2.post1 (without its data/ folder of sources, and with an __init__ that imports no
#         kernel family: the package's own imports every one), nvidia-cutlass-dsl 4.8.1 with its libs-base,
#         libs-core and libs-cu13 wheels, apache-tvm-ffi 0.1.15.post2 (unpacked; `cutlass` is then importable
#         through nvidia_cutlass_dsl/dsl_packages, which the wheel's .pth file would have added)
set -euo pipefail
part_mb=${1:-56}
root=.peers
rm -rf "$root" .peers[0-9]*
mkdir -p "$root/dl/qla" "$root/dl/fi" "$root/stage/qla" "$root/stage/fi"
plat=(--python-version 3.12 --only-binary=:all: --no-deps --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
pip download -q "${plat[@]}" -d "$root/dl/qla" flash-qla==0.1.3 tilelang==0.1.15 apache-tvm-ffi==0.1.12 \
  torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0
pip download -q "${plat[@]}" -d "$root/dl/fi" flashinfer-python==0.7.2.post1 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
  apache-tvm-ffi==0.1.15.post2
cp "$root"/dl/qla/*.whl "$root/stage/qla/"
for w in "$root"/dl/fi/*.whl; do
  python -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$root/stage/fi"
done
rm -rf "$root/stage/fi/flashinfer/data" "$root"/stage/fi/*.pth
find "$root/stage/fi" -name __pycache__ -prune -exec rm -rf {} +
cat > "$root/stage/fi/flashinfer/__init__.py" <<'EOF'
# a pruned copy of flashinfer 0.7.2.post1 for timing flashinfer.gdn_prefill only (benchmarks/stage_peers.sh):
# the package's own __init__ imports every kernel family and their dependencies
from .version import __version__ as __version__
from .version import __git_commit__ as __git_commit__
EOF
tar -C "$root/stage" -cf - qla fi | xz -T0 -6 > "$root/peers.tar.xz"
split -b "${part_mb}M" -d -a 1 "$root/peers.tar.xz" "$root/peers.tar.xz.part"
parts=("$root"/peers.tar.xz.part*)
sum=$(sha256sum "$root/peers.tar.xz" | cut -d' ' -f1)
i=1
for p in "${parts[@]}"; do
  mkdir -p ".peers$i"
  mv "$p" ".peers$i/"
  printf 'parts %s\nsha256 %s\n' "${#parts[@]}" "$sum" > ".peers$i/manifest"
  i=$((i + 1))
done
du -sh .peers[0-9]*
echo "carry each of $(ls -d .peers[0-9]* | tr '\n' ' ')in its own call (alone: a part and the tree fill most of the"
echo "64 MiB), back to back: bash benchmarks/gpu.sh peers; then COMMIT=<commit> bash benchmarks/gpu.sh qla fi"
