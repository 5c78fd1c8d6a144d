#!/usr/bin/env bash
# Chromium for the viewer's browser tests (tests/viewer/test_browser.py), on a fresh Debian
# machine. Idempotent. The tests drive /usr/bin/chromium with the python `playwright`
# package (a dev extra, installed by `make install`); `playwright install` downloads its
# own browsers and is never used. Where chromium cannot be installed (not root, no apt),
# this says why and exits 1; the browser tests then skip with the reason.
set -u
log() { echo "[browser-setup] $*"; }
CHROMIUM=${AGENTRL_CHROMIUM:-/usr/bin/chromium}

if [ ! -x "$CHROMIUM" ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""
    elif sudo -n true 2>/dev/null; then SUDO="sudo -n"
    else
        log "no $CHROMIUM and not root (nor passwordless sudo): apt-get install chromium by hand"
        exit 1
    fi
    if ! command -v apt-get >/dev/null; then
        log "no apt-get here: install chromium (or point AGENTRL_CHROMIUM at a Chrome) by hand"
        exit 1
    fi
    log "apt-get install chromium"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q >/dev/null \
        && $SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >/dev/null \
        || { log "apt-get install chromium failed"; exit 1; }
fi

# It must start headless here: this machine's closed network refuses what it would fetch
# at start-up without these flags.
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
if timeout 60 "$CHROMIUM" --headless --no-sandbox --disable-gpu --user-data-dir="$profile" \
        --disable-background-networking --disable-component-update --disable-sync --no-first-run \
        --dump-dom 'data:text/html,<p id=ok>ok</p>' 2>/dev/null | grep -q 'id="ok"'; then
    log "$("$CHROMIUM" --version 2>/dev/null | head -1) starts headless"
else
    log "$CHROMIUM is installed but did not start headless"
    exit 1
fi
