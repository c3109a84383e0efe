#!/usr/bin/env bash
# One lent GPU session's run (issue 31), in priority order, each part bounded so that a slow part cannot eat the
# next: the CUDA tests first (they check what the benchmarks then time), then blocking, copy throughput, step
# overhead, and the megatron-core tests last. Run from the repository root on the device machine, with the
# wheels of the packages its image lacks in .whl/ (pyzmq, megatron-core: see benchmarks/README.md):
#     bash benchmarks/cuda_session.sh                   # every part; results and logs in $OUT (default ./cuda-out)
#     bash benchmarks/cuda_session.sh fsdp blocking-12gb  # only the parts named (a rerun with the time left)
set -uo pipefail
OUT=${OUT:-$PWD/cuda-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
start=$(date +%s)
DEADLINE=${DEADLINE:-520}   # seconds for the whole run: the device tool's call limit less the start and the transfers
WANTED=" $* "
part() {   # part NAME SECONDS COMMAND...: run one part under its own limit, say how long it took and how it ended
    local name=$1 limit=$2
    shift 2
    if [[ "$WANTED" != "  " && "$WANTED" != *" $name "* ]]; then return; fi
    local t0 left
    t0=$(date +%s)
    left=$(( DEADLINE - (t0 - start) ))
    if (( left < 30 )); then echo "=== $name: not run, ${left}s left of ${DEADLINE}s"; return; fi
    (( limit > left )) && limit=$left
    echo "=== $name (limit ${limit}s, at +$((t0 - start))s)"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/session.log" | tail -n 40
    echo "=== $name: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 ))s"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
    echo "cpus $(nproc); $(free -g | awk '/Mem/ {print "ram", $2, "GiB"}'); shm $(df -h /dev/shm | awk 'NR==2 {print $2}')"
    echo "thp shmem: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null); memlock: $(ulimit -l)"
} 2>&1 | tee "$OUT/machine.txt"
part tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_stager.py -x
part fsdp 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fsdp.py
part blocking 200 python3 benchmarks/blocking.py --device cuda --sizes-mb 1000 12000 --repeats 2 \
    --peers torch_save dcp_async --dir "$PWD" --out "$OUT/blocking-cuda.json"
part blocking-12gb 90 python3 benchmarks/blocking.py --device cuda --sizes-mb 12000 --repeats 2 --peers \
    --out "$OUT/blocking-cuda-12gb.json"
part copy-1-stream 60 python3 benchmarks/throughput.py --device cuda --sizes-mb 10000 --paths copy \
    --copy-repeats 5 --cuda-copy-streams 1 --out "$OUT/copy-cuda-1stream.json"
part copy-2-streams 60 python3 benchmarks/throughput.py --device cuda --sizes-mb 10000 --paths copy \
    --copy-repeats 5 --cuda-copy-streams 2 --out "$OUT/copy-cuda-2streams.json"
part throughput 200 python3 benchmarks/throughput.py --device cuda --sizes-mb 1000 10000 --paths copy memory \
    --copy-repeats 5 --repeats 2 --out "$OUT/throughput-cuda.json"
# The largest state the host holds beside two slots of it and the raw pinned buffers: 3 x 24 GB of 128 GiB.
EASYCKPT_SLOTS=2 part copy-largest 150 python3 benchmarks/throughput.py --device cuda --sizes-mb 24000 --paths copy \
    --copy-repeats 3 --out "$OUT/copy-cuda-largest.json"
part overhead 70 python3 benchmarks/overhead.py --device cuda --d-model 1024 --layers 8 --batch-size 32 --seq-len 512 \
    --steps 20 --rounds 2 --out "$OUT/overhead-cuda.json"
part megatron 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_megatron.py
echo "=== done at +$(( $(date +%s) - start ))s"
