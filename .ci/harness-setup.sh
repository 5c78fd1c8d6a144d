#!/usr/bin/env bash
# The real agent harnesses the proxy's tests run unmodified (tests/proxy/test_real_harnesses.py):
# Claude Code and Codex CLI from npm, into $VENV/harnesses, linked into $VENV/bin as `claude`
# and `codex`. Node and npm come from Debian where they are missing. Idempotent: a stamp names
# the installed versions. Where they cannot be installed, this says why and exits 1; those
# tests then skip with the reason. Usage: harness-setup.sh VENV
set -u
log() { echo "[harness-setup] $*"; }
VENV=${1:-.venv}
# The versions the tests were written against; AGENTRL_HARNESS_NPM overrides them.
PACKAGES=${AGENTRL_HARNESS_NPM:-"@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0"}
DIR="$VENV/harnesses"
STAMP="$DIR/.installed"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PACKAGES" ] && [ -x "$VENV/bin/claude" ] && [ -x "$VENV/bin/codex" ]; then
    exit 0
fi
if ! command -v npm >/dev/null; then
    if [ "$(id -u)" = 0 ]; then SUDO=""
    elif sudo -n true 2>/dev/null; then SUDO="sudo -n"
    else log "no npm and not root (nor passwordless sudo): apt-get install nodejs npm by hand"; exit 1
    fi
    command -v apt-get >/dev/null || { log "no npm and no apt-get: install Node.js and npm by hand"; exit 1; }
    log "apt-get install nodejs npm"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q >/dev/null \
        && $SUDO apt-get install -y -q --no-install-recommends nodejs npm >/dev/null \
        || { log "apt-get install nodejs npm failed"; exit 1; }
fi
mkdir -p "$DIR"
log "npm install $PACKAGES"
# Claude Code's postinstall copies its native binary out of the platform's optional package.
if ! npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error $PACKAGES >/dev/null; then
    log "npm install failed"
    exit 1
fi
for cli in claude codex; do
    ln -sf "$(cd "$DIR/node_modules/.bin" && pwd)/$cli" "$VENV/bin/$cli"
    "$VENV/bin/$cli" --version >/dev/null 2>&1 || { log "$cli is installed but does not run"; exit 1; }
done
echo "$PACKAGES" > "$STAMP"
log "claude $("$VENV/bin/claude" --version 2>/dev/null | head -1), codex $("$VENV/bin/codex" --version 2>/dev/null | head -1)"
