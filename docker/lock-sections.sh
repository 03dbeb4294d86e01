#!/bin/sh
# The build's one reader of a lock file (ddp_tasks/lock_file.py writes them): stop unless the lock
# holds every pin, then write each "# [SECTION]" part to DIR/SECTION.txt.
#   sh lock-sections.sh NAME LOCK DIR HINT PIN...
# NAME: the lock as the error names it; HINT: what to run when a pin is missing.
set -eu
name=$1 lock=$2 dir=$3 hint=$4
shift 4
for pin in "$@"; do
  if ! grep -q "^${pin}[+ ]" "$lock"; then
    echo "error: ${name} does not hold ${pin}: it was made for other pins" >&2
    echo "HINT: ${hint}" >&2
    exit 1
  fi
done
mkdir -p "$dir"
awk -v dir="$dir" '/^# \[[a-z]+\]$/ { file = dir "/" substr($0, 4, length($0) - 4) ".txt"; next }
  file && !/^#/ { print > file }' "$lock"
