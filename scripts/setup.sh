#!/usr/bin/env bash
# Set up the development environment: .venv with snapckpt installed editable, plus the test extras and
# the frameworks the integration tests run (DeepSpeed, megatron-core, transformers, accelerate), and the
# documentation tools (MkDocs Material, mkdocstrings).
#
# Idempotent and quiet. pyproject.toml states version ranges (what users install); the exact versions
# of the development machine are in constraints.txt, passed to pip with -c. It pins torch to its CPU
# build (torch==2.13.0+cpu): never install a plain `torch`, which would resolve a multi-GB CUDA build.
# A stamp file in .venv records the checksum of pyproject.toml and constraints.txt it was made for;
# while both are unchanged a repeated run skips pip entirely.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
STAMP="$VENV/.snapckpt-setup-stamp"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    python3 -m venv "$VENV"
fi

inputs_sum() {
    # What an install depends on: the requirements (ranges) and the pins.
    cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1
}

installed() {
    # The stamp names the current inputs and the editable install is still registered in the venv.
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(inputs_sum)" ] &&
        compgen -G "$VENV/lib/python*/site-packages/snapckpt-*.dist-info" > /dev/null
}

# DeepSpeed's ops are JIT-compiled when first used; building them at install time needs a CUDA toolkit.
export DS_BUILD_OPS=0

if ! installed; then
    echo "setup: installing snapckpt (editable) with test and framework extras into $VENV" >&2
    log="$VENV/.snapckpt-setup-pip.log"
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt \
            -e '.[test,deepspeed,megatron,hf,docs]' 2> "$log"; then
        cat "$log" >&2
        exit 1
    fi
    # On success, keep pip's warnings but drop the noise about configured local indexes that
    # have no entry for a package.
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    inputs_sum > "$STAMP"
fi

# The optional native loops over many tensors (snapckpt/_native, a few seconds with g++): cached per torch version
# and source; snapckpt runs the Python path where they are not built (no compiler: a note, not a failure).
if ! "$VENV/bin/python" -m snapckpt._native build > /dev/null 2> "$VENV/.snapckpt-native-build.log"; then
    echo "setup: the optional native loops were not built (see $VENV/.snapckpt-native-build.log)" >&2
fi
