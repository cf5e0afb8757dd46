#!/usr/bin/env bash
# One lease of an offline GPU host, in calls that each carry one part (README, "Run on a GPU host
# without internet"): the state lives in the checkout's ignored work/ folder, which the host keeps
# while it stays warm.
#
#   bash workflow/gpu_host.sh stage work/gpu-parts/pK        # calls 1..N: one part each
#   bash workflow/gpu_host.sh setup                           # join, check, install (once)
#   bash workflow/gpu_host.sh start NAME -- COMMAND ...        # a long job in the background
#   bash workflow/gpu_host.sh poll SECONDS [OUT]               # wait, then logs + new results to OUT
#
# `start` runs COMMAND with the wheelhouse's PYTHONPATH under nohup, its output in
# work/gpu-host/NAME.log; `poll` returns as soon as every started job has ended or after SECONDS,
# and packs the logs and every result file changed since setup into OUT (the call's $OUT) as
# archives of at most 15 MiB each (a call brings back 8 files of 16 MiB).
set -euo pipefail
STATE=work/gpu-host
STAGE=$STATE/stage
SITE=work/gpu-site
PY=${PYTHON:-python3}
mkdir -p "$STATE"

env_line() { echo "export PYTHONPATH=$PWD/$SITE:$PWD/src:$PWD/kernels:$PWD/benchmarks"; }

case "${1:-}" in
  stage)
    "$PY" workflow/gpu_parts.py stage "$2" "$STAGE" ;;
  setup)
    if [ ! -e "$STATE/joined" ]; then
      "$PY" workflow/gpu_parts.py join "$STAGE" .
      touch "$STATE/joined"
    fi
    if [ ! -e "$STATE/installed" ]; then
      "$PY" workflow/wheelhouse.py install work/wheelhouse "$SITE"
      touch "$STATE/installed"
    fi
    env_line > "$STATE/env.sh"
    touch "$STATE/since"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
    echo "setup done: source $STATE/env.sh" ;;
  start)
    name=$2; shift 2; [ "${1:-}" = "--" ] && shift
    case "$name" in *[!A-Za-z0-9._-]*|"") echo "job name '$name': letters, digits, . _ - only" >&2; exit 2;; esac
    [ -e "$STATE/env.sh" ] || { echo "run setup first" >&2; exit 2; }
    if [ -e "$STATE/$name.pid" ] && kill -0 "$(cat "$STATE/$name.pid")" 2>/dev/null; then
      echo "job $name is still running (pid $(cat "$STATE/$name.pid"))" >&2; exit 2
    fi
    # shellcheck disable=SC1091
    ( source "$STATE/env.sh"; nohup "$@" > "$STATE/$name.log" 2>&1 & echo $! > "$STATE/$name.pid" )
    echo "started $name (pid $(cat "$STATE/$name.pid")), log $STATE/$name.log" ;;
  poll)
    limit=$2; out=${3:-${OUT:-$STATE/out}}; mkdir -p "$out"
    end=$((SECONDS + limit))
    running() { for p in "$STATE"/*.pid; do [ -e "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null && return 0; done; return 1; }
    while running && [ $SECONDS -lt $end ]; do sleep 5; done
    for p in "$STATE"/*.pid; do
      [ -e "$p" ] || continue
      n=$(basename "$p" .pid)
      if kill -0 "$(cat "$p")" 2>/dev/null; then echo "$n: running"; else echo "$n: ended"; fi
      tail -n 3 "$STATE/$n.log" | sed "s/^/  $n| /"
    done
    list=$(mktemp)
    { ls "$STATE"/*.log 2>/dev/null || true; find results work/h200* -newer "$STATE/since" -type f 2>/dev/null || true; } | sort -u > "$list"
    tar czf "$STATE/poll.tgz" -T "$list"
    split -b 15m -d "$STATE/poll.tgz" "$out/poll.tgz."
    rm -f "$STATE/poll.tgz" "$list"
    ls -la "$out" ;;
  *)
    sed -n '2,14p' "$0"; exit 2 ;;
esac
