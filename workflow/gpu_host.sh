#!/usr/bin/env bash
# One lease of an offline GPU host, in calls that each carry one part (README, "Run on a GPU host
# without internet"): the state lives in the checkout's ignored work/ folder, which the host keeps
# while it stays warm.
#
#   bash workflow/gpu_host.sh stage work/gpu-parts/pK        # calls 1..N: one part each
#   bash workflow/gpu_host.sh setup                           # join, check, install (once)
#   bash workflow/gpu_host.sh start NAME -- COMMAND ...        # a long job in the background
#   bash workflow/gpu_host.sh poll SECONDS [OUT]               # wait, then logs + new results to OUT
#   bash workflow/gpu_host.sh stop NAME                        # end a started job (its whole session)
#   bash workflow/gpu_host.sh missing RULE SNAKEMAKE-ARGS ...  # RULE's outputs not yet made
#
# `start` runs COMMAND with the wheelhouse's PYTHONPATH in its own session (the host ends every
# other process a call leaves behind), its output in work/gpu-host/NAME.log; `poll` returns as soon
# as every started job has ended or after SECONDS, and packs the logs, work/gpu-host/*.json and
# every result, journal, job log, job wall time, rank allocation and W&B run changed since setup into OUT (the call's
# $OUT) as archives of at most 15 MiB each (a call brings back 8 files of 16 MiB).
#
# Jobs run in a copy of the checkout outside it (RUN, made by the first `start` or `missing`): each
# call re-sends the working tree and removes there what this side's tree lacks, so a result a job
# had written into the checkout's results/ vanished at the next call (seen on the H200, session
# 35); ignored folders (work/) stay. Prepare the checkout (journals unpacked, say) before `start`.
set -euo pipefail
shopt -s nullglob
STATE=work/gpu-host
STAGE=$STATE/stage
SITE=work/gpu-site
RUN=${PALU_RUN_DIR:-/tmp/palu-run}
PY=${PYTHON:-python3}
mkdir -p "$STATE"

env_line() { echo "export PYTHONPATH=$PWD/$SITE:$RUN/src:$RUN/kernels:$RUN/benchmarks"; }

run_copy() {   # the checkout as it is now, once (not the staged parts, the wheels, the installed site)
  if [ ! -e "$RUN/.palu-run" ]; then
    mkdir -p "$RUN"
    tar -cf - --exclude='./work/gpu-parts*' --exclude=./work/gpu-host --exclude=./work/gpu-site \
        --exclude=./work/wheelhouse . | tar -xf - -C "$RUN"
    touch "$RUN/.palu-run"
  fi
}

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
    echo "setup done: source $STATE/env.sh (jobs run in $RUN)" ;;
  start)
    name=$2; shift 2; [ "${1:-}" = "--" ] && shift
    case "$name" in *[!A-Za-z0-9._-]*|"") echo "job name '$name': letters, digits, . _ - only" >&2; exit 2;; esac
    [ -e "$STATE/env.sh" ] || { echo "run setup first" >&2; exit 2; }
    if [ -e "$STATE/$name.pid" ] && kill -0 "$(cat "$STATE/$name.pid")" 2>/dev/null; then
      echo "job $name is still running (pid $(cat "$STATE/$name.pid"))" >&2; exit 2
    fi
    run_copy
    log=$PWD/$STATE/$name.log; pid=$PWD/$STATE/$name.pid
    # shellcheck disable=SC1091
    ( source "$STATE/env.sh"; cd "$RUN"; setsid nohup "$@" > "$log" 2>&1 < /dev/null & echo $! > "$pid" )
    echo "started $name in $RUN (pid $(cat "$pid")), log $STATE/$name.log" ;;
  stop)   # by its recorded pid's session: `pkill -f PATTERN` in a call also matches the call's
          # own command line, which holds the pattern (session 52 ended its own call that way)
    name=$2; pid_file=$STATE/$name.pid
    [ -e "$pid_file" ] || { echo "no job named '$name' was started" >&2; exit 2; }
    pid=$(cat "$pid_file")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
      for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
      echo "stopped $name (pid $pid)"
    else
      echo "$name had already ended"
    fi ;;
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
    since=$PWD/$STATE/since; list=$(mktemp); mkdir -p "$RUN"
    # the job logs; from RUN: results, each grid's journals, logs, job wall times (benchmarks),
    # allocated ranks and offline W&B runs (not models or statistics), listed NUL-separated (a
    # result's name is never split or read by the shell)
    (cd "$RUN" && find results work/*/journal work/*/logs work/*/benchmarks work/*/ranks work/*/wandb \
        -newer "$since" -type f -print0 2>/dev/null) > "$list" || true
    # with the logs, any results file a command wrote beside them (a benchmark run during staging
    # writes work/gpu-host/<device>-<shape>.json: it has no checkout of its own yet)
    tar czf "$STATE/poll.tgz" "$STATE"/*.log "$STATE"/*.json -C "$RUN" --null -T "$list"
    split -b 15m -d "$STATE/poll.tgz" "$out/poll.tgz."
    rm -f "$STATE/poll.tgz" "$list"
    ls -la "$out" ;;
  missing)   # the outputs of RULE a grid still lacks in RUN (explicit targets: a fresh host
             # rebuilds the model, and everything downstream of a job that runs would run again)
    rule=$2; shift 2
    run_copy; cd "$RUN"
    "$PY" -m snakemake -n "$@" 2>/dev/null | awk -v r="rule $rule:" '
      $0 == r {want = 1; next} /^(rule|localrule|checkpoint) / {want = 0}
      want && $1 == "output:" {sub(/^ *output: */, ""); n = split($0, f, ", "); for (i = 1; i <= n; i++) print f[i]}' |
      while read -r f; do [ -e "$f" ] || echo "$f"; done | sort -u ;;
  *)
    sed -n '2,22p' "$0"; exit 2 ;;
esac
