#!/usr/bin/env bash
# Install everything, run the static checks (scripts/lint.sh), then every test suite (the
# core's and each plugin's), each in its own pytest process so the suites' `tests`
# packages never collide. A lint failure fails the run after the tests have run.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1

# The run report's browser tests drive Debian's chromium through Playwright (never a
# downloaded browser): both are test-only, so they are installed here, not by install.sh.
# Without them the browser tests fail, saying how to install them.
source scripts/apt_package.sh
ensure_apt_package chromium chromium "the run report's browser tests"
# Playwright's Python package only: the browser is Debian's, never one Playwright downloads.
.venv/bin/python -c "import playwright" 2>/dev/null \
  || .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt playwright \
  || echo "test.sh: warning: pip install playwright failed; the report's browser tests need it" >&2
bash scripts/lint.sh || lint_failed=1

export MILES_STRICT_PLUGINS=1
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
status=${lint_failed:-0}
suites=(tests plugins/*/tests)
for suite in "${suites[@]}"; do
  echo "== $suite"
  name=$(echo "$suite" | tr '/' '_')
  .venv/bin/python -m pytest "$suite" -q -p no:cacheprovider --junitxml="$reports/$name.xml" "$@" || status=1
done
.venv/bin/python - "$reports" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for report in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for suite in ET.parse(report).getroot().iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
failed = totals["failures"] + totals["errors"]
passed = totals["tests"] - failed - totals["skipped"]
print(f"all suites: {passed} passed, {failed} failed, {totals['skipped']} skipped")
PY
exit $status
