#!/usr/bin/env bash
# The images compose needs from outside, built here from Debian's packages and PyPI's
# wheels, for a machine without an image registry (`make images`, `nextstate compose init
# --offline`; deploy/compose/offline.yml uses them):
#
#   nextstate-offline/debian:bookworm      debootstrap --variant=minbase, `docker import`ed
#   nextstate-offline/python:3.11          python:3.11-slim's stand-in (Debian's python3 3.11)
#   nextstate-offline/redis:7.0            redis:7.4-alpine's (Debian's redis-server 7.0)
#   nextstate-offline/s3:latest            MinIO's (SeaweedFS `weed` serving S3)
#   nextstate-offline/torch-wheels:2.13.0  the CPU torch wheel found on this disk, in /wheels
#
# Idempotent and cheap when done: the Debian base is made only when missing, the rest are
# `docker build`s whose layers are cached. Needs root (debootstrap) the first time.
#   TORCH_WHEELS_DIR   a folder holding torch-<deploy/lock/torch.in>+cpu-*.whl (default: pip's find-links)
#   DEBIAN_MIRROR      default http://deb.debian.org/debian
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export DOCKER_BUILDKIT=0
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/^torch==//p' "$here/../lock/torch.in")}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
say() { echo "bases: $*" >&2; }

have() { docker image inspect "$1" >/dev/null 2>&1; }

build() {  # build TAG CONTEXT DOCKERFILE [ARGS…]
  local tag=$1 context=$2 file=$3; shift 3
  local log; log=$(mktemp)
  local t0=$SECONDS
  if ! docker build --network host -q -t "$tag" -f "$file" "$@" "$context" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; say "building $tag failed"; exit 1
  fi
  rm -f "$log"; say "$tag ready ($((SECONDS - t0)) s)"
}

if ! have nextstate-offline/debian:bookworm; then
  command -v debootstrap >/dev/null || { say "debootstrap is missing (apt-get install debootstrap)"; exit 1; }
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  say "debootstrap bookworm (minbase) from $DEBIAN_MIRROR"
  debootstrap --variant=minbase bookworm "$root/fs" "$DEBIAN_MIRROR" >"$root/log" 2>&1 \
    || { tail -20 "$root/log" >&2; say "debootstrap failed"; exit 1; }
  rm -rf "$root"/fs/var/cache/apt/archives/*.deb "$root"/fs/var/lib/apt/lists/*
  tar -C "$root/fs" -c . | docker import -c 'CMD ["/bin/bash"]' - nextstate-offline/debian:bookworm >/dev/null
  rm -rf "$root"; trap - EXIT
  say "nextstate-offline/debian:bookworm imported"
fi

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp "$here"/Dockerfile.* "$here"/redis-entrypoint.sh "$here"/s3_entrypoint.py "$ctx"/
cp "$CA_BUNDLE" "$ctx/ca-certificates.crt"
cp "$here/../lock/image-s3.txt" "$here/../lock/lock.py" "$ctx"/
build nextstate-offline/python:3.11 "$ctx" "$ctx/Dockerfile.python"
build nextstate-offline/redis:7.0 "$ctx" "$ctx/Dockerfile.redis"
build nextstate-offline/s3:latest "$ctx" "$ctx/Dockerfile.s3"

if ! have "nextstate-offline/torch-wheels:$TORCH_VERSION"; then
  dirs=${TORCH_WHEELS_DIR:-$(pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-} /opt/wheels}
  wheel=""
  for d in $dirs; do
    d=${d#file://}
    for w in "$d"/torch-"$TORCH_VERSION"+cpu-*.whl; do [ -f "$w" ] && { wheel=$w; break 2; }; done
  done
  [ -n "$wheel" ] || { say "no torch-$TORCH_VERSION+cpu wheel in: $dirs (set TORCH_WHEELS_DIR)"; exit 1; }
  wctx=$(mktemp -d); trap 'rm -rf "$ctx" "$wctx"' EXIT
  ln "$wheel" "$wctx/" 2>/dev/null || cp "$wheel" "$wctx/"
  printf 'FROM nextstate-offline/debian:bookworm\nCOPY *.whl /wheels/\n' >"$wctx/Dockerfile"
  build "nextstate-offline/torch-wheels:$TORCH_VERSION" "$wctx" "$wctx/Dockerfile"
fi
