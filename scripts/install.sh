#!/usr/bin/env bash
# Installs into the virtualenv of VENV_PYTHON with uv, or with pip where uv cannot be installed or fails.
# usage: scripts/install.sh VENV_PYTHON PIP_INSTALL_ARGUMENTS...
#
# uv resolves to the same packages as pip here and installs them on every core, in about half pip's time.
# uv reads no pip configuration, so pip's indexes, extra indexes, find-links (where the CPU build of torch
# lies) and constraint files are handed to it, and every index is searched for the best version, as pip does.
set -euo pipefail
py=$1
shift
venv=$(dirname "$(dirname "$py")")
UV_VERSION=0.13.9

# Every configuration file's settings, read once (`pip config get` misses some files: /etc/xdg/pip, for one).
pip_files=$("$py" -m pip config list 2>/dev/null || true)
pip_setting() {  # pip's value for an option: its environment variable, else its install section, else global
    local variable section value
    variable=PIP_$(tr 'a-z-' 'A-Z_' <<<"$1")
    if [ -n "${!variable:-}" ]; then echo "${!variable}"; return; fi
    for section in install global; do  # lines like global.find-links='/opt/wheels' (a Python repr)
        value=$(sed -n "s/^$section\.$1=//p" <<<"$pip_files" | head -1)
        if [ -n "$value" ]; then
            value=${value:1:-1}     # the repr's quotes
            echo "${value//\\n/ }"  # a list written on several lines: one item a line
            return
        fi
    done
}

# The second install (the test tools) finds uv already there.
if [ "$("$venv/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" = "$UV_VERSION" ] ||
    "$py" -m pip install -q "uv==$UV_VERSION" >/dev/null 2>&1; then
    options=(--index-strategy unsafe-best-match)
    index=$(pip_setting index-url)
    [ -z "$index" ] || options+=(--index-url "$index")
    for url in $(pip_setting extra-index-url); do options+=(--extra-index-url "$url"); done
    for place in $(pip_setting find-links); do options+=(--find-links "$place"); done
    for file in $(pip_setting constraint); do options+=(--constraints "$file"); done
    cert=$(pip_setting cert)
    [ -z "$cert" ] || export SSL_CERT_FILE=$cert
    # The cache beside the virtualenv, on its file system: files are linked, not copied, and go with it.
    if UV_CACHE_DIR=${UV_CACHE_DIR:-$venv/.uv-cache} "$venv/bin/uv" pip install -q --python "$py" "${options[@]}" "$@"; then
        exit 0
    fi
    echo "uv could not install $*; installing with pip" >&2
else
    echo "uv $UV_VERSION could not be installed; installing with pip" >&2
fi
"$py" -m pip install -q --no-compile "$@"
