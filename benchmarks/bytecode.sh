# Source this before timing processes on a host whose Python packages have no byte code (.pyc) of their own,
# as the GPU host's torch venv: there every process compiles the modules it imports from source (seconds per
# process, and seconds of the first torch.compile, which imports most of dynamo and Inductor). A `pip install`
# leaves .pyc beside every module, so those seconds are not what a user's worker pays: this writes them once
# under a cache prefix (PYTHONPYCACHEPREFIX; the packages' own directories stay untouched) and exports the
# prefix for every process started after it. Prints what it did in one line.
#   source benchmarks/bytecode.sh        # from the checkout's root; PYC_PREFIX=/tmp/spec-serve-pyc by default
_site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
if [ -z "$_site" ]; then
  echo "bytecode: python3 has no torch; nothing to do"
elif ls "$_site"/torch/__pycache__/__init__.*.pyc >/dev/null 2>&1; then
  echo "bytecode: $_site has its own .pyc; nothing to do"
else
  export PYTHONPYCACHEPREFIX=${PYC_PREFIX:-/tmp/spec-serve-pyc}
  _started=$SECONDS
  python3 -m compileall -q -j 0 "$_site" spec_serve >/dev/null 2>&1
  echo "bytecode: compiled $_site into $PYTHONPYCACHEPREFIX in $((SECONDS - _started)) s (it had no .pyc)"
fi
unset _site _started
