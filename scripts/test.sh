#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the test suite; extra arguments go to pytest.
#
# Exits with pytest's code. Exit code 5 ("no tests collected") is reported as a failure: a test run
# that ran nothing must not pass.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh || exit $?

.venv/bin/python -m pytest tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
fi
exit "$rc"
