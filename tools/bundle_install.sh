#!/usr/bin/env bash
# install.sh of each part of the inflightllm air-gapped bundle (written by tools/bundle.py).
# Copies this part out of the checkout into the prefix and installs whatever is complete;
# run it once per part, in any order, over as many sessions as the parts take.
#   bash build/bundle/part1/install.sh [--prefix /root/inflightllm-bundle] [--repo .]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec python3 "$here/bundle_install.py" --part "$here" "$@"
