# matrix/retry.sh: sourced by matrix/recipe.sh and matrix/run.sh (bash); not run on its own.
#
# retry WHAT CMD...: runs CMD up to $SLURMFT_MATRIX_NET_ATTEMPTS times (default 3), waiting
# 15 s, then 30 s, ... between attempts. For the steps that fetch from the network (debootstrap,
# apt-get, pip), whose one-off failures (a mirror mid-sync, a dropped connection) are not ours.
# Every failed attempt is reported on stderr; after the last one it returns 1, never 0: a
# network that stays down fails the matrix, it does not skip it.

retry() {
  local what=$1 attempts=${SLURMFT_MATRIX_NET_ATTEMPTS:-3} n=1 wait_s=15
  shift
  [[ $attempts =~ ^[1-9][0-9]*$ ]] || {
    echo "matrix: SLURMFT_MATRIX_NET_ATTEMPTS '$attempts' must be a positive integer" >&2
    return 2
  }
  until "$@"; do
    if ((n >= attempts)); then
      echo "matrix: $what failed $n times (network or mirror?); giving up" >&2
      return 1
    fi
    echo "matrix: $what failed (attempt $n of $attempts); retrying in $wait_s s" >&2
    sleep "$wait_s"
    n=$((n + 1)) wait_s=$((wait_s * 2))
  done
}
