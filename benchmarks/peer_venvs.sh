#!/bin/sh
# The peers of benchmarks/peers.py, each in its own virtual environment (their pins differ), torch held at the
# CPU build this project pins so that no peer pulls the CUDA one:
#     sh benchmarks/peer_venvs.sh /work/peer-venvs
set -eu
dir=${1:-/work/peer-venvs}
mkdir -p "$dir"
echo "torch==2.13.0" > "$dir/constraints.txt"
c="$dir/constraints.txt"

# DLRover: dlrover-run needs the k8s extra (grpc master) and, not declared, protobuf and numpy.
python3 -m venv "$dir/dlrover"
"$dir/dlrover/bin/pip" install -q -c "$c" torch==2.13.0 'dlrover[k8s,torch]==0.6.1' numpy protobuf

# lm-resiliency: numpy and torch only; its own venv all the same, since its torchrun rendezvous plugin
# (entry point torchrun.handlers) is loaded by every torchrun of the environment it is installed in.
python3 -m venv "$dir/lmres"
"$dir/lmres/bin/pip" install -q -c "$c" torch==2.13.0 lm-resiliency==0.2.0

# nvidia-resiliency-ext 0.7.0 publishes only cp312 manylinux_2_39 wheels and no sdist: pip finds nothing for
# Python 3.11 / glibc 2.36. Its local checkpointing is pure Python (the one compiled module is the CUPTI
# straggler detector), so its files are unpacked beside a 3.11 venv holding its declared dependencies.
python3 -m venv "$dir/nvrx"
"$dir/nvrx/bin/pip" install -q -c "$c" torch==2.13.0 defusedxml 'fastapi>=0.100.0' 'grpcio>=1.76.0,<2' \
    'grpcio-tools>=1.76.0,<2' 'httpx>=0.24' 'numpy>=1.26' 'nvidia-ml-py>=12.570.86' packaging 'protobuf>=4.22' \
    'psutil>=6' 'pydantic>=2' 'pydantic-settings>=2' pyyaml 'slowapi>=0.1.9' 'uvicorn[standard]>=0.20'
"$dir/nvrx/bin/pip" install -q --no-deps --platform manylinux_2_39_x86_64 --python-version 3.12 \
    --only-binary=:all: --target "$dir/nvrx-pkg" nvidia-resiliency-ext==0.7.0
echo "$dir/nvrx-pkg" > "$(echo "$dir"/nvrx/lib/python3*/site-packages)/nvrx-pkg.pth"
