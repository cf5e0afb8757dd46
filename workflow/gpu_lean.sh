#!/usr/bin/env bash
# Make the checkout travel light for a lease of a capped GPU host, then undo it.
#
#   bash workflow/gpu_lean.sh on [KEEP ...]   # e.g. on results/h200-long results/h200-rank-search
#   make gpu-parts GPU_PARTS=work/gpu-partsN  # now with far fewer, larger parts
#   ...the lease...
#   bash workflow/gpu_lean.sh off             # the index as HEAD has it again
#
# Why: a device call carries the checkout's tracked and untracked-not-ignored files with the part
# (64 MiB in all). The committed results grew to 60.5 MiB by session 44, which left 3-MiB parts:
# 59 staging calls. `on` takes every results/ folder but the KEEP ones (the grids a lease resumes,
# whose finished results `gpu_host.sh missing` must see) and notebooks/ out of the index only --
# the files stay on disk, untouched -- and lists them in .git/info/exclude, so they are neither
# tracked nor untracked-not-ignored and do not travel (`git status` shows them as staged deletions
# meanwhile). `off` restores those index entries from HEAD and removes the exclude lines it added. Session 44: 19.5 MiB travelled with KEEP = the two grids,
# 4 parts of 44 MiB. Commit nothing between `on` and `off` (the commit would delete the folders).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
STATE=.git/palu-gpu-lean
EXCLUDE=.git/info/exclude
BEGIN="# palu gpu-lean: begin (workflow/gpu_lean.sh off removes this block)"
END="# palu gpu-lean: end"

case "${1:-}" in
  on)
    shift
    [ ! -e "$STATE" ] || { echo "already lean (paths in $STATE): run 'off' first" >&2; exit 1; }
    for keep in "$@"; do
      [ -d "$keep" ] || { echo "KEEP $keep: no such folder" >&2; exit 1; }
    done
    paths=()
    for dir in results/*/ notebooks/; do
      dir=${dir%/}
      skip=0
      for keep in "$@"; do [ "$dir" = "${keep%/}" ] && skip=1; done
      [ "$skip" = 1 ] || [ -z "$(git ls-files -- "$dir" | head -1)" ] || paths+=("$dir")
    done
    [ "${#paths[@]}" -gt 0 ] || { echo "nothing to take out of the index" >&2; exit 1; }
    if ! git diff --cached --quiet -- "${paths[@]}"; then
      echo "staged changes under the folders to take out: commit or unstage them first" >&2; exit 1
    fi
    printf '%s\n' "${paths[@]}" > "$STATE"
    git rm -r -q --cached -- "${paths[@]}"
    { echo "$BEGIN"; printf '/%s/\n' "${paths[@]}"; echo "$END"; } >> "$EXCLUDE"
    kib=$(git ls-files -z -co --exclude-standard | xargs -0 du -k 2>/dev/null | awk '{s += $1} END {print s}')
    echo "lean: ${#paths[@]} folders out of the index; the checkout now travels $((kib / 1024)) MiB"
    ;;
  off)
    [ -e "$STATE" ] || { echo "not lean (no $STATE)" >&2; exit 1; }
    mapfile -t paths < "$STATE"
    git reset -q -- "${paths[@]}"
    sed -i "/^$(printf '%s' "$BEGIN" | sed 's/[][\/.*^$]/\\&/g')\$/,/^$END\$/d" "$EXCLUDE"
    rm "$STATE"
    echo "restored ${#paths[@]} folders in the index"
    git status --short | head -5
    ;;
  *)
    sed -n '2,17p' "$0"; exit 2 ;;
esac
