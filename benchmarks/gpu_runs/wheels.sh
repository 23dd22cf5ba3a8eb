#!/usr/bin/env bash
# The pure-Python wheels the H200 image lacks for the GPU runs (papermill and a Jupyter kernel
# for remote_x2.sh's notebook 02; uvicorn & co. for serve_bench.py), downloaded here into the
# ignored folders the device tool carries (.whl, build/serve_wheels). Run once from the repo root:
#   bash benchmarks/gpu_runs/wheels.sh      (then carry .carry .whl build/serve_wheels)
# On the GPU machine, after shared/gpu/README.md's unpack line:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl
#   python3 -c "import glob,zipfile,importlib.util as u;[zipfile.ZipFile(w).extractall('/tmp/serve_extra') for w in sorted(glob.glob('build/serve_wheels/*.whl')) if u.find_spec(w.split('/')[-1].split('-')[0]) is None]"
#   export PYTHONPATH=/tmp/site:$PWD:/tmp/serve_extra
set -eu
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" "${@:2}"; }
grep -qx "/.whl/" .git/info/exclude || echo "/.whl/" >> .git/info/exclude
get .whl asttokens==3.0.2 comm==0.2.3 entrypoints==0.4.2 executing==2.3.0 fastjsonschema==2.22.3 \
  ipykernel==7.4.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 ipywidgets==8.1.9 \
  jupyter_client==8.10.0 jupyter_core==5.9.1 jupyterlab_widgets==3.0.17 matplotlib_inline==0.2.2 \
  nbclient==0.11.0 nbformat==5.11.1 nest_asyncio2==1.7.4 papermill==2.7.0 pexpect==4.9.0 \
  platformdirs==4.14.8 prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4 \
  stack_data==0.6.3 tenacity==9.2.1 tornado==6.6.1 traitlets==5.16.1 wcwidth==0.9.4
get build/serve_wheels uvicorn==0.54.0 click==8.5.1 h11==0.16.0 anyio==4.16.0 idna==3.20 \
  annotated-doc==0.0.7
