#!/usr/bin/env bash
# The cluster lane (`make test-cluster`): installs SLURM (Debian packages), starts a single-node
# cluster, runs tests/cluster (the small grid's targets through the shipped SLURM profile against
# a local run, and a failing job), then stops every daemon it started, by PID, whatever happened.
set -euo pipefail
cd "$(dirname "$0")/../.."
state=work/cluster/slurm
start=$(date +%s)
tests/cluster/slurm.sh install
rm -rf "$state"
tests/cluster/slurm.sh up "$state"
trap 'tests/cluster/slurm.sh down "$state"' EXIT
sinfo
PALU_CLUSTER_LANE=1 .venv/bin/python -m pytest -q -s tests/cluster
.venv/bin/python tests/cluster/overhead.py work/cluster/slurm-run.log | tail -n 1
echo "cluster lane: $(( $(date +%s) - start )) s"
