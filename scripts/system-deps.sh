#!/bin/sh
# Install the system tools the test suite uses when they are missing: redis-server (shared run
# state tests) and promtool (metrics and alert-rule checks). Debian packages; root in CI.
set -e
missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: missing:$missing (install them; tests that need them will fail in CI)" >&2
    exit 0
fi
echo "system-deps: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends $missing >/dev/null
# the Debian package starts a system redis; tests run their own on loopback ports
(service redis-server stop >/dev/null 2>&1 || true)
