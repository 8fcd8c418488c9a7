#!/usr/bin/env bash
# The GPU checks as one prepared run for a CUDA machine (the device tool lends
# one to some sessions): builds the C engine in place with that machine's
# python3 (which has CUDA torch), runs the CUDA tests, the async/checkpointer
# suites on a GPU-enabled torch, and benchmarks/gpu_check.py. Logs go to
# ${OUT:-.bench/gpu} so they come back.
#
#   run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=420)
#
# .whl holds wheels the machine lacks or has too old: crc32c (the reference
# engine), protobuf 7.36, grpcio 1.85 and grpcio-health-checking (the daemon),
# zstandard (compression=).
set -uo pipefail
out=${OUT:-.bench/gpu}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi -L
    python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
    python3 setup.py -q build_ext --inplace 2>&1 | tail -3
} 2>&1 | tee "$out/env.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_device_load.py tests/test_cuda_files.py tests/test_load_into.py tests/test_daemon_windowed.py -v \
    2>&1 | tee "$out/test_cuda.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_async.py tests/test_checkpointer.py \
    tests/test_roundtrip.py tests/test_daemon.py 2>&1 | tail -15 | tee "$out/tests_cpu_paths.log"
timeout 180 python3 benchmarks/gpu_check.py --gib 2 2>&1 | tee "$out/gpu_check.log"
timeout 60 python3 benchmarks/ring_tensors.py --device cuda:0 --tensors 20000 --repeats 3 \
    2>&1 | tee "$out/ring_tensors.log"
