#!/usr/bin/env bash
# Two or more checkouts' quantized kernels in one process, taking turns on one-row GEMVs (a decode step's
# projections; or GEMMs of ROWS rows, a batch's) over distinct weights streamed from memory:
#
#   bench/kernel_ab/run.sh CHECKOUT... [-- LAYOUTS [KIND [N K [WEIGHTS [TURNS [ROWS]]]]]]
#   bench/kernel_ab/run.sh /work/base . -- Q4_K,Q6_K vnni512 57344 4096 4 40
#
# Each checkout's kernel_check.cpp is compiled with its namespace renamed, so that the builds link side by side.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
checkouts=()
while [[ $# -gt 0 && "$1" != "--" ]]; do checkouts+=("$(cd "$1" && pwd)"); shift; done
[[ $# -gt 0 ]] && shift
if [[ ${#checkouts[@]} -eq 0 ]]; then
  echo "usage: $0 CHECKOUT... [-- LAYOUTS [KIND [N K [WEIGHTS [TURNS [ROWS]]]]]]" >&2
  exit 2
fi
layouts=${1:-Q4_K,Q6_K} kind=${2:-vnni512} n=${3:-57344} k=${4:-4096} weights=${5:-4} turns=${6:-40} rows=${7:-1}
out=${KERNEL_AB_BUILD:-build/kernel_ab}
mkdir -p "$out"
declarations="" list="" objects=() pids=()
for i in "${!checkouts[@]}"; do
  c=${checkouts[$i]}
  c++ -c -std=c++17 -O3 -march=native -fopenmp -falign-loops=64 -w -I"$c/conveyor/model/native/csrc" \
    -DKERNEL_AB_V="ab$i" -Dconveyor="conveyor_ab$i" -Dmain="main_ab$i" "$here/variant.cpp" -o "$out/ab$i.o" &
  pids+=($!)
  declarations+=" KERNEL_AB_DECLARE(ab$i)"
  changed=$(git -C "$c" diff --quiet HEAD -- conveyor/model/native/csrc || echo +)
  label="${c##*/}@$(git -C "$c" rev-parse --short HEAD)$changed"
  list+="{\"$label\", setup_ab$i, time_ab$i, bytes_ab$i},"
  objects+=("$out/ab$i.o")
done
for pid in "${pids[@]}"; do wait "$pid"; done
c++ -std=c++17 -O2 -fopenmp "-DVARIANT_DECLARATIONS=$declarations" "-DVARIANT_LIST=$list" "$here/driver.cpp" \
  "${objects[@]}" -o "$out/driver"
for layout in ${layouts//,/ }; do
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$out/driver" "$layout" "$kind" "$n" "$k" "$weights" "$turns" "$rows"
done
