#!/usr/bin/env bash
# Install everything the test suite needs on a fresh machine, then run it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python -m pytest -q -p no:cacheprovider "$@"
