#!/bin/sh
# One step of `make demo`/`make install`, said in one line:
#
#   scripts/dev/install_step.sh LOG WHAT COMMAND [ARG...]
#
# prints "  WHAT", runs COMMAND with its output (pip's progress, resolver notes, build
# backends' warnings) appended to LOG, and on failure shows LOG's last lines and the step
# that failed, exiting with COMMAND's status. A newcomer sees what is installed, not how.
log=$1
what=$2
shift 2
echo "  $what"
echo "== $what: $*" >>"$log"
"$@" >>"$log" 2>&1 && exit 0
rc=$?
tail -n 30 "$log" >&2
echo "failed (exit $rc): $what; the whole output: $log" >&2
exit "$rc"
