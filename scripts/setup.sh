#!/usr/bin/env bash
# Set up the development environment: .venv with snapckpt installed editable, plus the test extras and
# the frameworks the integration tests run (DeepSpeed, megatron-core, transformers, accelerate), and the
# documentation tools (MkDocs Material, mkdocstrings).
#
# Idempotent and quiet. The `test` extra pins torch==2.13.0 (the CPU wheel); never install plain
# `torch`, which would resolve a multi-GB CUDA build. A stamp file in .venv, newer than
# pyproject.toml, makes a repeated run skip pip entirely.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
STAMP="$VENV/.snapckpt-setup-stamp"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    python3 -m venv "$VENV"
fi

installed() {
    # The stamp is fresh and the editable install is still registered in the venv.
    [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] &&
        compgen -G "$VENV/lib/python*/site-packages/snapckpt-*.dist-info" > /dev/null
}

# DeepSpeed's ops are JIT-compiled when first used; building them at install time needs a CUDA toolkit.
export DS_BUILD_OPS=0

if ! installed; then
    echo "setup: installing snapckpt (editable) with test and framework extras into $VENV" >&2
    log="$VENV/.snapckpt-setup-pip.log"
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,deepspeed,megatron,hf,docs]' 2> "$log"; then
        cat "$log" >&2
        exit 1
    fi
    # On success, keep pip's warnings but drop the noise about configured local indexes that
    # have no entry for a package.
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    touch "$STAMP"
fi
