#!/usr/bin/env bash
# Build every image docker-compose.yml needs on a machine that cannot pull
# from Docker Hub, from Debian's packages and a local torch wheel; nothing is
# downloaded but from the Debian mirror and the Python package registry.
#
#   deploy/local-images.sh              build what is missing, then the project image
#   deploy/local-images.sh --rebuild    build everything again
#   docker-compose --env-file deploy/local.env up      (what it prints at the end)
#
# Images (each skipped when it exists already):
#   pagedkv-base:bookworm          debootstrap --variant=minbase (python3, venv, pip), `docker import`
#   pagedkv-torch:<ver>-cpu        the base + /opt/venv holding the local CPU torch wheel; pip there
#                                  trusts the CA bundle this host's pip uses (the BASE_IMAGE of deploy/Dockerfile)
#   pagedkv-redis:bookworm         Debian's redis-server   (REDIS_IMAGE)
#   pagedkv-prometheus:bookworm    Debian's prometheus     (PROMETHEUS_IMAGE)
#   pagedkv:cpu                    deploy/Dockerfile on pagedkv-torch (always rebuilt: the layer
#                                  cache makes that seconds when only the code changed)
# and deploy/local.env, the compose settings that select them.
#
# Settings (environment): DOCKER_HOST (the engine; deploy/local-engine.sh starts one),
# DEBIAN_MIRROR (default: the first Debian URI in /etc/apt/sources.list*), DEBIAN_SUITE
# (bookworm), TORCH_VERSION (2.13.0), TORCH_WHEEL (a CPU torch wheel for the base's python,
# cp311; default: found in pip's find-links / local file indexes), PAGEDKV_IMAGE (pagedkv:cpu),
# PAGEDKV_LOCAL_ENV (where to write the compose settings; default deploy/local.env).
# Needs: root (debootstrap), docker, debootstrap (`apt-get install docker.io debootstrap`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

SUITE=${DEBIAN_SUITE:-bookworm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BASE=pagedkv-base:$SUITE
TORCH_BASE=pagedkv-torch:$TORCH_VERSION-cpu
REDIS=pagedkv-redis:$SUITE
PROMETHEUS=pagedkv-prometheus:$SUITE
IMAGE=${PAGEDKV_IMAGE:-pagedkv:cpu}
LOCAL_ENV=${PAGEDKV_LOCAL_ENV:-deploy/local.env}
REBUILD=""
case "${1:-}" in
  --rebuild) REBUILD=1 ;;
  "") ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: $0 [--rebuild]" >&2; exit 2 ;;
esac

T0=$SECONDS
say() { printf '[local-images %4ss] %s\n' $((SECONDS - T0)) "$*"; }
die() { say "error: $*" >&2; exit 1; }
trap 'say "error: line $LINENO: $BASH_COMMAND failed" >&2' ERR
exists() { [ -z "$REBUILD" ] && docker image inspect "$1" >/dev/null 2>&1; }
# build TAG DOCKER-BUILD-ARGS...: quiet unless it fails, then the end of its log
build() {
  local tag=$1 log; shift
  log=$(mktemp /tmp/pagedkv-build.XXXXXX)
  if ! docker build --network host -t "$tag" "$@" > "$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "building $tag failed (whole log: $log)"
  fi
  rm -f "$log"
}

command -v docker >/dev/null || die "no docker CLI (apt-get install docker.io)"
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
  || die "no Docker engine answers at ${DOCKER_HOST:-the default socket} (deploy/local-engine.sh start)"

# ------------------------------------------------------------------ base: debootstrap
debian_mirror() {
  [ -n "${DEBIAN_MIRROR:-}" ] && { echo "$DEBIAN_MIRROR"; return; }
  local uri
  uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i } /^deb / { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break } }' \
        | grep -E '/debian/?$' | head -n1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

if exists "$BASE"; then
  say "$BASE exists: skipped"
else
  command -v debootstrap >/dev/null || die "no debootstrap (apt-get install debootstrap)"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  mirror=$(debian_mirror)
  dir=$(mktemp -d /var/tmp/pagedkv-rootfs.XXXXXX)
  trap 'rm -rf "$dir"' EXIT
  say "$BASE: debootstrap $SUITE from $mirror (about a minute) ..."
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$SUITE" "$dir" "$mirror" > "$dir.log" 2>&1 || { tail -n 20 "$dir.log" >&2; die "debootstrap failed (log: $dir.log)"; }
  rm -f "$dir.log"
  # As Debian's own images do: no service starts inside a build, no package cache kept.
  printf '#!/bin/sh\nexit 101\n' > "$dir/usr/sbin/policy-rc.d" && chmod 755 "$dir/usr/sbin/policy-rc.d"
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$dir"; trap - EXIT
  say "$BASE: imported"
fi

# ------------------------------------------------------------------ torch base: the local wheel
find_torch_wheel() {
  if [ -n "${TORCH_WHEEL:-}" ]; then echo "$TORCH_WHEEL"; return; fi
  local dirs=() d f url
  for d in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do dirs+=("$d"); done
  for url in ${PIP_EXTRA_INDEX_URL:-} $(pip config get global.extra-index-url 2>/dev/null || true); do
    case "$url" in file://*) dirs+=("${url#file://}/torch");; esac
  done
  for d in "${dirs[@]}"; do
    for f in "$d"/torch-"$TORCH_VERSION"+cpu-cp311-cp311-*linux*_x86_64.whl; do
      [ -f "$f" ] && { echo "$f"; return; }
    done
  done
  return 0
}

if exists "$TORCH_BASE"; then
  say "$TORCH_BASE exists: skipped"
else
  wheel=$(find_torch_wheel)
  [ -n "$wheel" ] && [ -f "$wheel" ] || die "no local CPU wheel of torch $TORCH_VERSION for cp311 (set TORCH_WHEEL=/path/to/torch-...+cpu-cp311-...whl)"
  cert=${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}
  say "$TORCH_BASE: $BASE + /opt/venv + $(basename "$wheel") (its dependencies from the registry) ..."
  name=pagedkv-torch-build-$$
  mounts=(-v "$(dirname "$wheel"):/wheels:ro")
  [ -n "$cert" ] && [ -f "$cert" ] && mounts+=(-v "$cert:/host-ca.crt:ro")
  trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT
  docker run --name "$name" --network host "${mounts[@]}" "$BASE" sh -ec "
    mkdir -p /usr/local/share/pagedkv
    if [ -f /host-ca.crt ]; then
      cp /host-ca.crt /usr/local/share/pagedkv/pip-ca-bundle.crt
      printf '[global]\ncert = /usr/local/share/pagedkv/pip-ca-bundle.crt\n' > /etc/pip.conf
    fi
    python3 -m venv /opt/venv
    /opt/venv/bin/pip install -q --no-cache-dir --disable-pip-version-check '/wheels/$(basename "$wheel")'
    /opt/venv/bin/python -W ignore -c 'import torch; print(\"torch\", torch.__version__)'
  " || die "installing torch into $BASE failed"
  docker commit --change 'ENV VIRTUAL_ENV=/opt/venv' \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python"]' "$name" "$TORCH_BASE" >/dev/null
  docker rm "$name" >/dev/null; trap - EXIT
  say "$TORCH_BASE: committed"
fi

# ------------------------------------------------------------------ Redis and Prometheus from Debian
for pair in "$REDIS|deploy/local/redis.Dockerfile" "$PROMETHEUS|deploy/local/prometheus.Dockerfile"; do
  tag=${pair%|*} file=${pair#*|}
  if exists "$tag"; then
    say "$tag exists: skipped"
  else
    say "$tag: $file on $BASE (apt-get) ..."
    build "$tag" -f "$file" --build-arg "BASE_IMAGE=$BASE" deploy/local
    say "$tag: built"
  fi
done

# ------------------------------------------------------------------ the settings, then the project image
cat > "$LOCAL_ENV" <<EOF
# Written by deploy/local-images.sh: docker-compose --env-file $LOCAL_ENV up
# The images it built here, in place of the public ones; no Grafana (the
# profile stays off: no Grafana package reaches this machine).
PAGEDKV_BASE_IMAGE=$TORCH_BASE
PAGEDKV_BUILD_NETWORK=host
PAGEDKV_IMAGE=$IMAGE
REDIS_IMAGE=$REDIS
PROMETHEUS_IMAGE=$PROMETHEUS
COMPOSE_PROFILES=
EOF
say "wrote $LOCAL_ENV"

say "$IMAGE: deploy/Dockerfile on $TORCH_BASE (its dependencies from the registry) ..."
build "$IMAGE" -f deploy/Dockerfile --build-arg "BASE_IMAGE=$TORCH_BASE" .
say "$IMAGE: built"
say "done. Start the stack with: docker-compose --env-file $LOCAL_ENV up"
