# Two commands from a fresh clone (Python >= 3.10 and pip are all you need):
#   make demo   -- install into .venv and run the main job (Flow-GRPO in the shapes world, docs/shapes.md)
#   make test   -- install into .venv and run the test suite (all of it: the tier CI runs)
#   make test-fast -- the tests not marked slow (a quick tier: no multi-process, killed-run or long learning runs)
# torch and torchvision are installed first with TORCH_SPEC; override it for your platform or CUDA version, e.g.
#   make test TORCH_SPEC="torch torchvision --index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# Every modality's extra (the demo needs mmrl[flow], the test suite all of them) and the test tools.
EXTRAS ?= all,dev
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mmrl-installed
# The tests run in TEST_WORKERS pytest-xdist processes (2, the CI machine's cores; 0 runs them in this process). Each
# worker keeps torch's own thread count, so `make test` still runs the multi-threaded native kernels; worksteal hands
# a finished worker tests from the other's queue, so one long test file does not leave a core idle at the end.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

.PHONY: install demo demo-edit demo-vlm shapes toy test test-fast lint clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -c 'import sys; sys.exit("mmrl needs Python >= 3.10, found " + sys.version.split()[0]) if sys.version_info < (3, 10) else None'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

# The main job, the shapes world (docs/shapes.md): Flow-GRPO on a tiny text-to-image model, offline on the CPU,
# then the report (score per task before/after, image grids, reward curve in runs/flow/shapes).
# run.resume=latest: a second `make demo` continues (or, finished, only re-reports) the run instead of being refused.
demo: install
	$(VENV)/bin/mmrl train configs/flow/shapes.yaml run.resume=latest
	$(PY) -m mmrl.plugins.flow.shapes.report runs/flow/shapes

shapes: demo

# The edit world (docs/shapes.md#the-edit-world): Flow-GRPO image editing on a tiny FLUX.1 Kontext model, offline on
# the CPU, then the report (score per kind of edit before/after, input|edit grids, reward curve in runs/flow/shapes_edit).
demo-edit: install
	OMP_NUM_THREADS=1 $(VENV)/bin/mmrl train configs/flow/shapes_edit.yaml run.resume=latest
	$(PY) -m mmrl.plugins.flow.shapes.report runs/flow/shapes_edit

# The grounding world (docs/vlm.md): GRPO on the bundled tiny Qwen2.5-VL, offline on the CPU, then the report
# (held-out score per question kind before/after, box grid, reward curve in runs/vlm/grounding).
demo-vlm: install
	OMP_NUM_THREADS=1 $(PY) -m mmrl.plugins.vlm.grounding.world runs/vlm/grounding-data
	OMP_NUM_THREADS=1 $(VENV)/bin/mmrl train configs/vlm/grounding.yaml run.resume=latest
	$(PY) -m mmrl.plugins.vlm.grounding.report runs/vlm/grounding

# The reference plugin: GRPO on digit reversal, about a minute on a CPU.
toy: install
	$(VENV)/bin/mmrl train configs/toy.yaml run.resume=latest

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) runs build *.egg-info
