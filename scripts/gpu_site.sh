# Sourced by the GPU check scripts, from the repo root on a fresh CUDA box: installs what .whl/ carries
# (scripts/gpu_bundle.sh: wheels for Python 3.12, the TileLang bundle) into /tmp/dk_site, offline, puts
# deepinfer_kernels there through a symlink, and exports PYTHONPATH, TileLang's cache directory and
# unbuffered Python output. Returns non-zero if an install fails.
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/dk_tilelang_cache
SITE=/tmp/dk_site
mkdir -p "$SITE"
ln -sfn "$PWD/kernels" "$SITE/deepinfer_kernels"
shopt -s nullglob
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || return 1
for t in .whl/*.tar.xz; do tar -xJf "$t" -C "$SITE" || return 1; done
export PYTHONPATH="$SITE:$PWD"
