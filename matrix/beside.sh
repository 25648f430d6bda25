#!/usr/bin/env bash
# matrix/beside.sh: runs a command (make test's pytest) with the release matrix beside it.
#
# Usage: matrix/beside.sh "SUITE..." LOG -- COMMAND [ARG...]
#
# Both mostly wait on real daemons and timers, not on the CPU, so side by side they take about as
# long as the longer one (the matrix: ~3-6 min; pytest: longer), instead of their sum. The
# matrix runs in its own session (its own process group) with its output in LOG, printed whole
# after COMMAND ends; an interrupt or a TERM ends both, the matrix's namespaces with it
# (matrix/run.sh's `unshare --kill-child`). An empty SUITE list runs COMMAND alone.
# Exit status: COMMAND's when it failed, else 1 when the matrix failed, else 0.
set -uo pipefail

die() { echo "matrix/beside.sh: $*" >&2; exit 2; }
[[ $# -ge 4 && $3 == -- ]] || die 'usage: matrix/beside.sh "SUITE..." LOG -- COMMAND [ARG...]'
suites=$1 log=$2
shift 3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [[ -z ${suites// /} ]]; then exec "$@"; fi
mkdir -p "$(dirname "$log")" || die "cannot create the directory of '$log'"
: >"$log" || die "cannot write '$log'"
# shellcheck disable=SC2086  # the suites are a space-separated list
setsid "$here/run.sh" $suites >"$log" 2>&1 &
matrix=$!
stop_matrix() { kill -TERM -- "-$matrix" 2>/dev/null; wait "$matrix" 2>/dev/null; }
trap 'stop_matrix; exit 130' INT
trap 'stop_matrix; exit 143' TERM
echo "the release matrix ($suites) runs beside the tests; its output: $log (printed at the end)"

rc=0
"$@" || rc=$?
start=$SECONDS
matrix_rc=0
wait "$matrix" || matrix_rc=$?
trap - INT TERM
echo "---- the release matrix ($suites), waited for $((SECONDS - start)) s after the tests ----"
cat "$log"
if [[ $rc != 0 ]]; then exit "$rc"; fi
if [[ $matrix_rc != 0 ]]; then echo "the release matrix failed (exit $matrix_rc): see above" >&2; exit 1; fi
exit 0
