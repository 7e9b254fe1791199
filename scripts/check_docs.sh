#!/usr/bin/env bash
# The documentation site must build without a warning (a broken link or anchor, a page missing from the nav, an
# API name mkdocstrings cannot resolve): `mkdocs build --strict`, into a throwaway directory. Run from the repository
# root (or pass it as $1). Exits 1 on any warning. Not `--quiet`: with mkdocs 1.6 it hides the warnings from strict
# mode too, so the build passed with a broken anchor; the INFO lines are filtered instead.
set -uo pipefail
cd "${1:-$(dirname "${BASH_SOURCE[0]}")/..}"
mkdocs=${MKDOCS:-.venv/bin/mkdocs}
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 "$mkdocs" build --strict --site-dir "$site" 2>&1 | grep -v '^INFO'
rc=${PIPESTATUS[0]}
rm -rf "$site"
if [[ $rc -ne 0 ]]; then
    echo "check_docs.sh: mkdocs build --strict failed (see above); fix the docs" >&2
    exit 1
fi
echo "check_docs.sh: docs built (mkdocs build --strict, no warning)"
