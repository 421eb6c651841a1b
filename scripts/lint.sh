#!/usr/bin/env bash
# Static checks CI runs before the tests: ruff (lint and format) and the import-linter
# contracts (one-way layers, the engine never imports training, the core never imports a
# plugin, plugins are independent; pyproject.toml [tool.importlinter]).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "== ruff check"; .venv/bin/ruff check . || status=1
echo "== ruff format --check"; .venv/bin/ruff format --check . || status=1
echo "== lint-imports"; .venv/bin/lint-imports --no-cache || status=1
exit $status
