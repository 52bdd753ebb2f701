#!/usr/bin/env bash
# The training-step benchmark of docs/benchmarks.md on one GPU: our DeepSpeed step (LAMB, then AdamW; ZeRO-0 with bf16
# by autocast, eager and with train.compile, then ZeRO-1 with DeepSpeed's bf16) against OpenCLIP's own step, eager and
# with --torchcompile, at a batch a GPU is meant for, with both sides' model TFLOP/s, MFU, the step after the backward
# and a profiler trace of each contestant (one FLOP count, the training log's: docs/benchmarks.md, Throughput and
# MFU); then (BENCH_ACCUM=0 skips it) the cost of the contrastive
# batch: the global batch ACCUM_BATCH in 4 micro-batches, micro and global (cached) accumulation against one
# micro-batch and OpenCLIP's own --accum-freq 4 step; then (BENCH_DATA=0 skips it) benchmarks.data_loader with
# --device cuda: both loaders feeding the GPU, and ours with the JPEGs decoded there (data.image_decode=gpu); then
# (BENCH_TUNE=0 skips it) tune on ViT-B-16: its estimates against torch.cuda.max_memory_allocated, the LAION
# preset tuned for this GPU on toy shards, 200 steps of the tuned config, and its speed against the preset's layout.
# Run from the repository root (the benchmarks are python -m benchmarks.NAME there):
#   bash launchers/bench_gpu.sh                 # MODEL=ViT-B-16 BATCH=128 STEPS=20 by default
# On a machine without DeepSpeed / open_clip / webdataset but with a .whl/ folder of their wheels (this project's
# lent GPU machines: see the device README in shared/), they are installed under ~/site first.
# Results: one JSON per optimizer under $OUT if set, else runs/bench; the tables are printed last.
set -euo pipefail
out=${OUT:-runs/bench}
mkdir -p "$out"
if ! python3 -c "import deepspeed, open_clip, webdataset" 2>/dev/null; then
  [ -d .whl ] || { echo "bench_gpu.sh: DeepSpeed, open_clip or webdataset missing and no .whl/ folder" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME/site" .whl/*.whl
  export PYTHONPATH=$PWD:$HOME/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "bench_gpu.sh: no nvidia-smi, no GPU to report"
# our default layout (ZeRO-0, bf16 by autocast) with LAMB and AdamW, eager and compiled (BENCH_COMPILE=0: eager
# only), against OpenCLIP eager and with --torchcompile; then ZeRO-1 with DeepSpeed's bf16 (BENCH_ZERO1=0 skips it)
speed() {  # NAME JSON [options]: one benchmarks.speed run, its table printed
  local name=$1 json=$2; shift 2
  python3 -m benchmarks.speed --model "${MODEL:-ViT-B-16}" --batch-size "${BATCH:-128}" --steps "${STEPS:-20}" \
    --warmup 5 --deepspeed-config "$json" --precision bf16 --trace-dir "$out/traces_$name" "$@" \
    --output "$out/speed_${name}_gpu.json" > "$out/speed_${name}_gpu.log" 2>&1 || { tail -40 "$out/speed_${name}_gpu.log"; exit 1; }
  echo "== $json $*"; sed -n '/^contestant/,$p' "$out/speed_${name}_gpu.log"
}
compile=(); [ "${BENCH_COMPILE:-1}" = 1 ] && compile=(--compile)
for optim in lamb adamw; do speed "$optim" "ds_configs/zero0_${optim}.json" "${compile[@]}"; done
if [ "${BENCH_ZERO1:-1}" = 1 ]; then
  for optim in lamb adamw; do speed "zero1_${optim}" "ds_configs/zero1_bf16_${optim}.json"; done
fi
if [ "${BENCH_ACCUM:-1}" = 1 ]; then
  python3 -m benchmarks.accumulation --accumulate 4 --model "${MODEL:-ViT-B-16}" --batch-size "${ACCUM_BATCH:-512}" \
    --steps "${ACCUM_STEPS:-10}" --warmup 2 --output "$out/accumulation_gpu.json" > "$out/accumulation_gpu.log" 2>&1 \
    || { tail -40 "$out/accumulation_gpu.log"; exit 1; }
  echo "== benchmarks.accumulation --accumulate 4"; tail -16 "$out/accumulation_gpu.log"
fi
if [ "${BENCH_DATA:-1}" = 1 ]; then
  # writes its photo shards first (data/bench_loader); needs scikit-learn (the photos) and open_clip_train
  if python3 -c "import sklearn, open_clip_train" 2>/dev/null; then
    python3 -m benchmarks.data_loader --device cuda --shards 8 --workers 2 8 --repeats 1 \
      --output "$out/data_gpu" > "$out/data_gpu.log" 2>&1 || { tail -40 "$out/data_gpu.log"; exit 1; }
    echo "== benchmarks.data_loader --device cuda"; grep -v " INFO " "$out/data_gpu.log" | tail -22
  else
    echo "bench_gpu.sh: benchmarks.data_loader skipped: scikit-learn or open_clip_train is not installed"
  fi
fi
if [ "${BENCH_TUNE:-1}" = 1 ]; then
  python3 -m benchmarks.tune_estimate --models ViT-B-16 --micro 64 128 --stages 0 \
    --output "$out/tune_estimate_gpu.json" > "$out/tune_estimate_gpu.log" 2>&1 || { tail -40 "$out/tune_estimate_gpu.log"; exit 1; }
  echo "== benchmarks.tune_estimate (ViT-B-16)"; grep "^|\|worst" "$out/tune_estimate_gpu.log" | tail -8
  [ -d data/toy_gpu ] || python3 -m eva_fastclip toy-data --output data/toy_gpu --num-train 8192 > /dev/null
  laion=(--config configs/laion_vitb16_fastclip_v3.json --set 'data.train_shards=["data/toy_gpu/train"]'
         --set data.num_samples=null --set data.index_size=null --set train.global_batch=1024
         --set train.output_dir="$out/tune_train_gpu" --set eval.imagenet_val=null)
  python3 -m eva_fastclip tune "${laion[@]}" --output "$out/tuned_gpu.json" > "$out/tune_gpu.log" 2>&1 \
    || { tail -40 "$out/tune_gpu.log"; exit 1; }
  echo "== tune (LAION ViT-B-16 recipe, global batch 1024, toy shards)"; grep -v " INFO " "$out/tune_gpu.log" | tail -24
  python3 -m eva_fastclip train --config "$out/tuned_gpu.json" --set train.steps=200 --set train.save_every_steps=0 \
    > "$out/tuned_train_gpu.log" 2>&1 || { tail -40 "$out/tuned_train_gpu.log"; exit 1; }
  echo "== 200 steps of the tuned config"; tail -3 "$out/tuned_train_gpu.log"
  python3 -m benchmarks.tune_layouts --layout preset=configs/laion_vitb16_fastclip_v3.json \
    --layout tuned="$out/tuned_gpu.json" --set 'data.train_shards=["data/toy_gpu/train"]' --set data.num_samples=null \
    --set data.index_size=null --set train.global_batch=1024 --set eval.imagenet_val=null \
    --output "$out/tune_layouts_gpu.json" > "$out/tune_layouts_gpu.log" 2>&1 || { tail -40 "$out/tune_layouts_gpu.log"; exit 1; }
  echo "== benchmarks.tune_layouts (preset against tuned)"; grep "^|" "$out/tune_layouts_gpu.log"
fi
