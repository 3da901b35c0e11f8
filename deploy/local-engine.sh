#!/usr/bin/env bash
# A private Docker engine, for a machine that has Debian's docker.io but no
# running engine (no systemd): started as root with its own directories and
# socket, and stopped by its pid file. The compose test (tests/compose/) and
# deploy/local-images.sh use it; so can you:
#
#   deploy/local-engine.sh start     start it (or find it running); prints DOCKER_HOST=...
#   export DOCKER_HOST=unix:///run/pagedkv-docker/docker.sock
#   deploy/local-engine.sh stop      stop it (its containers stop with it; images stay)
#   deploy/local-engine.sh status
#
# How it runs: `dockerd --iptables=false --ip-masq=false --bridge=none`, so it
# leaves the host's firewall alone and makes no docker0 (it cannot clash with
# another engine's). Containers talk over the networks compose creates (by
# service name); published ports reach the host through docker-proxy (the
# userland proxy, on by default), with iptables off too; containers get no
# route out (no masquerading), which the stack does not need. Image builds
# run on the host's network (`docker build --network host`).
#
# Settings: PAGEDKV_DOCKER_ROOT (/var/lib/pagedkv-docker: images and volumes,
# kept between runs), PAGEDKV_DOCKER_RUN (/run/pagedkv-docker: socket, pid file,
# log dockerd.log).
set -euo pipefail
DATA=${PAGEDKV_DOCKER_ROOT:-/var/lib/pagedkv-docker}
RUN=${PAGEDKV_DOCKER_RUN:-/run/pagedkv-docker}
SOCK=$RUN/docker.sock
PIDFILE=$RUN/dockerd.pid
LOG=$RUN/dockerd.log
export DOCKER_HOST=unix://$SOCK

answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }
running_pid() {
  local pid
  pid=$(cat "$PIDFILE" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

case "${1:-}" in
  start)
    if answers; then
      echo "engine already running at $DOCKER_HOST"
      echo "DOCKER_HOST=$DOCKER_HOST"
      exit 0
    fi
    [ "$(id -u)" = 0 ] || { echo "error: the engine needs root" >&2; exit 1; }
    command -v dockerd >/dev/null || { echo "error: no dockerd (apt-get install docker.io)" >&2; exit 1; }
    command -v docker >/dev/null || { echo "error: no docker CLI (apt-get install docker.io)" >&2; exit 1; }
    mkdir -p "$DATA" "$RUN"
    rm -f "$SOCK"
    # setsid: the engine outlives this script and its caller's process group
    setsid dockerd --data-root "$DATA/data" --exec-root "$RUN/exec" -H "unix://$SOCK" --pidfile "$PIDFILE" \
      --iptables=false --ip-masq=false --bridge=none > "$LOG" 2>&1 < /dev/null &
    for _ in $(seq 1 60); do
      if answers; then
        echo "engine started at $DOCKER_HOST (pid $(cat "$PIDFILE"), data $DATA, log $LOG)"
        echo "DOCKER_HOST=$DOCKER_HOST"
        exit 0
      fi
      kill -0 $! 2>/dev/null || break
      sleep 0.5
    done
    echo "error: the engine did not start; the end of $LOG:" >&2
    tail -n 15 "$LOG" >&2 || true
    pid=$(running_pid) && kill "$pid" 2>/dev/null || true
    exit 1
    ;;
  stop)
    if ! pid=$(running_pid); then
      echo "engine not running"
      exit 0
    fi
    kill "$pid"
    for _ in $(seq 1 60); do
      if ! kill -0 "$pid" 2>/dev/null; then
        # dockerd leaves its handle on the host's network namespace mounted
        umount "$RUN/exec/netns/default" 2>/dev/null || true
        echo "engine stopped (pid $pid)"
        exit 0
      fi
      sleep 0.5
    done
    echo "error: the engine (pid $pid) did not stop within 30 s" >&2
    exit 1
    ;;
  status)
    if answers; then echo "running at $DOCKER_HOST"; else echo "not running"; exit 3; fi
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
