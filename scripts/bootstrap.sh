#!/usr/bin/env bash
# Make a Debian 12 machine ready for this project. Safe to re-run: it only does what is missing.
#
#   ./scripts/bootstrap.sh           .venv with the project, its MPI (PyPI MPICH) and dev tools
#   ./scripts/bootstrap.sh --system  also the Debian packages the tests drive for real
#                                    (Docker, Slurm, munge, ...); needs root or sudo
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
# An exact pin, because PyPI's plain "torch" is the multi-GB CUDA build. Machines of this kind
# keep the CPU wheel (2.13.0+cpu) in their local pip find-links, and "==2.13.0" matches it.
# Elsewhere: TORCH_SPEC=... or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# What the tests start or call for real (no mocks); python3-venv for the .venv itself.
SYSTEM_PACKAGES=(
    python3-venv
    docker.io docker-compose debootstrap docker-registry
    slurm-wlm munge
    # Slurm's mpi/pmix plugin dlopens libpmix.so (slurmd must start after it is installed)
    libpmix2 libpmix-dev
    # an HPC container runtime of Apptainer's kind (no daemon, host network and PIDs)
    charliecloud-runtime charliecloud-builders
    # `invoke sif` without Apptainer: the SIF tool of sylabs/sif, mksquashfs; squashfuse mounts
    # the SIF's system partition for ch-run
    siftool squashfs-tools squashfuse
    shellcheck openssh-client
    # benchmarks.recorder_instructions counts instructions under callgrind
    valgrind
)

die() {
    echo "bootstrap: error: $1" >&2
    echo "HINT: $2" >&2
    exit 2
}

install_system_packages() {
    local missing=() pkg
    for pkg in "${SYSTEM_PACKAGES[@]}"; do
        if [[ $(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null) != installed ]]; then
            missing+=("$pkg")
        fi
    done
    if ((${#missing[@]} == 0)); then
        echo "bootstrap: Debian packages present"
        return
    fi
    local sudo=()
    if ((EUID != 0)); then
        command -v sudo >/dev/null ||
            die "installing ${missing[*]} needs root" "run it as root: su -c './scripts/bootstrap.sh --system'"
        sudo=(sudo)
    fi
    echo "bootstrap: installing ${missing[*]}"
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq -o Dpkg::Use-Pty=0 "${missing[@]}" </dev/null
}

# the stamp records what the venv was built from, so that a re-run with nothing changed is quick
venv_stamp() {
    { "$PYTHON" --version; echo "$TORCH_SPEC"; cat "$ROOT/pyproject.toml"; } | sha256sum
}

# from / so that the checkout's own launcher/ cannot stand in for the editable install
IMPORTABLE='import importlib.util as u, sys
sys.exit(not all(map(u.find_spec, ["launcher", "torch", "mpi4py", "pytest"])))'

make_venv() {
    command -v "$PYTHON" >/dev/null ||
        die "$PYTHON not found" "apt-get install python3 python3-venv (or: ./scripts/bootstrap.sh --system)"
    "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null ||
        die "$PYTHON cannot create virtual environments (no ensurepip)" \
            "apt-get install python3-venv (or: ./scripts/bootstrap.sh --system)"
    local stamp
    stamp=$(venv_stamp)
    if [[ -f $VENV/.bootstrap-stamp && $(<"$VENV/.bootstrap-stamp") == "$stamp" ]] &&
        (cd / && "$VENV/bin/python" -c "$IMPORTABLE" 2>/dev/null); then
        echo "bootstrap: $VENV up to date"
        return
    fi
    [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
    echo "bootstrap: installing the project into $VENV ($TORCH_SPEC)"
    "$VENV/bin/python" -m pip install --quiet --progress-bar off \
        -e "${ROOT}[mpich,tasks,dev]" "$TORCH_SPEC"
    echo "$stamp" >"$VENV/.bootstrap-stamp"
}

# --backend mpi compiled (launcher/mpi/cxx.py): built once per source and torch version; without
# a compiler, or if it fails, the Python implementation runs instead (launcher.check says which).
# The same step builds the padding of MPICH's UCX address for Slurm's pmi2 (ucx_address.py)
build_mpi_backend() {
    if ! command -v "${CXX:-c++}" >/dev/null; then
        echo "bootstrap: no C++ compiler: --backend mpi will run its Python implementation," \
            "and MPICH's UCX address goes unpadded under srun --mpi=pmi2 (apt-get install g++," \
            "then re-run)"
        return
    fi
    (cd / && "$VENV/bin/python" -m launcher.mpi.cxx) ||
        echo "bootstrap: warning: not everything compiled (its error above says what runs" \
            "instead; details: $VENV/bin/python -m launcher.mpi.cxx --verbose)"
}

(($# <= 1)) || die "too many arguments: $*" "./scripts/bootstrap.sh [--system]"
case ${1:-} in
    "") ;;
    --system) install_system_packages ;;
    -h | --help)
        sed -n '2,6s/^# \{0,1\}//p' "$0"
        exit 0
        ;;
    *) die "unknown option '$1'" "./scripts/bootstrap.sh [--system]" ;;
esac
make_venv
build_mpi_backend
