#!/usr/bin/env bash
# The GPU figures issue 37 asks for, in one run on a lent GPU machine (../shared/gpu/README.md):
# the step's cost (bare forward, graph replay, the runner's step: transformers' own cache, the
# packed paged pass, and its fixed shapes replayed from CUDA graphs), then
# `spececd bench` at RTT 0 and 20 ms and `spececd bench load` from 1 to 64 clients, on the
# default target and on a cost-scaled stand-in for an 8B target. Each part runs under its
# own timeout and logs into $OUT as it goes, so a part that hangs still says where.
#
# Here, once, before the run (about 45 MB travel):
#   bash scripts/gpu-bench.sh prepare
# On the GPU machine (the device tool runs this from the repository root, .gpu carried):
#   bash scripts/gpu-bench.sh run [SECONDS]   # SECONDS: the whole run's budget (default 540)
# DEVICE=cpu BIG="10 4096" runs the same parts on a CPU, smaller: a check of the script.
set -uo pipefail
DEVICE=${DEVICE:-cuda}
BIG=${BIG:-32 163840}  # the stand-in's layers and MLP width: an 8B model's memory traffic
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}

prepare() {
    grep -qx '/.gpu/' .git/info/exclude || echo /.gpu/ >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/whl
    python3 "$SHARED/gpu/pack_target.py" models/target .gpu/target
    cp -r src models/draft models/heldout_prompts.json "$SHARED/gpu/scale_target.py" .gpu/
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl websockets fastapi starlette pydantic pydantic-core annotated-types \
        typing-inspection uvicorn opentelemetry-api typing-extensions annotated-doc
    du -sh .gpu
}

run() {
    local budget=${1:-540} start=$SECONDS out=${OUT:-/tmp/gpu-out}
    mkdir -p "$out"
    exec > >(tee -a "$out/run.log") 2>&1
    export PYTHONUNBUFFERED=1
    if [ "$DEVICE" != cpu ]; then  # the GPU machine's Python lacks these (its README)
        export PYTHONPATH=/tmp/site:$PWD/.gpu/src
        pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
    fi
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt" ||
        echo "no nvidia-smi: running on $DEVICE"
    # The packed default target unpacked at its own size (8 layers x 1408), and the 8B-cost
    # stand-in (same logits): scale_target.py reads the packed folder.
    timeout 60 python3 .gpu/scale_target.py .gpu/target /tmp/target 8 1408
    # shellcheck disable=SC2086  # BIG is two words
    timeout 120 python3 .gpu/scale_target.py .gpu/target /tmp/target-8b $BIG ||
        echo "scale_target failed: the 8B-cost parts are skipped"
    left() { echo $(( budget - (SECONDS - start) )); }
    part() {  # part NAME LIMIT COMMAND...: COMMAND under min(LIMIT, what is left)
        local name=$1 limit=$2; shift 2
        local t=$(( $(left) < limit ? $(left) : limit ))
        if (( t < 20 )); then echo "== $name: skipped, ${t}s left"; return; fi
        echo "== $name (at most ${t}s): $*"
        timeout "$t" "$@" > "$out/$name.log" 2>&1
        echo "== $name: exit $? after $(( SECONDS - start ))s"; tail -5 "$out/$name.log"
    }
    for target in /tmp/target /tmp/target-8b; do
        [ -d "$target" ] || continue
        tag=$(basename "$target")
        part "steps-$tag" 90 python3 scripts/step-cost.py "$target" --device "$DEVICE" \
            --dtype auto --reps 50
    done
    part bench-target 150 python3 -m spececd bench --device "$DEVICE" --target-model /tmp/target \
        --draft-model .gpu/draft --num-prompts 6 --max-tokens 64 --iterations 1 \
        --rtt-ms 0,20 --k auto --proactive off,stream --stall-timeout 120 \
        --out "$out/bench-target"
    part bench-target-8b 180 python3 -m spececd bench --device "$DEVICE" \
        --target-model /tmp/target-8b --draft-model .gpu/draft --num-prompts 4 \
        --max-tokens 64 --iterations 1 --rtt-ms 0,20 --k auto --proactive off,stream \
        --no-baselines --stall-timeout 150 --out "$out/bench-target-8b"
    part load-8b 150 python3 -m spececd bench load --device "$DEVICE" \
        --target-model /tmp/target-8b --draft-model .gpu/draft --clients 1,4,16,64 \
        --kind cloud-only,replay,draft --acceptance 0.6,0.8 --max-tokens 48 \
        --stall-timeout 120 \
        --out "$out/load-8b"
    # Fixed shapes (graphs) off: the packed, paged pass eagerly, on the same GPU.
    part bench-target-eager 90 env SPECECD_SERVER_STATIC=off python3 -m spececd bench \
        --device "$DEVICE" --target-model /tmp/target --draft-model .gpu/draft --num-prompts 6 \
        --max-tokens 64 --iterations 1 --rtt-ms 0 --k auto --proactive stream \
        --no-baselines --stall-timeout 60 --out "$out/bench-target-eager"
    echo "done in $(( SECONDS - start ))s; files under $out"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run "${2:-540}" ;;
    *) echo "usage: $0 prepare | run [SECONDS]" >&2; exit 2 ;;
esac
