#!/usr/bin/env bash
# A GPU cluster driven from outside it: `ray start --head` on this machine (GCS 6379, Ray Client
# 10001, 2 GPUs), then `python -m workbench train` (tiny model, cuda, bf16, 2 steps) and notebook
# 02 (papermill) through Ray Client at ray://127.0.0.1:10001. Leaves the head running: the caller
# runs `ray stop`, which stops EVERY Ray instance on the machine (benchmarks/gpu_runs/ray_x2.sh
# does it once its other Ray sections are done).
#   bash benchmarks/gpu_runs/remote_x2.sh OUT_DIR       (PYTHONPATH must reach workbench and ray;
#                                                        NGPU=1 on a one-GPU machine)
set -u
OUT=${1:?usage: remote_x2.sh OUT_DIR}
NGPU=${NGPU:-2}  # GPUs of the head; the train run takes a worker and an engine a GPU
ADDRESS=ray://127.0.0.1:10001
RUN=/tmp/remote_run_$(date +%s)  # a fresh run folder each time
now() { date +%s.%N; }
took() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

t=$(now)
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python3 -m ray.scripts.scripts start --head \
  --node-ip-address=127.0.0.1 --port=6379 --ray-client-server-port=10001 --num-gpus=$NGPU \
  --num-cpus=8 --include-dashboard=false --temp-dir=/tmp/ray_remote --disable-usage-stats \
  > /tmp/ray_remote_start.log 2>&1 || { cat /tmp/ray_remote_start.log; echo "remote: ray start FAILED"; exit 1; }
echo "remote: ray start --head up in $(took "$t") s"

t=$(now)
python3 -m workbench train model.name=tiny model.device=cuda model.dtype=bfloat16 \
  cluster.address=$ADDRESS trainer.num_workers=$NGPU generator.num_engines=$NGPU \
  trainer.total_steps=2 env.size=7 trainer.train_batch_size=2 generator.n_samples_per_prompt=2 \
  generator.max_turns=4 eval.n_mazes=2 eval.sampled_passes=0 trainer.eval_interval=0 \
  trainer.ckpt_interval=0 trainer.hf_save_interval=0 trainer.resume_mode=none \
  run_dir=$RUN 2>&1 | tail -n 15
echo "remote: workbench train through $ADDRESS exit ${PIPESTATUS[0]} in $(took "$t") s; rows: $(grep -c reward $RUN/metrics.jsonl 2>/dev/null)"

t=$(now)
python3 -m ipykernel install --user --name python3 > /dev/null 2>&1
RAY_ADDRESS=$ADDRESS python3 -m papermill notebooks/02_rollouts.ipynb "$OUT/02_rollouts_remote.ipynb" \
  -k python3 --cwd . -p RAY_ADDRESS $ADDRESS -p BASE_MODEL tiny -p MAZES 1 \
  -p SAMPLES_PER_MAZE 4 -p MAX_TURNS 3 -p OUT_DIR /tmp/nb02_remote --log-output 2>&1 | tail -n 12
echo "remote: papermill notebook 02 with RAY_ADDRESS=$ADDRESS exit ${PIPESTATUS[0]} in $(took "$t") s; metrics: $(cat /tmp/nb02_remote/metrics.json 2>/dev/null | head -c 300)"
