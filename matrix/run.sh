#!/usr/bin/env bash
# matrix/run.sh: runs the Slurm integration tests against every Debian release of Slurm.
#
# Usage: matrix/run.sh [SUITE...]          (default: bookworm trixie sid = Slurm 22.05, 24.11, 26.05)
#
# For each suite: make sure its root filesystem exists and matches matrix/recipe.sh (rebuilt
# when the recipe's hash differs from the one stored in the rootfs), make sure its venv holds
# the project's core + dev dependencies (rebuilt when they change), then copy the working tree
# into a tmpfs inside the rootfs and run pytest there, chrooted, in private mount, pid and
# network namespaces. When the namespace's first process exits, for any reason, the kernel
# kills every process left in it and drops every mount: nothing survives a run, not even a
# daemon a failing test forgot. The loopback network is private too, so the matrix never meets
# another devcluster running on the host.
#
# Environment (all optional):
#   SLURMFT_MATRIX_CACHE   where rootfs live (default /var/cache/slurmft-matrix; outside the repo)
#   SLURMFT_MATRIX_MIRROR  Debian mirror (default http://deb.debian.org/debian)
#   SLURMFT_MATRIX_TESTS   pytest paths (default: the client's, the field-matrix and the devcluster
#                          reset tests)
#   SLURMFT_MATRIX_PYTEST_ARGS  extra pytest arguments, split on spaces
#   SLURMFT_MATRIX_RESULTS where per-suite results go (default: a new temp dir, printed)
#   SLURMFT_MATRIX_NET_ATTEMPTS  tries of each network step: debootstrap, apt-get, pip (default 3)
# Exit status: 0 when every suite ran every test and all passed; 1 when a suite failed, could not
# be built (after its retries), or skipped a test (a skip tests nothing: here it is a failure);
# 2 on bad input. The last lines name each failed suite and test ("matrix: FAILED sid ...").
# The ensure_*/run_tests functions are called in an `if`, where bash ignores `set -e`: each
# step that can fail says `|| return 1` itself.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=matrix/retry.sh
source "$here/retry.sh"
repo=$(cd "$here/.." && pwd)
cache=${SLURMFT_MATRIX_CACHE:-/var/cache/slurmft-matrix}
export SLURMFT_MATRIX_MIRROR=${SLURMFT_MATRIX_MIRROR:-http://deb.debian.org/debian}
tests=${SLURMFT_MATRIX_TESTS:-tests/integration/test_slurm_client.py tests/integration/test_slurm_fields_matrix.py tests/integration/test_devcluster_reset.py}
pytest_args=${SLURMFT_MATRIX_PYTEST_ARGS:-}
venv=/opt/slurmft/venv           # inside each rootfs
stamp_dir=etc/slurmft-matrix     # inside each rootfs, written by recipe.sh and here

die() { echo "matrix: $*" >&2; exit 2; }
log() { echo "matrix: $*" >&2; }

[[ $(id -u) == 0 ]] || die "needs root (debootstrap, chroot, namespaces)"
for tool in debootstrap unshare chroot ip git python3; do
  command -v "$tool" >/dev/null || die "'$tool' not found (apt-get install debootstrap util-linux iproute2 git)"
done
[[ $cache == /* ]] || die "SLURMFT_MATRIX_CACHE '$cache' must be an absolute path"
case $cache/ in "$repo"/*) die "SLURMFT_MATRIX_CACHE '$cache' must be outside the repository" ;; esac
suites=("$@")
[[ ${#suites[@]} -gt 0 ]] || suites=(bookworm trixie sid)
for suite in "${suites[@]}"; do
  [[ $suite =~ ^[a-z]+$ ]] || die "'$suite' is not a Debian suite name (e.g. bookworm trixie sid)"
done
for t in $tests; do [[ -e $repo/$t ]] || die "test path '$t' does not exist in $repo"; done

results=${SLURMFT_MATRIX_RESULTS:-$(mktemp -d /tmp/slurmft-matrix-results.XXXXXX)}
mkdir -p "$results" "$cache"
# One matrix run per cache at a time: two would rebuild, install into and run in the same rootfs.
exec 9>>"$cache/.lock"
if ! flock -n 9; then
  log "another matrix run holds $cache/.lock; waiting for it (up to 1 h)"
  flock -w 3600 9 || die "could not lock $cache/.lock (another matrix run still holds it?)"
fi

# rm -rf of a tree with something mounted below it would delete the host's files through the
# mount: refuse instead. (Our own mounts live in private namespaces and never show up here.)
remove_tree() {
  local path=$1
  if findmnt -rn -o TARGET | grep -qE "^${path//./\\.}(/|$)"; then
    die "refusing to delete $path: something is mounted under it (see findmnt)"
  fi
  rm -rf --one-file-system "$path"
}

# Chroot into a rootfs in throwaway mount+pid namespaces (network shared: apt and pip need it).
in_root() {
  local root=$1; shift
  unshare --mount --pid --fork --kill-child -- bash -euc '
    root=$1; shift
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"
  ' in_root "$root" "$@"
}

recipe_hash() {  # everything the rootfs is made from
  { cat "$here/recipe.sh"; echo "suite=$1 mirror=$SLURMFT_MATRIX_MIRROR"; } | sha256sum | cut -d' ' -f1
}

ensure_rootfs() {
  local suite=$1 root=$cache/$1 want have tmp start
  want=$(recipe_hash "$suite")
  have=$(cat "$root/$stamp_dir/recipe.sha256" 2>/dev/null || true)
  if [[ $want == "$have" ]]; then log "$suite: rootfs up to date ($root)"; return; fi
  log "$suite: building rootfs (recipe ${want:0:12}) in $root"
  start=$SECONDS
  tmp=$cache/.$suite.tmp-$$
  for stale in "$cache/.$suite.tmp-"*; do  # left by an interrupted build (we hold the lock)
    if [[ -e $stale ]]; then remove_tree "$stale"; fi
  done
  if ! "$here/recipe.sh" "$suite" "$tmp"; then remove_tree "$tmp"; return 1; fi
  echo "$want" >"$tmp/$stamp_dir/recipe.sha256" || return 1
  remove_tree "$root" || return 1
  mv "$tmp" "$root" || return 1
  log "$suite: rootfs built in $((SECONDS - start)) s, $(du -sh "$root" | cut -f1)"
}

ensure_venv() {
  local suite=$1 root=$cache/$1 deps want have start
  mapfile -t deps < <(python3 "$here/helper.py" deps "$repo/pyproject.toml")
  [[ ${#deps[@]} -gt 0 ]] || return 1
  want=$(printf '%s\n' "${deps[@]}" | sha256sum | cut -d' ' -f1)
  have=$(cat "$root/$stamp_dir/venv.sha256" 2>/dev/null || true)
  if [[ $want == "$have" && -x $root$venv/bin/python ]]; then return; fi
  log "$suite: building venv: ${deps[*]}"
  start=$SECONDS
  rm -f "$root/$stamp_dir/venv.sha256"
  rm -rf --one-file-system "${root:?}$venv"
  # pip inside the rootfs trusts what the host trusts (a site's TLS proxy CA included).
  cp /etc/ssl/certs/ca-certificates.crt "$root/$stamp_dir/host-ca.crt" || return 1
  in_root "$root" python3 -m venv "$venv" || return 1
  # Build tools first, so that sdists among the deps build as wheels even with an old pip.
  local pip=("$venv/bin/pip" install -q --disable-pip-version-check --cert "/$stamp_dir/host-ca.crt")
  retry "pip install pip setuptools wheel ($suite)" \
    in_root "$root" "${pip[@]}" --upgrade pip setuptools wheel || return 1
  retry "pip install the dependencies ($suite)" in_root "$root" "${pip[@]}" "${deps[@]}" || return 1
  echo "$want" >"$root/$stamp_dir/venv.sha256"
  log "$suite: venv built in $((SECONDS - start)) s"
}

# Run the tests chrooted in private mount, pid and network namespaces; the repo is copied into
# a tmpfs at /src (what git tracks or would track: as on a fresh clone) and installed editable
# into the rootfs venv without network.
run_tests() {
  local suite=$1 root=$cache/$1 rc=0
  cp /etc/hosts "$root/etc/hosts"   # the host name must resolve; the devcluster adds its nodes
  unshare --mount --pid --net --fork --kill-child -- bash -euc '
    root=$1 repo=$2 results=$3 suite=$4 venv=$5 tests=$6 pytest_args=$7
    ip link set lo up
    # getaddrinfo(AI_ADDRCONFIG), which slurmdbd uses to listen, finds nothing when loopback is
    # the only address of a family: give lo one non-loopback address of each (test ranges).
    ip addr add 198.51.100.1/32 dev lo
    ip -6 addr add fd5f:7f::1/128 dev lo
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"   # with /sys/fs/cgroup: slurmd 24.11+ stops without it
    mount --rbind /dev "$root/dev"
    mount -t tmpfs -o size=4g tmpfs "$root/tmp"
    mkdir -p "$root/src" "$root/results"
    mount -t tmpfs -o size=1g tmpfs "$root/src"
    mount --bind "$results" "$root/results"
    cd "$repo"
    git ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d "" f; do [[ -e $f ]] && printf "%s\0" "$f"; done \
      | tar --null -T - -cf - | tar -xf - -C "$root/src"
    in_chroot() {
      chroot "$root" /usr/bin/env -i PATH="$venv/bin:/usr/sbin:/usr/bin:/sbin:/bin" HOME=/root \
        LANG=C.UTF-8 SLURMFT_MATRIX_REPORT="/results/$suite.jsonl" "$@"
    }
    # Quiet unless it fails (setuptools warns about the editable install on every run).
    if ! in_chroot "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-index \
      --no-build-isolation -e /src >"$results/$suite.install.log" 2>&1; then
      echo "matrix: $suite: pip install -e /src failed:" >&2
      cat "$results/$suite.install.log" >&2
      exit 1
    fi
    # shellcheck disable=SC2086  # tests and pytest_args are space-separated lists
    rc=0
    in_chroot bash -c "cd /src && exec python -m pytest -p no:cacheprovider -q -m integration \
      --junitxml=/results/$suite.xml $pytest_args $tests" || rc=$?
    if [[ $rc != 0 ]]; then  # the tmpfs dies with us: keep the daemon logs for a post-mortem
      (cd "$root/tmp" && find . -type d -name log -path "*cluster*" -print0 \
        | tar --null -T - -cf - | tar -xf - -C "$results" --transform "s|^\.|$suite-logs|") || true
    fi
    exit "$rc"
  ' run_tests "$root" "$repo" "$results" "$suite" "$venv" "$tests" "$pytest_args" || rc=$?
  return "$rc"
}

failed=()
for suite in "${suites[@]}"; do
  start=$SECONDS
  rm -f "$results/$suite".*
  if ! ensure_rootfs "$suite"; then
    log "$suite: FAILED: could not build its rootfs (see above)"
    failed+=("$suite")
  elif ! ensure_venv "$suite"; then
    log "$suite: FAILED: could not build its venv (see above)"
    failed+=("$suite")
  elif ! run_tests "$suite"; then
    log "$suite: FAILED after $((SECONDS - start)) s"
    failed+=("$suite")
  else
    log "$suite: pytest passed in $((SECONDS - start)) s"
  fi
done

# The tables, then one "matrix: FAILED <suite> ..." line per failed/skipped test or missing
# result; its exit status is the verdict (a suite whose pytest passed may still have skipped).
verdict=0
python3 "$here/helper.py" report "$results" "${suites[@]}" || verdict=1
log "results in $results"
if [[ ${#failed[@]} -gt 0 || $verdict != 0 ]]; then
  log "FAILED (${failed[*]:-see the lines above})"
  exit 1
fi
log "every test passed on: ${suites[*]}"
