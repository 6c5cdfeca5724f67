#!/usr/bin/env bash
# The tests that exercise transformers' private APIs and generate, on the lowest supported
# transformers (pyproject.toml's lower bound), in .venv-lowest: .venv's packages (from
# scripts/test.sh) with only transformers replaced. scripts/test.sh runs it after the
# whole suite on the highest supported release. Arguments, if any, replace the test list.
# TRANSFORMERS_LOWEST overrides the release; MAIN_VENV and LOWEST_VENV the environments.
set -euo pipefail
cd "$(dirname "$0")/.."
LOWEST=${TRANSFORMERS_LOWEST:-5.23.0}
MAIN=${MAIN_VENV:-.venv}
VENV=${LOWEST_VENV:-.venv-lowest}
[ -x "$VENV/bin/python" ] || "$MAIN/bin/python" -m venv --without-pip "$VENV"
PYTHONPATH= "$MAIN/bin/python" -m pip --python "$VENV/bin/python" install --quiet --no-deps "transformers==$LOWEST"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
# the main environment's packages after the lowest transformers (a .pth line is appended to sys.path)
"$MAIN/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))" > "$site/zz_main_venv.pth"
"$VENV/bin/python" -c "import transformers; assert transformers.__version__ == '$LOWEST', transformers.__version__"
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_private_api.py tests/test_generation_options.py tests/test_fused_layers.py tests/test_decode_forward.py
                                tests/test_processors.py)
PYTHONPATH="$PWD" exec "$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider "${tests[@]}"
