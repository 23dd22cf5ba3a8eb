#!/usr/bin/env bash
# Issue 16 item 4 on one machine of 2 H200s, in about 8 minutes: benchmarks/ray_gpu.py's sections
# and the remote-cluster run (remote_x2.sh). Every figure goes to OUT/ray_gpu.json; the last
# lines printed are every section's figures. Run after the unpack line of
# shared/gpu/README.md, the .whl install line (papermill; benchmarks/gpu_runs/wheels.sh) and
# PYTHONPATH=/tmp/site:$PWD, carrying .carry (gpu_site.tar.xz) and .whl; not yet run
# (the 2-GPU machine was not lent on 2026-12-01): benchmarks/RESULTS.md, issue 16.
#   bash benchmarks/gpu_runs/ray_x2.sh OUT_DIR        (BUDGET_S: seconds for all of it, 530)
set -u
OUT=${1:?usage: ray_x2.sh OUT_DIR}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-530} ))
B="python3 benchmarks/ray_gpu.py --out $OUT --deadline-at $DEADLINE"
cap() { local left=$(( DEADLINE - $(date +%s) - ${2:-0} )); echo $(( left < $1 ? (left > 5 ? left : 5) : $1 )); }

# 1. in-process on GPU 0 beside Ray 1 worker + 1 engine on GPU 1 (a GPU each, at once)
CUDA_VISIBLE_DEVICES=0 timeout "$(cap 170)" $B --sections inprocess > "$OUT/p1_inprocess.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout "$(cap 170)" $B --sections ray1 > "$OUT/p1_ray1.log" 2>&1 &
wait
# 2. 2 workers (NCCL) + 2 engines colocated on 2 GPUs; then 1 + 1 on a GPU each, with the syncs
timeout "$(cap 210 150)" $B --sections ray2_colocated,ray_split > "$OUT/p2.log" 2>&1
# 3. vLLM engines in Ray actors (a local instance) beside the remote cluster (ray start + client)
timeout "$(cap 260)" $B --sections vllm_actors > "$OUT/p3_vllm.log" 2>&1 &
VLLM=$!
timeout "$(cap 200)" bash benchmarks/gpu_runs/remote_x2.sh "$OUT" > "$OUT/p3_remote.log" 2>&1
wait $VLLM
python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
python3 benchmarks/ray_gpu.py --out "$OUT" --sections summary > "$OUT/summary.log" 2>&1
for f in p1_inprocess p1_ray1 p2 p3_vllm p3_remote summary; do
  echo "=== $f"; grep -E "^\[ *[0-9.]+s\]|^remote:|Error|error" "$OUT/$f.log" | grep -v "^\s*$" | cut -c1-600 | tail -n 25
done
