# The two commands a newcomer needs: `make demo` and `make test` (both idempotent).
# The venv's Python: 3.11 (numpy<1.24, which MXNet 1.9.1 needs, has no wheels for 3.12+):
# python3.11 from PATH, or the one named by PYTHON=... (used as given).
PYTHON ?= $(shell command -v python3.11 2>/dev/null)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-fast test-emulated bench bench-step bench-docs selftest docs pictures wheel clean

$(STAMP): setup.py
	@test -x $(PY) || test -n "$(PYTHON)" || { \
	  echo "make: Python 3.11 is needed to create $(VENV) (numpy<1.24, which MXNet 1.9.1" \
	       "needs, has no wheels for Python 3.12+), and python3.11 is not on PATH." >&2; \
	  echo "make: install Python 3.11 (e.g. pyenv install 3.11) or name one:" \
	       "make $(or $(MAKECMDGOALS),test) PYTHON=/path/to/python3.11" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test,plot,example,onnx,docs]"
	# onnxruntime declares numpy>=1.24.2 (mxnet 1.9.1 needs <1.24); 1.16.3 runs with 1.23.5.
	# Its other requirements are not needed to import and run it (docs/installing.md).
	$(PY) -m pip install -q --no-deps onnxruntime==1.16.3
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m example_rcnn.demo

# Full suite on the default CPU kernels (native for every op: MX_ROI_BACKEND unset), two
# test files at a time (pytest-xdist: a file's tests stay in one process), then the op
# suite again on each other CPU backend, two workers each.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests
	MX_ROI_BACKEND=numpy $(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" tests/ops
	MX_ROI_BACKEND=emulated-cuda $(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" tests/ops

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

bench: $(STAMP)
	$(PY) -m mx_roi.bench

bench-step: $(STAMP)
	$(PY) -m mx_roi.bench --step

selftest: $(STAMP)
	$(PY) -m mx_roi.selftest

# The API reference (docs/api: autodoc of the docstrings, the op tables from the registry),
# warnings as errors; HTML in build/docs.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs/api build/docs

# The sampling pictures in docs/ (drawn from the geometry tables; needs the plot extra).
pictures: $(STAMP)
	$(PY) -m mx_roi.viz.regenerate docs

# The benchmark page's tables: python -m mx_roi.bench --markdown on this machine at this
# commit, written into docs/benchmarks.md between its markers.  BENCH_ARGS picks the run
# (the published tables: --threads default,1,all on a quiet machine, several minutes).
# BENCH_NOTE: a sentence about the run, printed with it (read from the environment, never
# through the shell).
BENCH_ARGS ?= --threads default,1,all
export BENCH_NOTE
bench-docs: $(STAMP)
	$(PY) tools/bench_docs.py docs/benchmarks.md $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
