# tbegen developer tasks. `make test` is the test command CI runs (see README.md).
PYTHON ?= python3
export TBEGEN_BUILD_DIR ?= $(CURDIR)/build/ext

.PHONY: setup demo generate check test test-cuda-build test-gpu bench-gpu

# torch, where none is installed: the CUDA build where a GPU is present (nvidia-smi), else the
# CPU build (a fraction of the download). CI installs its own torch (.ci/run: the CUDA build,
# whose headers compiling the CUDA extensions needs).
TORCH_GPU ?= torch==2.14.1
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

setup:            ## install tbegen and its test dependencies (torch only if none is installed)
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "setup: keeping the installed torch"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	    echo "setup: a GPU is present: installing the CUDA build of torch ($(TORCH_GPU))"; \
	    $(PYTHON) -m pip install "$(TORCH_GPU)"; \
	else \
	    echo "setup: no GPU (no nvidia-smi): installing the CPU build of torch ($(TORCH_CPU))"; \
	    $(PYTHON) -m pip install "$(TORCH_CPU)" || $(PYTHON) -m pip install --index-url $(TORCH_CPU_INDEX) "$(TORCH_CPU)"; \
	fi
	$(PYTHON) -m pip install -q -e ".[test]"

demo: setup       ## the main job: render, build and train a small CTR model on the CPU
	@echo "demo: rendering optimizers/rowwise_adagrad.yaml into generated/rowwise_adagrad/ (C++/CUDA sources, Python module)"
	$(PYTHON) -m tbegen render --optimizer rowwise_adagrad
	@echo "demo: training a small CTR model with it on the CPU, then with PyTorch on the same batches"
	$(PYTHON) examples/ctr_training.py

generate:         ## re-render every spec into generated/
	$(PYTHON) -m tbegen render --all

check:            ## fail with a diff if generated/ is not a fresh render
	$(PYTHON) -m tbegen check

# pytest's worker processes where pytest-xdist is installed (the test extra has it): each test file
# runs whole in one worker (--dist loadfile: its module fixtures built once)
JOBS ?= 2

test:             ## CPU suite + compile-and-link of every CUDA extension (where nvcc exists)
	$(PYTHON) -m tbegen check
	$(PYTHON) -m pytest -q $$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n $(JOBS) --dist loadfile")

test-gpu:         ## on a GPU machine: the CUDA suite, sanitizers, benchmarks
	benchmarks/run_gpu.sh
