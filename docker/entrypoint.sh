#!/usr/bin/env bash
# Entrypoint of the lab image, run after NVIDIA's: JupyterLab never starts without a token (no open notebook
# server); any other command (nvlab run, nvlab doctor, the GPU exporter, a shell) runs as given.
set -euo pipefail

starts_jupyter() {
  case "${1:-}" in
    jupyter | jupyter-lab | jupyter-notebook) return 0 ;;
    nvlab) [ "${2:-}" = lab ] ;;
    *) return 1 ;;
  esac
}

if starts_jupyter "$@"; then
  if [ -z "${JUPYTER_TOKEN:-}" ]; then
    echo "nvlab: JUPYTER_TOKEN is not set: refusing to start an open notebook server." >&2
    echo "nvlab: set it to a long random string, e.g. JUPYTER_TOKEN=\$(openssl rand -hex 24), and start again." >&2
    exit 64
  fi
  if [ "${#JUPYTER_TOKEN}" -lt 16 ]; then
    echo "nvlab: JUPYTER_TOKEN has ${#JUPYTER_TOKEN} characters: use at least 16 (e.g. openssl rand -hex 24)." >&2
    exit 64
  fi
fi

repo="${NVLAB_MODEL_REPOSITORY:-}"
if [ -n "$repo" ] && [ -d "$repo" ] && [ ! -w "$repo" ]; then
  echo "nvlab: warning: the model repository $repo is not writable by UID $(id -u): lab 04 cannot add models." >&2
  echo "nvlab: build the image with NVLAB_UID/NVLAB_GID of the folder's owner, or fix the volume's ownership." >&2
fi

exec "$@"
