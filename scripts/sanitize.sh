#!/usr/bin/env bash
# The C extensions under AddressSanitizer and UBSan: builds csrc/ with
# FASTPERSIST_SANITIZE=1 into a scratch directory (the normal build is left
# alone), and runs the tests that drive the C code there: the engine (writes,
# reads, bounce buffers, the SIGBUS guard, gather), the codec's core, the
# record scanner and header writer, and Hypothesis fuzz passes over hostile
# manifests, records and C entry points (tests/test_c_fuzz.py). Any invalid
# access or undefined behaviour aborts the run.
#
#   bash scripts/sanitize.sh                    # what CI runs (a few minutes)
#   HYPOTHESIS_PROFILE=thorough bash scripts/sanitize.sh   # a long fuzz pass
#
# Needs the venv (scripts/setup.sh) and gcc's libasan/libubsan.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate

work="$(mktemp -d "${TMPDIR:-/tmp}/fastpersist-sanitize.XXXXXX")"
trap 'rm -rf "$work"' EXIT
FASTPERSIST_SANITIZE=1 python setup.py -q build_ext --build-lib "$work/lib" \
    --build-temp "$work/tmp" 2>&1 | grep -E "error|Error" || true
# A copy of the package with the sanitized extensions, and the tests, run from
# there: the repository's own fastpersist/ (first on sys.path from its root)
# keeps its normal build.
mkdir -p "$work/run"
cp -r fastpersist tests pyproject.toml "$work/run/"
find "$work/run" -name '__pycache__' -prune -exec rm -rf {} +
rm -f "$work/run/fastpersist/"*.so
cp "$work/lib/fastpersist/"*.so "$work/run/fastpersist/"

libasan="$(gcc -print-file-name=libasan.so)"
libubsan="$(gcc -print-file-name=libubsan.so)"
# CPython and torch are not built with ASan: leaks and ODR reports would be
# theirs. handle_sigbus=0: the engine's own SIGBUS guard is under test.
export ASAN_OPTIONS="detect_leaks=0:detect_odr_violation=0:alloc_dealloc_mismatch=0:abort_on_error=1:handle_sigbus=0:allow_user_segv_handler=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
cd "$work/run"
LD_PRELOAD="$libasan $libubsan" python - <<'EOF'
import fastpersist._codec, fastpersist._engine, fastpersist._format, os
for m in (fastpersist._engine, fastpersist._codec, fastpersist._format):
    assert m.__file__.startswith(os.getcwd()), m.__file__  # the sanitized build
EOF
LD_PRELOAD="$libasan $libubsan" python -m pytest -q -p no:cacheprovider \
    tests/test_engine.py tests/test_engine_region.py tests/test_snapshot.py \
    tests/test_load_bounce.py tests/test_codec_core.py tests/test_codec.py \
    tests/test_record_scan.py tests/test_manifest_fuzz.py tests/test_hostile_checkpoints.py \
    tests/test_c_fuzz.py tests/test_roundtrip.py tests/test_many_tensors.py \
    tests/test_verifying.py tests/test_stream_file.py "$@"
