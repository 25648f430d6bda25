#!/usr/bin/env bash
# matrix/recipe.sh: the recipe of one Debian release's root filesystem for the Slurm test matrix.
#
# Usage: matrix/recipe.sh SUITE DEST
# Builds DEST (which must not exist) with debootstrap --variant=minbase and installs that
# release's Slurm, slurmdbd, munge, MariaDB and Python. Nothing here is cached or stamped:
# matrix/run.sh decides when to (re)build and stores this file's hash in the rootfs. Every apt
# run happens in a private mount+pid namespace with service starts forbidden, so no package
# script can leave a daemon or a mount behind on the host. Any change to this file rebuilds
# every rootfs on the next `make test-matrix`. Each network step is retried a few times
# (matrix/retry.sh): a mirror caught mid-sync must not fail the matrix, nor may it pass it.
set -euo pipefail
# shellcheck source=matrix/retry.sh
source "$(dirname "${BASH_SOURCE[0]}")/retry.sh"

MIRROR=${SLURMFT_MATRIX_MIRROR:-http://deb.debian.org/debian}
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server python3 python3-venv procps)

die() { echo "recipe.sh: $*" >&2; exit 2; }
[[ $# -eq 2 ]] || die "usage: recipe.sh SUITE DEST"
suite=$1 dest=$2
[[ $suite =~ ^[a-z]+$ ]] || die "suite '$suite' is not a Debian suite name"
[[ $dest == /* ]] || die "DEST '$dest' must be an absolute path"
[[ ! -e $dest ]] || die "DEST '$dest' already exists"
[[ $(id -u) == 0 ]] || die "needs root (debootstrap, chroot)"

in_root() {  # run a command chrooted in $dest, in a throwaway mount+pid namespace
  unshare --mount --pid --fork --kill-child -- bash -euc '
    root=$1; shift
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
      DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 "$@"' in_root "$dest" "$@"
}

# In its own mount namespace: the /proc debootstrap mounts in DEST never shows on the host (so
# a failed attempt's DEST has nothing mounted and can simply be deleted before the next one).
bootstrap() {
  if [[ -e $dest ]]; then rm -rf --one-file-system "$dest"; fi
  if unshare --mount --propagation private -- \
    debootstrap --variant=minbase --include=ca-certificates "$suite" "$dest" "$MIRROR" >/dev/null; then
    return 0
  fi
  tail -n 5 "$dest/debootstrap/debootstrap.log" 2>/dev/null | sed 's/^/  debootstrap.log: /' >&2
  return 1
}
retry "debootstrap $suite" bootstrap

# policy-rc.d 101: package scripts must not start munge/mariadb/slurm daemons.
printf '#!/bin/sh\nexit 101\n' >"$dest/usr/sbin/policy-rc.d"
chmod 755 "$dest/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$dest/etc/resolv.conf"
# A frozen mirror (snapshot, or a proxy of one) serves Release files past their Valid-Until;
# signatures are still checked, only the freshness date is not.
# apt retries each download itself too, before the whole command is retried.
printf 'Acquire::Check-Valid-Until "false";\nAcquire::Retries "3";\n' \
  >"$dest/etc/apt/apt.conf.d/99slurmft-matrix"

retry "apt-get update ($suite)" in_root apt-get update -qq
retry "apt-get install ($suite)" \
  in_root apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null

# Where matrix/run.sh keeps its stamps (recipe and venv hashes) in the rootfs.
mkdir -p "$dest/etc/slurmft-matrix"

in_root apt-get clean
rm -rf "$dest/var/lib/apt/lists/"*
