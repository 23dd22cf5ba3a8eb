#!/usr/bin/env bash
# Issue 16 item 4 on ONE H200 (the 2-GPU machine was not lent): the sections of
# benchmarks/ray_gpu.py that fit one GPU, then the remote cluster run with NGPU=1.
#   in-process step; Ray 1 worker + 1 engine colocated (overhead, the update vs in-process,
#   weight sync through the object store); vLLM in 1 Ray actor beside 1 trainer, with the
#   remote run (ray start --head + ray:// train + papermill notebook 02) at the same time.
#   bash benchmarks/gpu_runs/ray_x1.sh OUT_DIR        (BUDGET_S: seconds for all of it, 330)
set -u
OUT=${1:?usage: ray_x1.sh OUT_DIR}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-330} ))
B="python3 benchmarks/ray_gpu.py --out $OUT --deadline-at $DEADLINE"
timeout 120 $B --sections inprocess > "$OUT/p1_inprocess.log" 2>&1
timeout 130 $B --sections ray1 > "$OUT/p2_ray1.log" 2>&1
timeout 170 $B --sections vllm_actors --vllm-actors 1 > "$OUT/p3_vllm.log" 2>&1 &
VLLM=$!
NGPU=1 timeout 150 bash benchmarks/gpu_runs/remote_x2.sh "$OUT" > "$OUT/p3_remote.log" 2>&1
wait $VLLM
python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
python3 benchmarks/ray_gpu.py --out "$OUT" --sections summary > "$OUT/summary.log" 2>&1
for f in p1_inprocess p2_ray1 p3_vllm p3_remote summary; do
  echo "=== $f"; grep -E "^\[ *[0-9.]+s\]|^remote:|Error|error" "$OUT/$f.log" | cut -c1-500 | tail -n 14
done
