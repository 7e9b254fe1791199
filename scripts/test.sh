#!/usr/bin/env bash
# Set up (scripts/setup.sh), build the docs (mkdocs build --strict), then run the test suite: `.venv/bin/python -m pytest -n 4 --dist loadgroup tests "$@"`.
#
# Extra arguments go to pytest. When one of them names a test file or directory
# (`bash scripts/test.sh tests/test_smoke.py::test_x -q`), only that is run instead of all of tests/.
# Exits with pytest's code. Exit code 5 ("no tests collected") is reported as a failure: a test run
# that ran nothing must not pass.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh || exit $?

targets=(tests)
for arg in "$@"; do
    case "$arg" in
        -*) ;;
        *) if [ -e "${arg%%::*}" ]; then targets=(); fi ;;
    esac
done

# The documentation site must build without a warning (scripts/check_docs.sh: mkdocs build --strict).
bash scripts/check_docs.sh || exit 1

# Four pytest workers: most tests wait on real processes (torchrun ranks, the persister, sleeps and
# timeouts), so on 2 cores two workers left about 40% of the CPU idle (1.2 cores busy on average over a full
# run) and three about 27% (1.46 cores). Tests are handed out one by one (--dist loadgroup): with --dist loadfile a worker that
# drew a slow module late ran all of it while the others had nothing left to do. A module whose tests
# share a module-scoped fixture or cache marks itself `pytestmark = pytest.mark.xdist_group(...)` and runs
# on one worker (under pytest 9 only through tests/conftest.py: pytest-xdist 3.8 alone ignores the mark);
# the scheduler hands out groups before single tests. Each test has its own runtime and shared-memory directories (tests/conftest.py snap_env).
.venv/bin/python -m pytest -n 4 --dist loadgroup "${targets[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; treating that as a failure" >&2
fi
exit "$rc"
