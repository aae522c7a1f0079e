#!/usr/bin/env bash
# The slow tier: long end-to-end tests and extra variants of default-suite tests (marked `slow`), kept out of the
# default `python -m pytest -q` so that it stays within its time budget. CI runs both.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pytest -q -p no:cacheprovider -m slow tests/cpu "$@"
