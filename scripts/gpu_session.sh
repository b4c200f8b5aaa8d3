#!/usr/bin/env bash
# One device call per phase (DEVELOPERS.md): each writes its figures under $OUT before it returns.
#   export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_session.sh PHASE
# A: GPU tests + te_vs_emulated (mapping, operands, 300-step curves; about 3 minutes after the TE build)
# B: te_vs_emulated's 300-step curves alone
# C: 1.4B anchor comparison + FusedAdam/memory-knob variants   D: 300-step markov loss of the memory knobs
# E: 8B-like slice anchor comparison + 4 micro-batches a step (weights quantized once)
# G: FusedAdam with FP8 states, batched (un)scaling: bit-identity test, step time, 300-step markov loss
# H: LayerNorm in TE's kernel order: probe of the FMA sites, GPU test, te_vs_emulated operands + curves
# I: why the curves part: step-0 gradients emulated vs TE vs TE BF16, TE's own sensitivity to 1-ulp weight
#    moves, and the emulated/te pairs from a second seed (is emulated - te of one sign?)
# J: step-0 gradients and the 300-step curves again after the emulated wgrad kept fp32 (fp32 main grads)
# K: J + the sensitivity part judged by the same BF16 band (TE vs TE-bumped): everything behind the #3 note
# F: the LM head + loss in chunks (model.lm_head_loss_chunks) toward 1.4B tensorwise <= 225 ms and <= 34 GiB
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - t0) )); }
# anchors.md's FusedAdam setup: fp32 master weights with bf16 grads (C, G)
G="optimizer.use_precision_aware_optimizer=true optimizer.main_grads_dtype=bf16"
# the 300-step markov runs on the 1.4B: D's BF16 seeds are the band G is compared with
M="experiment=h200_1b data=markov data.vocab_size=256 steps=300 eval_interval=25 eval_tokens=32768"
M="$M log_interval=25 optimizer.lr=3e-4 optimizer.min_lr=3e-5 optimizer.warmup_steps=30"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/gpu_$1.txt" 2>&1
case "$1" in
A)
  timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py tests/numerics/test_cuda.py -p no:cacheprovider \
    2>&1 | tail -40 > "$OUT/pytest_gpu.txt"
  OUT=$OUT timeout "$(left 420)" python3 scripts/te_vs_emulated.py --steps 300 --bf16-seeds 4 log_interval=25 \
    2>&1 | tail -60 > "$OUT/tve.log" ;;
B)
  OUT=$OUT timeout 540 python3 scripts/te_vs_emulated.py --parts curves --steps 300 --bf16-seeds 4 log_interval=25 \
    2>&1 | tail -60 > "$OUT/tve_curves.log" ;;
C)
  timeout 300 python3 -m harness.bench experiment=h200_1b optimizer=bf16_params steps=24 \
    --anchor .gpu/anchor_gpt.py --out /tmp/b/c1 2>&1 | tail -25
  # anchors.md's FusedAdam table (its peaks fit no fp32 main-grad buffer): with $G
  R="bf16_fp32s:recipe=bf16 $G;tw_fp32s:recipe=tensorwise $G;tw_fp8states:recipe=tensorwise optimizer=fp8_states $G"
  R="$R;tw_fp8w:recipe=tensorwise optimizer.fp8_param=true $G;dl_fp8w:recipe=delayed optimizer.fp8_param=true $G"
  R="$R;tw_bf16s_bf16g:recipe=tensorwise optimizer=bf16_states $G"
  R="$R;bf16_fp32all:recipe=bf16;tw_fp8states_fp32g:recipe=tensorwise optimizer=fp8_states"
  timeout "$(left 560)" python3 -m harness.bench experiment=h200_1b steps=24 --no-bare --runs "$R" \
    --out /tmp/b/c2 2>&1 | tail -25 ;;
D)
  for spec in "bf16_s0:recipe=bf16 seed=0" "bf16_s1:recipe=bf16 seed=1" \
      "tw_bf16s_bf16g:recipe=tensorwise optimizer=bf16_states optimizer.main_grads_dtype=bf16"; do
    name=${spec%%:*}; ov=${spec#*:}
    [ "$(left 575)" -gt 100 ] || { echo "skip $name: time"; continue; }
    timeout "$(left 580)" python3 -m harness.train $M $ov hydra.run.dir=/tmp/runs/d/$name 2>&1 | tail -3
  done
  python3 scripts/collect_runs.py /tmp/runs/d "$OUT/markov_300_1b_knobs.json" ;;
E)
  timeout 330 python3 -m harness.bench experiment=h200_8b_slice optimizer=bf16_params steps=24 \
    --anchor .gpu/anchor_gpt.py --out /tmp/b/e1 2>&1 | tail -25
  # 4 micro-batches a step: TE quantizes the weights once per step (is_first_microbatch)
  timeout "$(left 450)" python3 -m harness.bench experiment=h200_8b_slice optimizer=bf16_params steps=12 \
    global_batch_size=8 --recipes bf16,tensorwise --no-bare --out /tmp/b/e3 2>&1 | tail -4 ;;
F)
  R="tw:recipe=tensorwise;tw_ce8:recipe=tensorwise model.lm_head_loss_chunks=8"
  R="$R;tw_ce16:recipe=tensorwise model.lm_head_loss_chunks=16;bf16_ce8:recipe=bf16 model.lm_head_loss_chunks=8"
  timeout 400 python3 -m harness.bench experiment=h200_1b optimizer=bf16_params steps=24 --no-bare --runs "$R" \
    --out /tmp/b/f1 2>&1 | tail -8
  R="knob:recipe=tensorwise optimizer=bf16_states optimizer.main_grads_dtype=bf16"
  R="$R;knob_ce8:recipe=tensorwise optimizer=bf16_states optimizer.main_grads_dtype=bf16 model.lm_head_loss_chunks=8"
  timeout "$(left 570)" python3 -m harness.bench experiment=h200_1b steps=24 --no-bare --runs "$R" \
    --out /tmp/b/f2 2>&1 | tail -5 ;;
G)
  timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k "batched_fp8 or precision_aware" -p no:cacheprovider \
    2>&1 | tail -15 > "$OUT/pytest_g.txt"
  R="tw_fp32s:recipe=tensorwise $G;tw_fp8states:recipe=tensorwise optimizer=fp8_states $G"
  R="$R;tw_fp8states_fp32g:recipe=tensorwise optimizer=fp8_states"
  timeout "$(left 300)" python3 -m harness.bench experiment=h200_1b steps=24 --no-bare --runs "$R" \
    --out /tmp/b/g1 2>&1 | tail -6
  timeout "$(left 560)" python3 -m harness.train $M recipe=tensorwise optimizer=fp8_states $G \
    hydra.run.dir=/tmp/runs/g/tw_fp8states_bf16g 2>&1 | tail -3
  python3 scripts/collect_runs.py /tmp/runs/g "$OUT/markov_300_1b_fp8states.json" ;;
H)
  timeout 60 python3 scripts/te_layernorm_probe.py > "$OUT/ln_probe.log" 2>&1
  line=$(grep '^LOWP_TE_LN_FMA=' "$OUT/ln_probe.log" | tail -1); [ -n "$line" ] && export "$line"
  echo "probe: ${line:-none}"; tail -3 "$OUT/ln_probe.log"
  timeout 40 python3 -m pytest -q -m gpu tests/test_gpu.py -k "te_order_layernorm" -p no:cacheprovider 2>&1 | tail -4
  OUT=$OUT timeout "$(left 280)" python3 scripts/te_vs_emulated.py --parts operands,curves --steps 300 \
    --bf16-seeds 4 log_interval=25 2>&1 | tail -60 > "$OUT/tve.log" ;;
I)
  OUT=$OUT timeout "$(left 570)" python3 scripts/te_vs_emulated.py --parts grads,curves,sensitivity --steps 300 \
    --bf16-seeds 0 --pair-seeds 1 log_interval=25 2>&1 | tail -60 > "$OUT/tve_I.log" ;;
J)
  OUT=$OUT timeout "$(left 570)" python3 scripts/te_vs_emulated.py --parts grads,curves --steps 300 \
    --bf16-seeds 4 log_interval=25 2>&1 | tail -60 > "$OUT/tve_J.log" ;;
K)
  OUT=$OUT timeout "$(left 570)" python3 scripts/te_vs_emulated.py --parts grads,curves,sensitivity --steps 300 \
    --bf16-seeds 4 log_interval=25 2>&1 | tail -70 > "$OUT/tve_K.log" ;;
esac
# this phase's benches only (at most 8 files come back)
for d in /tmp/b/"${1,,}"*/; do [ -f "$d/bench.json" ] && cp "$d/bench.json" "$OUT/bench_$(basename "$d").json"; done 2>/dev/null
echo "phase $1 done in $(( $(date +%s) - t0 )) s"
