#!/usr/bin/env bash
# Prepare the sandbox backends on a fresh Debian machine (run as root). Idempotent.
#
# 1. apt: bubblewrap (bwrap backend), python3-seccomp (its AF_INET filter),
#    docker.io + debootstrap (docker backend and its locally built image),
#    runsc (gVisor, registered with dockerd as the "runsc" runtime).
# 2. A PRIVATE dockerd: own data-root, exec-root and socket; "bridge": "none" and
#    "iptables": false so host networking is never touched.
# 3. The default image agentrl-sandbox:bookworm (debootstrap minbase + docker import),
#    built only when missing.
#
# Tests find the engine through the fixed socket $AGENTRL_DOCKER_SOCK (default
# /run/agentrl-docker.sock); the export line is also written to /run/agentrl-docker.env.
# Docker trouble never fails CI: the docker tests then skip with the printed reason.
# Stop the private daemon with: .ci/sandbox-setup.sh stop
set -u

SOCK=${AGENTRL_DOCKER_SOCK:-/run/agentrl-docker.sock}
DATA_ROOT=${AGENTRL_DOCKER_DATA:-/var/lib/agentrl-docker}
EXEC_ROOT=/run/agentrl-docker
PIDFILE=$EXEC_ROOT.pid
IMAGE=${AGENTRL_SANDBOX_IMAGE:-agentrl-sandbox:bookworm}
MIRROR=${AGENTRL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
log() { echo "[sandbox-setup] $*"; }

if [ "${1:-}" = stop ]; then
    [ -f "$PIDFILE" ] && kill "$(cat "$PIDFILE")" 2>/dev/null && log "stopped dockerd"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    log "not root: skipping apt and dockerd (bwrap/docker tests will report why they skip)"
    exit 0
fi

# --- 1. packages (skipped when all present) --------------------------------------
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v dockerd >/dev/null || need+=(docker.io)
/usr/bin/python3 -c 'import seccomp' 2>/dev/null || need+=(python3-seccomp)
command -v runsc >/dev/null || need+=(runsc)  # gVisor: the docker "gvisor" isolation
[ -e /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ] || [ "$(uname -m)" != x86_64 ] || need+=(libjemalloc2)  # tests/test_heap.py: another allocator preloaded
if [ ${#need[@]} -gt 0 ]; then
    log "apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null \
        || log "WARNING: apt-get install failed; the matching backends will be reported unavailable"
fi

# --- 2. private dockerd ------------------------------------------------------------
docker_ok() { timeout 10 docker -H "unix://$SOCK" info >/dev/null 2>&1; }
if ! command -v dockerd >/dev/null; then
    log "no dockerd: docker tests will skip"
    exit 0
fi
if ! docker_ok; then
    mkdir -p "$DATA_ROOT" "$EXEC_ROOT"
    cat >"$EXEC_ROOT.json" <<EOF
{"bridge": "none", "iptables": false, "ip6tables": false, "ip-forward": false,
 "ip-masq": false, "userland-proxy": false,
 "runtimes": {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--platform=ptrace", "--network=none"]}}}
EOF
    log "starting private dockerd on unix://$SOCK (log $EXEC_ROOT.log)"
    # setsid: the daemon outlives this script; it is not tied to the CI shell.
    setsid dockerd --config-file "$EXEC_ROOT.json" --data-root "$DATA_ROOT" --exec-root "$EXEC_ROOT" \
        --pidfile "$PIDFILE" -H "unix://$SOCK" >"$EXEC_ROOT.log" 2>&1 </dev/null &
    for _ in $(seq 1 60); do docker_ok && break; sleep 0.5; done
    if ! docker_ok; then
        log "WARNING: dockerd did not come up; docker tests will skip. Last log lines:"
        tail -5 "$EXEC_ROOT.log" 2>/dev/null
        exit 0
    fi
fi
echo "export DOCKER_HOST=unix://$SOCK" >/run/agentrl-docker.env

# --- 3. default image --------------------------------------------------------------
if docker -H "unix://$SOCK" image inspect "$IMAGE" >/dev/null 2>&1; then
    log "image $IMAGE present"
else
    log "building $IMAGE with debootstrap (about a minute)"
    root=$(mktemp -d /var/tmp/agentrl-rootfs.XXXXXX)
    if debootstrap --variant=minbase --include=python3 bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
        && tar -C "$root" -c . | docker -H "unix://$SOCK" import \
            -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            -c 'USER 65534:65534' -c 'WORKDIR /work' - "$IMAGE" >/dev/null; then
        log "built $IMAGE"
    else
        log "WARNING: image build failed (see $root.log); docker tests will skip"
    fi
    rm -rf "$root"
fi
log "DOCKER_HOST=unix://$SOCK"
