#!/usr/bin/env bash
# Install EdgeMesh on a Raspberry Pi OS (64-bit, Bookworm or later) or other Debian host
# and enable the systemd units of the chosen roles. Safe to run again: it upgrades the
# package, refreshes the units, keeps /etc/edgemesh as edited and restarts running units.
#
#   sudo deploy/install-pi.sh SOURCE ROLE [ROLE...]
#
# See usage() below and deploy/README.md.
set -euo pipefail

PREFIX=/opt/edgemesh
VENV="$PREFIX/venv"
ETC=/etc/edgemesh
UNIT_DIR=/etc/systemd/system
SERVICE_USER=edgemesh
STATE_HOME=/var/lib/edgemesh
# CPU wheels of this version exist for aarch64 (64-bit Pi OS) and x86_64.
DEFAULT_TORCH="torch==2.9.1"
DEVICE_NAME_RE='^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
    cat <<EOF
Usage: $(basename "$0") [options] SOURCE ROLE [ROLE...]

Install EdgeMesh into $VENV and enable its systemd units.

  SOURCE   what pip installs: a checkout directory, a wheel or sdist, or a URL
           (e.g. git+https://example.com/edgemesh.git@v0.1.0)
  ROLE     planner | ps | compressor | worker | services (= planner ps compressor)
           | ps@I: shard I of a parameter server split into ps.shards processes
             (edgemesh-ps@I.service; set job and ps.shards in edgemesh.toml first)

Options:
  --device NAME   device name of the worker (default: the short host name)
  --torch SPEC    torch requirement installed first (default: $DEFAULT_TORCH;
                  'skip' leaves torch as it is)
  --start         start (or restart) the units now; by default they are only enabled,
                  so you can edit $ETC/edgemesh.toml and edgemesh.env first
  -h, --help      show this help

Example: sudo $(basename "$0") --device pi-07 ~/edgemesh worker
EOF
}

die_usage() {
    echo "error: $*" >&2
    usage >&2
    exit 2
}

log() { echo "==> $*"; }

# --- arguments (checked before anything is changed) ------------------------------------

DEVICE=""
TORCH="$DEFAULT_TORCH"
START=0
POSITIONAL=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --device) [[ $# -ge 2 ]] || die_usage "--device needs a value"; DEVICE="$2"; shift 2 ;;
        --device=*) DEVICE="${1#*=}"; shift ;;
        --torch) [[ $# -ge 2 ]] || die_usage "--torch needs a value"; TORCH="$2"; shift 2 ;;
        --torch=*) TORCH="${1#*=}"; shift ;;
        --start) START=1; shift ;;
        --) shift; POSITIONAL+=("$@"); break ;;
        -*) die_usage "unknown option $1" ;;
        *) POSITIONAL+=("$1"); shift ;;
    esac
done
[[ ${#POSITIONAL[@]} -ge 2 ]] || die_usage "need a SOURCE and at least one ROLE"
SOURCE="${POSITIONAL[0]}"
ROLES=()
for role in "${POSITIONAL[@]:1}"; do
    case "$role" in
        planner|ps|compressor|worker) ROLES+=("$role") ;;
        ps@[0-9]|ps@[1-9][0-9]) ROLES+=("$role") ;;
        services) ROLES+=(planner ps compressor) ;;
        *) die_usage "unknown role '$role'" ;;
    esac
done
[[ -n "$TORCH" ]] || die_usage "--torch needs a value"

UNITS=()
for role in "${ROLES[@]}"; do
    if [[ "$role" == worker ]]; then
        DEVICE="${DEVICE:-$(hostname -s)}"
        [[ "$DEVICE" =~ $DEVICE_NAME_RE ]] \
            || die_usage "device name '$DEVICE': use 1-64 characters of A-Z a-z 0-9 _ . -"
        unit="edgemesh-worker@$DEVICE.service"
    else
        unit="edgemesh-$role.service"
    fi
    [[ " ${UNITS[*]} " == *" $unit "* ]] || UNITS+=("$unit")
done

# --- checks -----------------------------------------------------------------------------

if [[ $EUID -ne 0 ]]; then
    echo "error: run as root (sudo $0 ...)" >&2
    exit 1
fi
for f in systemd/edgemesh-planner.service systemd/edgemesh-ps.service systemd/edgemesh-ps@.service \
         systemd/edgemesh-compressor.service systemd/edgemesh-worker@.service \
         edgemesh.example.toml edgemesh.example.env; do
    [[ -f "$SCRIPT_DIR/$f" ]] || { echo "error: $SCRIPT_DIR/$f is missing; run the script from an EdgeMesh checkout" >&2; exit 1; }
done
ARCH="$(uname -m)"
case "$ARCH" in
    aarch64|x86_64) ;;
    *)
        echo "error: no torch wheels for $ARCH; install the 64-bit Raspberry Pi OS (a Pi 3 runs it)" >&2
        exit 1 ;;
esac

# --- system packages ----------------------------------------------------------------------

if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: EdgeMesh needs Python 3.11 or later (Raspberry Pi OS Bookworm has it)" >&2
    exit 1
fi
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    log "installing python3-venv"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv
fi

# --- user and directories -------------------------------------------------------------------

if ! getent passwd "$SERVICE_USER" >/dev/null; then
    log "creating system user $SERVICE_USER"
    useradd --system --user-group --home-dir "$STATE_HOME" --no-create-home \
        --shell /usr/sbin/nologin --comment "EdgeMesh services" "$SERVICE_USER"
fi
install -d -m 0755 -o root -g root "$PREFIX"
install -d -m 0750 -o root -g "$SERVICE_USER" "$ETC"

# --- Python environment ------------------------------------------------------------------------

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip

if [[ "$TORCH" != skip ]]; then
    # torch first, so the project's "torch>=..." requirement is already met. On aarch64
    # PyPI's torch wheels are the CPU build; on x86_64 PyPI's carry CUDA (gigabytes), so
    # take the CPU build from the PyTorch index instead.
    log "installing $TORCH ($ARCH)"
    if [[ "$ARCH" == x86_64 ]]; then
        "$VENV/bin/pip" install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "$TORCH"
    else
        "$VENV/bin/pip" install --no-cache-dir "$TORCH"
    fi
fi

log "installing EdgeMesh from $SOURCE"
"$VENV/bin/pip" install --no-cache-dir --upgrade "$SOURCE"
"$VENV/bin/edgemesh" --help >/dev/null

# --- configuration (kept when present) -------------------------------------------------------

install -d -m 0755 "$PREFIX/deploy"
cp -a "$SCRIPT_DIR/." "$PREFIX/deploy/"
if [[ ! -e "$ETC/edgemesh.toml" ]]; then
    log "writing $ETC/edgemesh.toml from the example: edit it before starting"
    install -m 0640 -o root -g "$SERVICE_USER" "$SCRIPT_DIR/edgemesh.example.toml" "$ETC/edgemesh.toml"
fi
if [[ ! -e "$ETC/edgemesh.env" ]]; then
    log "writing $ETC/edgemesh.env (broker credentials go here)"
    install -m 0640 -o root -g "$SERVICE_USER" "$SCRIPT_DIR/edgemesh.example.env" "$ETC/edgemesh.env"
fi
if ! "$VENV/bin/edgemesh" config --config "$ETC/edgemesh.toml" >/dev/null; then
    echo "warning: $ETC/edgemesh.toml does not load; fix it before starting the units" >&2
fi

# --- systemd units ---------------------------------------------------------------------------------

log "installing systemd units"
install -m 0644 "$SCRIPT_DIR"/systemd/*.service "$UNIT_DIR/"
systemctl daemon-reload
for unit in "${UNITS[@]}"; do
    systemctl enable "$unit"
    if [[ $START -eq 1 ]]; then
        log "starting $unit"
        systemctl restart "$unit"
    else
        # an upgrade: restart what already runs, start nothing new
        systemctl try-restart "$unit"
    fi
done

log "done. Units: ${UNITS[*]}"
if [[ $START -eq 0 ]]; then
    echo "    Edit $ETC/edgemesh.toml and $ETC/edgemesh.env, then: systemctl start ${UNITS[*]}"
fi
echo "    Logs: journalctl -u '${UNITS[0]}' -f"
