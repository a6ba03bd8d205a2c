#!/usr/bin/env bash
# The CUDA path on one GPU: kernel tests, DCViT vs ViT (SDPA) benchmarks per attention core,
# smoke training runs and the training loop's overhead; a pass/fail table and gpu_check.json.
#
#   bash scripts/gpu_check.sh                 # about 8 minutes on an H100/H200 (see below)
#   bash scripts/gpu_check.sh --full          # every model x core x eager/compile figure
#   bash scripts/gpu_check.sh --dry-run       # the same plumbing on CPU, tiny sizes (minutes)
#   bash scripts/gpu_check.sh --out DIR       # where logs and JSON go (default gpu_check/)
#
# Nothing is downloaded: the training data are synthetic images written to DIR. Each step
# runs under its own time limit and is reported as pass, fail or timeout; the figures (and
# the targets they are read against) are in DIR/gpu_check.json. Run it from a checkout with
# the project's environment active (PYTHON=... to choose the interpreter).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
OUT=gpu_check
FULL=0
DRY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --full) FULL=1 ;;
        --dry-run) DRY=1 ;;
        --out) OUT=$2; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (use --full, --dry-run, --out DIR)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STEPS="$OUT/steps.tsv"
: > "$STEPS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" = 1 ]; then
    DEVICE=cpu
    BENCH=(--device cpu --model dcvit_tiny_patch16_224 --img-size 32 --depth 1 --batch-size 2
           --mem-batch-size 2 --steps 1 --warmup 0 --dtypes bf16)
    BENCH_B=("${BENCH[@]}")
    TESTS=(-k "launch_count or dcmha_layer")
    TRAIN_SET=(model=dcvit_tiny_patch16_224 "model_kwargs={img_size: 32, depth: 1}"
               data.img_size=32 batch_size=8 data.num_workers=1 threads=1)
    IMAGES=(16 2)          # images per class (train), classes
    LOOP=(--device cpu --model dcvit_tiny_patch16_224 --img-size 32 --depth 1 --batch-size 2
          --amp bf16 --steps 2 --repeats 1)
    CORES_EAGER="compile"
    CORES_COMPILED="compile"
else
    DEVICE=cuda
    BENCH=(--device cuda --model dcvit_small_patch16_224 --batch-size 256 --mem-batch-size 256
           --steps 7 --warmup 2 --dtypes bf16)
    BENCH_B=(--device cuda --model dcvit_base_patch16_224 --batch-size 256 --mem-batch-size 256
             --steps 5 --warmup 2 --dtypes bf16)
    TESTS=(-m "" -k "any_head_count or half_precision or dcmha_layer or launch_count or self_check or vit_small or long_sequences")
    [ "$FULL" = 1 ] && TESTS=(-m "")
    TRAIN_SET=(batch_size=64 data.num_workers=8)
    IMAGES=(320 10)        # 3,200 images: 50 updates of 64 per epoch, 4 epochs = 200 updates
    LOOP=(--device cuda --model dcvit_small_patch16_224 --batch-size 256 --amp bf16 --steps 30
          --repeats 3)
    CORES_EAGER="triton compile"
    CORES_COMPILED="triton compile"
fi

# step NAME SECONDS COMMAND...: run COMMAND under a time limit, log to OUT/NAME.log, record
# pass/fail/timeout and the wall time in steps.tsv.
step() {
    local name=$1 limit=$2 status start rc
    shift 2
    printf '%-34s ' "$name"
    start=$(date +%s)
    timeout --kill-after=30 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then status=pass; elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=timeout; else status=fail; fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - start ))" "$limit" "$name.log" >> "$STEPS"
    printf '%-8s %4ss\n' "$status" "$(( $(date +%s) - start ))"
}

echo "gpu_check: logs and JSON in $OUT"
step environment 60 "$PY" -c "
import json, torch, triton, timm, dcvit
from dcvit.fused import select_impl
x = torch.zeros(1, 6, 4, 64, device='$DEVICE')
info = {'torch': torch.__version__, 'triton': triton.__version__, 'timm': timm.__version__,
        'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
        'auto_core': select_impl('auto', x)[0]}
print(json.dumps(info))
json.dump(info, open('$OUT/environment.json', 'w'))
"

# 1. The kernels compiled for this GPU, against the formula (the same file runs in the
#    interpreter on CPU machines): every head count, bf16/fp16, a whole layer, the launch
#    counts, ViT-S's real shape and 1030 queries or keys (--full: the whole file, every option). One
#    block size (no autotuning): each variant compiles once.
step tests 360 env DCVIT_TRITON_AUTOTUNE=0 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_core.py "${TESTS[@]}"

# 1b. The Triton kernels and SDPA timed at DCViT-S/16's and B/16's layer shapes (batch 256,
#     bf16), next to the roofline estimates of docs/performance.md (the dry run: estimates only).
if [ "$DRY" = 1 ]; then
    step kernel_times 300 "$PY" scripts/kernel_report.py --estimate --json "$OUT/kernel_times.json"
else
    step kernel_times 300 "$PY" scripts/kernel_report.py --estimate --measure --json "$OUT/kernel_times.json"
fi

# 2. DCViT-S/16 vs ViT-S/16 (SDPA) at batch 256, bf16, with each attention core forced.
for core in $CORES_EAGER; do
    step "bench_S_eager_$core" 240 "$PY" -m dcvit.benchmark "${BENCH[@]}" --impl "$core" --no-compile \
        --json "$OUT/bench_S_eager_$core.json"
done
for core in $CORES_COMPILED; do
    step "bench_S_compile_$core" 420 "$PY" -m dcvit.benchmark "${BENCH[@]}" --impl "$core" \
        --memory-backends compile --json "$OUT/bench_S_compile_$core.json" --compile-only
done

# 3. DCViT-B/16 vs ViT-B/16: the fused core (every core with --full).
B_EAGER="triton"; B_COMPILED="triton"
[ "$DRY" = 1 ] && B_EAGER="compile" && B_COMPILED="compile"
[ "$FULL" = 1 ] && B_EAGER=$CORES_EAGER && B_COMPILED=$CORES_COMPILED
for core in $B_EAGER; do
    step "bench_B_eager_$core" 240 "$PY" -m dcvit.benchmark "${BENCH_B[@]}" --impl "$core" --no-compile \
        --json "$OUT/bench_B_eager_$core.json"
done
if [ "$FULL" = 1 ] || [ "$DRY" = 1 ]; then
    for core in $B_COMPILED; do
        step "bench_B_compile_$core" 420 "$PY" -m dcvit.benchmark "${BENCH_B[@]}" --impl "$core" \
            --memory-backends compile --json "$OUT/bench_B_compile_$core.json" --compile-only
    done
fi

# 4. 200 bf16 updates of train_imagenet on synthetic shards (NCCL, one process), then compiled.
DATA="$OUT/synthetic"
step synthetic_shards 300 bash -c "
set -e
rm -rf '$DATA'
'$PY' - '$DATA/folder' ${IMAGES[0]} ${IMAGES[1]} <<'EOF'
import sys, numpy as np
from pathlib import Path
from PIL import Image
root, per_class, classes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
for split, n in (('train', per_class), ('val', max(2, per_class // 10))):
    for c in range(classes):
        d = root / split / f'class{c:02d}'
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(img).save(d / f'{i:05d}.jpg', quality=90)
EOF
'$PY' scripts/make_wds_shards.py --src '$DATA/folder/train' --out '$DATA/shards' --split train --shard-size 400 --no-progress
'$PY' scripts/make_wds_shards.py --src '$DATA/folder/val' --out '$DATA/shards' --split val --shard-size 400 --classes '$DATA/shards/classes.json' --no-progress
"
TRAIN=(-m torch.distributed.run --standalone --nproc_per_node=1 -m train_imagenet
       --config configs/deit300_dcvit_small.yaml "data.train=$DATA/shards" "data.val=$DATA/shards"
       "data.num_classes=${IMAGES[1]}" epochs=4 amp=bf16 sched.warmup_epochs=1 ema.enabled=false
       save_every_steps=0 "${TRAIN_SET[@]}")
rm -rf "$OUT/run_eager" "$OUT/run_compile"
step train_smoke_eager 300 "$PY" "${TRAIN[@]}" "output_dir=$OUT/run_eager"
step train_smoke_compile 420 "$PY" "${TRAIN[@]}" compile=true "output_dir=$OUT/run_compile"

# 5. What the training loop costs over a bare loop (same model, optimizer, in-memory batches).
step loop_overhead 300 "$PY" scripts/loop_overhead.py "${LOOP[@]}" --json "$OUT/loop_overhead.json"

"$PY" scripts/gpu_check_report.py "$OUT"
