#!/usr/bin/env bash
# The system tools the test suite drives, from Debian's packages, those missing only (as
# root, on Debian):
#
#   bash scripts/install-test-tools.sh
#
# - chromium: the playground's and the browser edge's tests (Playwright drives it; no
#   download);
# - nginx: the replicas-behind-a-balancer test;
# - Node.js and npm: to build the browser edge. A machine's own Node.js (NodeSource's, say)
#   carries npm, and Debian's npm package conflicts with it: npm is asked for only where
#   the command is missing.
set -euo pipefail
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v nginx >/dev/null || missing+=(nginx-light)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if ((${#missing[@]})); then
    apt-get update -q
    apt-get install -y -q "${missing[@]}"
fi
